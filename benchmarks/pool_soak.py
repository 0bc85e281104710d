"""Soak of the shared n-gram pool's memory (issue 25, ``python -m benchmarks.research --pool-soak``).

Many requests (1,000 by default) go through one :class:`~llamaspec.engine.Engine` with llamaspec's defaults
without a draft model (``auto``: ngram-lookup and the shared pool, :mod:`llamaspec.drafters.ngram_pool`) and a
pool bound (``--spec-pool-tokens``): many distinct prompts (random word sequences; every fourth request
repeats an earlier prompt, so drafts come from the pool and its LRU order moves), short outputs, greedy and
sampled, three tenants (the pool's owners), ``n_parallel`` slots busy at once, every thirteenth request
cancelled after its first tokens. After **every** engine step the pool is checked against its bound:

* finished tokens held <= the budget (``n_finished_tokens``, and the sum over finished sequences);
* all tokens held <= budget + the live sequences' bound (``n_parallel`` x the context per slot);
* index entries <= ``2 x len(keys)`` per token held (the module's own claim);
* sequences held <= finished ones that fit + one live per slot;

and every ``bytes_every`` steps (and at the end) its bytes are measured (token arrays, index dicts and the
int objects in them, ``sys.getsizeof``), against ``bytes_bound`` = (budget + live bound) x
:data:`BYTES_PER_TOKEN_BOUND`. The report gives the high-water marks, bytes per token held at the end, the
evictions, pool drafts and accepted tokens, and the process's resident memory before and after.
"""
from __future__ import annotations

import os
import random
import sys
import time
from typing import Callable

__all__ = ["run_soak", "pool_bytes", "check_pool", "BYTES_PER_TOKEN_BOUND", "render_soak_markdown"]

#: bytes per token held the pool may use: 4 for the token, and per index entry (2 x len(keys) per token at
#: most) a dict slot with its share of free slots (< 3 x 32 bytes) plus the key and value int objects (36 + 32)
BYTES_PER_TOKEN_BOUND = 4 + 2 * 2 * (96 + 36 + 32)

WORDS = ("apple river stone cloud garden window bridge candle forest letter market silver winter summer "
         "engine paper mirror valley orange castle pocket ladder harbor button planet signal meadow copper "
         "rocket shadow thunder violet jacket pencil island number basket circle dragon feather hammer "
         "lantern marble needle oyster puzzle quartz saddle ticket velvet wagon yellow zebra anchor blossom").split()


def _prompt(rng: random.Random, i: int) -> str:
    n = rng.randint(12, 48)
    return f"Note {i}: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def pool_bytes(pool) -> int:
    """Bytes the pool holds (its sequences' token arrays, its index dicts and their int keys and values)."""
    b = sys.getsizeof(pool.seqs) + sys.getsizeof(pool.finished)
    for s in pool.seqs.values():
        b += sys.getsizeof(s) + sys.getsizeof(s.toks)
    for d in (*pool.idx, *pool.idx2):
        b += sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())
    return b


def check_pool(pool, n_parallel: int, n_ctx_seq: int) -> list[str]:
    """The bound's violations now (empty: none)."""
    bad = []
    fin = sum(len(pool.seqs[u].toks) for u in pool.finished)
    n_tok = pool.n_tokens
    live_bound = n_parallel * n_ctx_seq
    if pool.n_finished_tokens > pool.budget or fin != pool.n_finished_tokens:
        bad.append(f"finished tokens {pool.n_finished_tokens} (sum {fin}) over the budget {pool.budget}")
    if n_tok > pool.budget + live_bound:
        bad.append(f"tokens held {n_tok} > budget {pool.budget} + live bound {live_bound}")
    if pool.n_entries > 2 * len(pool.keys) * n_tok:
        bad.append(f"index entries {pool.n_entries} > {2 * len(pool.keys)} x tokens held {n_tok}")
    n_live = sum(1 for s in pool.seqs.values() if s.live)
    if n_live > n_parallel or len(pool.seqs) - n_live != len(pool.finished):
        bad.append(f"{n_live} live sequences for {n_parallel} slots, {len(pool.seqs) - n_live} finished of "
                   f"{len(pool.finished)} listed")
    return bad


def _find_pool(engine):
    for d in engine.chain.impls if engine.chain is not None else ():
        if getattr(d, "pool", None) is not None:
            return d.pool
    raise RuntimeError("the engine has no shared pool (spec types must include auto or ngram-lookup)")


