#!/usr/bin/env python3
"""Speed / memory budgets of the n-gram drafters (issue 4), printed as a table.

Not a unit test: timings depend on the machine. Run ``python scripts/bench_ngram.py [--repeat N]``.
Histories are synthetic "copy-heavy" token lists (a random 8,192-token text whose second half repeats
stretches of the first half), given to the drafters as Python lists, as the chain does.

``--simulate`` adds a model-free acceptance table: a greedy target whose output is known in advance (word-
level tokens of this repository's n-gram sources, "repeated with one change": an identifier renamed) is
verified against each drafter's drafts, as the chain would, with the QUIRKs replicated and with the opt-in
fixes. It shows what the fixes change; real-model numbers belong to the end-to-end runs.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec.drafters.base import DraftParams  # noqa: E402
from llamaspec.drafters.ngram_cache import NgramCache, build_cache  # noqa: E402
from llamaspec.drafters.ngram_map import NgramMapK, NgramMapK4V  # noqa: E402
from llamaspec.drafters.ngram_mod import NgramMod  # noqa: E402
from llamaspec.drafters.ngram_simple import NgramSimple  # noqa: E402
from llamaspec.params import NgramCacheParams, NgramMapParams, NgramModParams  # noqa: E402


def copy_heavy(n_tokens: int, vocab: int = 32000, seed: int = 0) -> list[int]:
    """Random first half; the second half copies random 100..400-token stretches of what came before."""
    rng = np.random.default_rng(seed)
    half = n_tokens // 2
    toks = rng.integers(0, vocab, half).tolist()
    while len(toks) < n_tokens:
        ln = int(rng.integers(100, 400))
        st = int(rng.integers(0, len(toks) - ln))
        toks.extend(toks[st: st + ln])
        toks.append(int(rng.integers(0, vocab)))  # an edit
    return toks[:n_tokens]


def timeit(fn, repeat: int) -> float:
    """Median milliseconds of ``fn()`` over ``repeat`` runs."""
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(ts)


def draft_once(d, seq_id: int, hist: list[int], id_last: int) -> list[int]:
    dps = [DraftParams() for _ in range(d.n_seq)]
    dps[seq_id] = DraftParams(drafting=True, prompt=hist, id_last=id_last, n_max=-1)
    d.draft(dps)
    return dps[seq_id].result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--simulate", action="store_true", help="also print the model-free acceptance table")
    args = ap.parse_args()
    R = args.repeat
    N = args.tokens
    hist = copy_heavy(N + 64)
    prompt, rest = hist[:N], hist[N:]
    rows: list[tuple[str, float, float, str]] = []  # what, measured, budget, unit

    # ngram-mod: begin on the prompt, then a 64-token draft (n_min 0 so a full draft is timed)
    d = NgramMod(1, NgramModParams())

    def mod_begin():
        d.reset()
        d.begin(0, prompt)
    rows.append(("ngram-mod begin, 8192-token prompt", timeit(mod_begin, R), 50.0, "ms"))
    # a history that loops so that the table always answers: a 64-token draft every time
    dloop = NgramMod(1, NgramModParams(n_match=24, n_min=0, n_max=64))
    loop = (prompt[:500] * 20)[:N]
    dloop.begin(0, loop)
    res = draft_once(dloop, 0, loop, loop[N - 500])
    assert len(res) == 64, len(res)
    rows.append(("ngram-mod draft, 64 tokens (8192 history)", timeit(lambda: draft_once(dloop, 0, loop, loop[N - 500]), R * 5), 1.0, "ms"))
    # chunked indexing cost: a draft that must add 40 new tokens first
    dgrow = NgramMod(1, NgramModParams())
    dgrow.begin(0, prompt)

    def mod_grow():
        dgrow.i_last[0] = N - 24 - 40
        draft_once(dgrow, 0, prompt, rest[0])
    rows.append(("ngram-mod draft incl. 40-token chunk index", timeit(mod_grow, R * 5), 1.0, "ms"))
    for n_seq in (1, 64):
        gc.collect()
        tracemalloc.start()
        dm = NgramMod(n_seq, NgramModParams())
        for s in range(min(n_seq, 4)):
            dm.begin(s, prompt)
        cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rows.append((f"ngram-mod memory, n_seq={n_seq}", cur / 2**20, 20.0, "MiB"))
        del dm

    # ngram-map-k: first draft after begin indexes the whole prompt; steady state adds a few tokens
    p = NgramMapParams()
    for cls in (NgramMapK, NgramMapK4V):
        def first():
            dk = cls(1, p)
            dk.begin(0, prompt)
            t0 = time.perf_counter()
            draft_once(dk, 0, prompt, rest[0])
            return (time.perf_counter() - t0) * 1000.0
        rows.append((f"{cls.type} first draft (indexes 8192 tokens)", statistics.median(first() for _ in range(R)), 2.0, "ms"))
        dk = cls(1, p)
        dk.begin(0, prompt)
        h = list(prompt)
        draft_once(dk, 0, h, rest[0])
        ts = []
        for i in range(len(rest) - 1):
            h.append(rest[i])
            t0 = time.perf_counter()
            draft_once(dk, 0, h, rest[i + 1])
            ts.append((time.perf_counter() - t0) * 1000.0)
            dk.accept(0, 3, False)
        rows.append((f"{cls.type} draft, steady state (8192+ history)", statistics.median(ts), 2.0, "ms"))

    ds = NgramSimple(1, p)
    rows.append(("ngram-simple draft (8192 history)", timeit(lambda: draft_once(ds, 0, prompt, rest[0]), R), float("nan"), "ms"))

    # ngram-cache: with a static cache built from the prompt (2-grams) to exercise all three levels
    static = build_cache([prompt])
    dc = NgramCache(1, NgramCacheParams())
    dc.static = static

    def cache_begin():
        dc.context[0], dc.cache_size[0] = {}, 0
        dc.begin(0, prompt)
    rows.append(("ngram-cache begin (pre-indexes 8192 tokens)", timeit(cache_begin, R), float("nan"), "ms"))

    def cache_first():
        cache_begin()
        t0 = time.perf_counter()
        draft_once(dc, 0, prompt, rest[0])
        return (time.perf_counter() - t0) * 1000.0
    rows.append(("ngram-cache first draft after begin", statistics.median(cache_first() for _ in range(R)), 2.0, "ms"))

    def cache_first_nobegin():
        dc.context[0], dc.cache_size[0] = {}, 0
        draft_once(dc, 0, prompt, rest[0])
    rows.append(("ngram-cache first draft without begin (llama.cpp's way)", timeit(cache_first_nobegin, R), float("nan"), "ms"))
    cache_begin()
    h = list(prompt)
    draft_once(dc, 0, h, rest[0])
    ts = []
    for i in range(len(rest) - 1):
        h.append(rest[i])
        t0 = time.perf_counter()
        draft_once(dc, 0, h, rest[i + 1])
        ts.append((time.perf_counter() - t0) * 1000.0)
    rows.append(("ngram-cache draft, steady state", statistics.median(ts), 2.0, "ms"))

    print_rows(rows)
    if args.simulate:
        print()
        simulate()
    return 0


def print_rows(rows) -> None:
    w = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{w}}  {'measured':>10}  {'budget':>10}  verdict")
    for what, val, budget, unit in rows:
        b = f"< {budget:g} {unit}" if budget == budget else "-"
        verdict = "-" if budget != budget else ("ok" if val < budget else "OVER")
        print(f"{what:<{w}}  {val:>7.3f} {unit:<3}  {b:>10}  {verdict}")


def word_tokens(text: str, vocab: dict[str, int], split_punct: bool = False) -> list[int]:
    """Crude BPE stand-in: words, runs of punctuation (or single punctuation characters), newlines."""
    import re

    pat = r"\w+|[^\w\s]|\n" if split_punct else r"\w+|[^\w\s]+|\n"
    return [vocab.setdefault(w, len(vocab)) for w in re.findall(pat, text)]


def run_sim(d, prompt: list[int], out: list[int]) -> dict:
    """Greedy speculative decoding of the known output ``out`` after ``prompt`` with one drafter."""
    hist = list(prompt)
    d.begin(0, hist)
    id_last, pos = out[0], 1
    steps = drafts = drafted = accepted = 0
    while pos < len(out):
        dp = DraftParams(drafting=True, prompt=hist, id_last=id_last, n_max=-1)
        d.draft([dp])
        dr = dp.result
        n_acc = 0
        while n_acc < len(dr) and pos + n_acc < len(out) and dr[n_acc] == out[pos + n_acc]:
            n_acc += 1
        if dr:
            drafts += 1
            drafted += len(dr)
            accepted += n_acc
            d.accept(0, n_acc, False)
        steps += 1
        hist = hist + [id_last] + dr[:n_acc]
        if pos + n_acc >= len(out):
            break
        id_last = out[pos + n_acc]
        pos += n_acc + 1
    return {"steps": steps, "tokens": len(out), "drafts": drafts, "drafted": drafted, "accepted": accepted}


def simulate() -> None:
    root = Path(__file__).resolve().parents[1] / "llamaspec" / "drafters"
    vocab: dict[str, int] = {}
    src = (root / "ngram_map.py").read_text()
    other = (root / "ngram_cache.py").read_text()
    prompt = word_tokens("Repeat this code, renaming key_idx to key_pos:\n" + src, vocab)
    copy = word_tokens(src.replace("key_idx", "key_pos"), vocab)
    fresh = word_tokens(other, vocab)
    # the same copy with every punctuation character a token: long runs of identical tokens (the "# ----"
    # separator lines), i.e. very repetitive text
    prompt_r = word_tokens("Repeat this code, renaming key_idx to key_pos:\n" + src, vocab, True)
    copy_r = word_tokens(src.replace("key_idx", "key_pos"), vocab, True)
    cases = [("copy with a rename", prompt, copy), ("copy, repetitive", prompt_r, copy_r),
             ("unrelated text", prompt, fresh)]
    p = NgramMapParams()
    makers = [
        ("ngram-simple", lambda f: NgramSimple(1, p, fix_quirks=f)),
        ("ngram-map-k", lambda f: NgramMapK(1, p, fix_quirks=f)),
        ("ngram-map-k4v", lambda f: NgramMapK4V(1, p, fix_quirks=f)),
        ("ngram-mod", lambda f: NgramMod(1, NgramModParams(), fix_quirks=f)),
        ("ngram-cache", lambda f: NgramCache(1, NgramCacheParams(), fix_quirks=f)),
    ]
    print("simulated greedy decoding (word tokens; tokens/step = target tokens per verification step)")
    print(f"{'case':<20} {'drafter':<14} {'mode':<6} {'tok/step':>8} {'drafts':>7} {'drafted':>8} {'accepted':>8} {'acc rate':>8}")
    for case, pr, out in cases:
        for name, mk in makers:
            for fix in (False, True):
                if name == "ngram-mod" and fix:
                    continue  # no QUIRK fixes exist for ngram-mod
                r = run_sim(mk(fix), pr, out)
                rate = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                print(f"{case:<20} {name:<14} {'fixed' if fix else 'quirk':<6} {r['tokens'] / r['steps']:>8.2f} "
                      f"{r['drafts']:>7} {r['drafted']:>8} {r['accepted']:>8} {rate:>8.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