def run_soak(model: str, *, n_requests: int = 1000, pool_tokens: int = 16384, n_parallel: int = 4, n_predict: int = 16,
             n_ctx: int = 2048, threads: int = 0, seed: int = 7, bytes_every: int = 10, exact: bool = False,
             progress: Callable[[str], None] = lambda s: None) -> dict:
    from llamaspec import _llama as llama
    from llamaspec.engine import Engine
    from llamaspec.options import RequestOptions
    from llamaspec.params import SpecParams

    spec = SpecParams()
    spec.add_types("auto")
    spec.ngram_lookup.pool_tokens = pool_tokens
    rng = random.Random(seed)
    t0 = time.time()
    kw = dict(flash_attn=False, kv_f32=True) if exact else dict(flash_attn=True)
    with llama.Model(model) as m, Engine(m, spec=spec, n_ctx=n_ctx * n_parallel, n_parallel=n_parallel,
                                         n_threads=threads or None, **kw) as eng:
        drafting = _find_pool(eng)
        pool = drafting.pool
        rss0 = _rss_mb()
        prompts: list[str] = []
        pending, live = list(range(n_requests)), []
        n_steps = n_done = n_cancelled = n_failed = 0
        hi = {"tokens": 0, "finished_tokens": 0, "entries": 0, "bytes": 0, "seqs": 0}
        violations: list[str] = []
        samples = []
        while pending or live:
            while pending and len(live) < 2 * n_parallel:
                i = pending.pop(0)
                text = prompts[rng.randrange(len(prompts))] if prompts and i % 4 == 3 else _prompt(rng, i)
                prompts.append(text)
                samp = (llama.SamplingParams(temp=0.0) if i % 3 else
                        llama.SamplingParams(temp=0.8, top_k=40, top_p=0.95, seed=seed + i))
                req = eng.submit(text, RequestOptions(n_predict=n_predict, sampling=samp, owner=("", "tenant-a", "tenant-b")[i % 3]))
                live.append((i, req))
            eng.step()
            n_steps += 1
            for i, req in list(live):
                if req.done:
                    live.remove((i, req))
                    n_done += 1
                    n_failed += req.finish_reason is not None and req.finish_reason.name == "ERROR"
                elif i % 13 == 12 and req.has_output:
                    req.cancel()
                    n_cancelled += 1
                    live.remove((i, req))
                    n_done += 1
            bad = check_pool(pool, n_parallel, eng.n_ctx_seq)
            if bad and len(violations) < 20:
                violations += [f"step {n_steps}: {b}" for b in bad]
            hi["tokens"] = max(hi["tokens"], pool.n_tokens)
            hi["finished_tokens"] = max(hi["finished_tokens"], pool.n_finished_tokens)
            hi["entries"] = max(hi["entries"], pool.n_entries)
            hi["seqs"] = max(hi["seqs"], len(pool.seqs))
            if n_steps % bytes_every == 0 or not (pending or live):
                b = pool_bytes(pool)
                hi["bytes"] = max(hi["bytes"], b)
                samples.append((n_done, pool.n_tokens, b))
            if n_steps % 200 == 0:
                progress(f"step {n_steps}: {n_done}/{n_requests} requests done, pool {pool.n_tokens} tokens "
                         f"({pool.n_finished_tokens} finished), {pool.n_entries} entries, {pool.n_evicted} evicted")
        live_bound = n_parallel * eng.n_ctx_seq
        bound = (pool_tokens + live_bound) * BYTES_PER_TOKEN_BOUND
        if hi["bytes"] > bound:
            violations.append(f"pool bytes {hi['bytes']} > bound {bound}")
        end_bytes = pool_bytes(pool)
        info = pool.info()
        out = {"kind": "pool-soak", "model": model, "n_requests": n_requests, "n_done": n_done, "n_cancelled": n_cancelled,
               "n_failed": int(n_failed), "n_steps": n_steps, "pool_tokens": pool_tokens, "n_parallel": n_parallel,
               "n_ctx_seq": eng.n_ctx_seq, "n_predict": n_predict, "live_bound_tokens": live_bound,
               "bytes_bound": bound, "bytes_per_token_bound": BYTES_PER_TOKEN_BOUND, "high_water": hi,
               "end": {**info, "bytes": end_bytes,
                       "bytes_per_token": round(end_bytes / info["n_tokens"], 1) if info["n_tokens"] else None},
               "pool_drafts": drafting.n_drafts, "pool_accepted": drafting.n_accepted,
               "rss_mb": {"start": round(rss0, 1), "end": round(_rss_mb(), 1)},
               "samples": samples[:: max(1, len(samples) // 50)], "violations": violations, "ok": not violations,
               "duration_s": round(time.time() - t0, 1)}
    return out


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # pragma: no cover - not Linux
        return 0.0


def render_soak_markdown(r: dict, command: str | None = None) -> str:
    hi, end = r["high_water"], r["end"]
    return "\n".join([
        "# Shared n-gram pool: memory over a soak (issue 25)", "",
        f"- command: `{command or 'python -m benchmarks.research --pool-soak'}`; {r['duration_s'] / 60:.1f} min",
        f"- model `{r['model']}`, {r['n_requests']} requests ({r['n_cancelled']} cancelled, {r['n_failed']} failed), "
        f"{r['n_predict']} tokens each, {r['n_parallel']} slots of {r['n_ctx_seq']} tokens, pool budget "
        f"{r['pool_tokens']} tokens (finished requests) + live bound {r['live_bound_tokens']}",
        f"- checked after each of {r['n_steps']} engine steps: **{'no violation' if r['ok'] else 'VIOLATIONS'}**", "",
        "| | high-water | at the end | bound |", "|---|---:|---:|---:|",
        f"| finished tokens | {hi['finished_tokens']} | {end['n_finished_tokens']} | {r['pool_tokens']} |",
        f"| tokens held | {hi['tokens']} | {end['n_tokens']} | {r['pool_tokens'] + r['live_bound_tokens']} |",
        f"| index entries | {hi['entries']} | {end['n_entries']} | 4 per token held |",
        f"| bytes | {hi['bytes']} | {end['bytes']} ({end['bytes_per_token']} per token) | {r['bytes_bound']} |",
        f"| sequences | {hi['seqs']} | {end['n_seqs']} | |", "",
        f"{end['n_evicted']} sequences evicted; {r['pool_drafts']} drafts from the pool, {r['pool_accepted']} of their "
        f"tokens accepted; resident memory {r['rss_mb']['start']} -> {r['rss_mb']['end']} MB.",
        *([""] + [f"- {v}" for v in r["violations"]] if r["violations"] else []), ""])
