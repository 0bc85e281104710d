"""Capability probe: the memory level of a context (§6.1) and a "will speculation pay off" report.

The levels themselves (:class:`~llamaspec.level.Level`) are defined in :mod:`llamaspec.level`.

:func:`can_seq_rm` **wipes the context's memory**; run it on a scratch context before real work.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Sequence

from . import _llama as llama
from .errors import DecodeError, UsageError
from .level import Level
from .vocab import check_vocab_compat, is_compatible

SCHEMA_VERSION = 1
DEFAULT_RS_PROBE = 8  # n_rs_seq requested when asking "is RS available?"
ACCEPTANCE_RATES = (0.5, 0.6, 0.7, 0.8, 0.9)
VERIFY_SIZES = (1, 2, 4, 8, 16)


def can_seq_rm(ctx: llama.Context) -> Level:
    """The exact algorithm of llama.cpp's ``common_context_can_seq_rm`` (§6.1). Wipes memory."""
    mem = ctx.memory
    if mem is None:
        return Level.NO
    if ctx.n_rs_seq > 0:
        return Level.RS
    mem.clear(True)
    try:
        pos0 = mem.pos_max(0) + 1
        ctx.decode([llama.Row(0, pos0, 0, False), llama.Row(0, pos0 + 1, 0, True)])
    except DecodeError:
        return Level.NO
    ok = mem.seq_rm(0, 1, -1)
    mem.clear(True)
    ctx.synchronize()
    return Level.PART if ok else Level.FULL


@dataclass
class LevelProbe:
    level: Level
    level_with_rs: Level
    n_rs_seq: int  # n_rs_seq the context actually got when RS was requested (0 = unsupported)


def probe_levels(model: llama.Model, *, n_rs_seq: int = DEFAULT_RS_PROBE, n_ctx: int = 64, n_threads: int | None = None,
                 n_threads_batch: int | None = None) -> LevelProbe:
    """Probe ``model`` on scratch contexts: level with ``n_rs_seq = 0`` and with ``n_rs_seq`` requested."""
    n_ctx = _scratch_ctx(model, n_ctx)
    got = []
    for rs in (0, n_rs_seq):
        with llama.Context(model, n_ctx=n_ctx, n_batch=16, n_ubatch=16, n_rs_seq=rs, n_threads=n_threads,
                           n_threads_batch=n_threads_batch) as ctx:
            got.append((can_seq_rm(ctx), ctx.n_rs_seq))
    return LevelProbe(got[0][0], got[1][0], got[1][1])


def _scratch_ctx(model: llama.Model, n_ctx: int) -> int:
    return max(min(n_ctx, model.n_ctx_train) if model.n_ctx_train > 0 else n_ctx, 16)


# ---------------------------------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------------------------------


def _filler_tokens(model: llama.Model, n: int) -> list[int]:
    """Deterministic, non-degenerate token ids (skipping the first few, often special, ids)."""
    v = model.vocab.n_tokens
    lo = min(10, v - 1)
    span = max(1, v - lo)
    return [lo + (i * 7919) % span for i in range(n)]


def measure_checkpoint(model: llama.Model, *, n_tokens: int = 1024, n_threads: int | None = None, repeats: int = 3,
                       n_threads_batch: int | None = None) -> dict:
    """Size and save/load time of a PARTIAL_ONLY sequence state after ``n_tokens`` tokens (a report's
    ``checkpoint``: the medians of ``repeats``, and per 1k tokens)."""
    n_ctx = _scratch_ctx(model, n_tokens + 16)
    n_tokens = min(n_tokens, n_ctx - 8)
    with llama.Context(model, n_ctx=n_ctx, n_batch=min(512, n_ctx), n_threads=n_threads, n_threads_batch=n_threads_batch) as ctx:
        ctx.decode_tokens(_filler_tokens(model, n_tokens), 0, 0, output_last=True)
        flags = llama.STATE_FLAGS_PARTIAL_ONLY
        full = ctx.state_seq_size(0, llama.STATE_FLAGS_NONE)
        saves, loads = [], []
        data = b""
        for _ in range(repeats):
            t0 = time.perf_counter()
            data = ctx.state_seq_get(0, flags)
            t1 = time.perf_counter()
            ctx.state_seq_set(0, data, flags)
            t2 = time.perf_counter()
            saves.append((t1 - t0) * 1e3)
            loads.append((t2 - t1) * 1e3)
    save, load, s = statistics.median(saves), statistics.median(loads), 1000.0 / n_tokens
    return {"n_tokens": n_tokens, "partial_bytes": len(data), "full_bytes": full, "save_ms": round(save, 4),
            "load_ms": round(load, 4), "partial_bytes_per_1k": round(len(data) * s),
            "save_ms_per_1k": round(save * s, 3), "load_ms_per_1k": round(load * s, 3)}


def measure_verify_curve(
    model: llama.Model, *, sizes: Sequence[int] = VERIFY_SIZES, n_prefix: int = 32, repeats: int = 3, n_threads: int | None = None,
    n_threads_batch: int | None = None,
) -> dict[int, float]:
    """Milliseconds to decode ``n`` tokens of one sequence in one batch with logits for every row."""
    n_max = max(sizes)
    n_ctx = _scratch_ctx(model, n_prefix + n_max + 16)
    n_prefix = min(n_prefix, n_ctx - n_max - 8)
    toks = _filler_tokens(model, n_prefix + n_max)
    out: dict[int, float] = {}
    with llama.Context(model, n_ctx=n_ctx, n_batch=max(n_max, n_prefix), n_outputs_max=n_max, n_threads=n_threads,
                       n_threads_batch=n_threads_batch) as ctx:
        mem = ctx.memory
        # warm-up
        ctx.decode_tokens(toks[:n_prefix], 0, 0)
        for n in sizes:
            ts = []
            for _ in range(repeats):
                mem.clear(True)
                ctx.decode_tokens(toks[:n_prefix], 0, 0)
                rows = [llama.Row(t, n_prefix + j, 0, True) for j, t in enumerate(toks[n_prefix : n_prefix + n])]
                ctx.synchronize()
                t0 = time.perf_counter()
                ctx.decode(rows)
                ctx.logits(n - 1)
                ctx.synchronize()
                ts.append((time.perf_counter() - t0) * 1e3)
            out[n] = statistics.median(ts)
    return out


def relative_verify_cost(curve: dict[int, float], n: int) -> float:
    """Cost of verifying ``n`` rows relative to one row, linear interpolation of the measured curve."""
    pts = sorted(curve.items())
    base = curve.get(1) or pts[0][1]
    if n <= pts[0][0]:
        return pts[0][1] / base
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= n <= x1:
            return (y0 + (y1 - y0) * (n - x0) / (x1 - x0)) / base
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return (y1 + (y1 - y0) * (n - x1) / (x1 - x0)) / base


def expected_speedup(a: float, k: int, c: float, v: float) -> float:
    """Standard speculative-decoding speedup: ``(1 - a^(k+1)) / ((1 - a) (k c + v))``.

    ``a`` = per-token acceptance, ``k`` = draft length, ``c`` = draft cost per token relative to the target,
    ``v`` = cost of verifying ``k + 1`` rows relative to decoding one.

    >>> round(expected_speedup(0.8, 4, 0.0, 1.0), 3)
    3.362
    >>> expected_speedup(0.5, 0, 0.1, 1.0)
    1.0
    """
    if a >= 1.0:
        return (k + 1) / (k * c + v)
    return (1 - a ** (k + 1)) / ((1 - a) * (k * c + v))


def recommend_draft_length(a: float, c: float, curve: dict[int, float], k_max: int = 16) -> tuple[int, float]:
    """Draft length maximising :func:`expected_speedup`, and that speedup (k = 0 means "don't draft")."""
    best_k, best = 0, 1.0
    for k in range(1, k_max + 1):
        s = expected_speedup(a, k, c, relative_verify_cost(curve, k + 1))
        if s > best + 1e-9:
            best_k, best = k, s
    return best_k, best


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------


@dataclass
class ProbeReport:
    #: what :func:`report_model` returns, for the target and the draft
    target: dict
    draft: dict | None = None
    vocab: list[dict] | None = None
    vocab_compatible: bool | None = None
    cost_ratio: float | None = None
    recommendations: list[dict] = field(default_factory=list)
    #: same-trunk draft heads: ``{"draft-mtp": {"supported": bool, "why": str | None}, ...}`` (issue 10)
    heads: dict = field(default_factory=dict)

    @staticmethod
    def _model(m: dict) -> dict:
        curve = m["verify_cost_ms"]
        return {**m, "verify_cost_ms": None if curve is None else {str(k): round(v, 4) for k, v in curve.items()}}

    def to_dict(self) -> dict:
        d: dict = {"schema_version": SCHEMA_VERSION, "target": self._model(self.target)}
        if self.heads:
            d["heads"] = self.heads
        if self.draft is not None:
            d["draft"] = self._model(self.draft)
            d["vocab"] = {"compatible": self.vocab_compatible, "rules": self.vocab}
            d["cost_ratio"] = None if self.cost_ratio is None else round(self.cost_ratio, 4)
        d["recommendations"] = self.recommendations
        return d


def report_model(model: llama.Model, *, measure: bool = True, n_rs_seq: int = DEFAULT_RS_PROBE, n_threads: int | None = None,
                 checkpoint_tokens: int = 1024, n_threads_batch: int | None = None) -> dict:
    """One model's part of the report: its levels and shape, and (``measure``) :func:`measure_checkpoint` and
    :func:`measure_verify_curve` (None without them)."""
    lv = probe_levels(model, n_rs_seq=n_rs_seq, n_threads=n_threads, n_threads_batch=n_threads_batch)
    r = {"path": str(model.path), "arch": model.arch, "name": model.name, "level": lv.level.name,
         "level_with_rs": lv.level_with_rs.name, "n_rs_seq": lv.n_rs_seq, "file_bytes": model.path.stat().st_size,
         "n_params": model.n_params, "n_ctx_train": model.n_ctx_train, "n_layer": model.n_layer,
         "n_embd": model.n_embd, "n_vocab": model.vocab.n_tokens, "n_swa": model.n_swa, "is_swa": model.is_swa,
         "is_recurrent": model.is_recurrent, "is_hybrid": model.is_hybrid, "n_layer_nextn": model.n_layer_nextn,
         "checkpoint": None, "verify_cost_ms": None}
    if measure and lv.level is not Level.NO:
        r["checkpoint"] = measure_checkpoint(model, n_tokens=checkpoint_tokens, n_threads=n_threads,
                                             n_threads_batch=n_threads_batch)
        r["verify_cost_ms"] = measure_verify_curve(model, n_threads=n_threads, n_threads_batch=n_threads_batch)
    return r


def probe(target: llama.Model, draft: llama.Model | None = None, *, measure: bool = True, n_rs_seq: int = DEFAULT_RS_PROBE,
          n_threads: int | None = None, checkpoint_tokens: int = 1024, n_threads_batch: int | None = None,
          n_threads_draft: int | None = None) -> ProbeReport:
    """Everything the ``llamaspec probe`` command reports, as a dataclass (``to_dict()`` for JSON).

    Threads as llama.cpp's ``-t``/``-tb``/``-td``: the draft generates with ``n_threads_draft`` (default
    ``n_threads``) and processes batches with the target's ``n_threads_batch``."""
    from .drafters.mtp import gguf_is_mtp_head_only

    if target.n_layer_nextn > 0 and gguf_is_mtp_head_only(target.path):
        raise UsageError(f"{target.path.name} is an MTP head without trunk layers: probe its target, with it as -md")
    rep = ProbeReport(target=report_model(target, measure=measure, n_rs_seq=n_rs_seq, n_threads=n_threads,
                                          checkpoint_tokens=checkpoint_tokens, n_threads_batch=n_threads_batch))
    head_only = draft is not None and (draft.arch in ("eagle3", "dflash")
                                       or (draft.n_layer_nextn > 0 and gguf_is_mtp_head_only(draft.path)))
    if draft is not None and not head_only:  # a head has no context of its own: `heads`
        rep.draft = report_model(draft, measure=measure, n_rs_seq=n_rs_seq, n_threads=n_threads_draft or n_threads,
                                 checkpoint_tokens=checkpoint_tokens, n_threads_batch=n_threads_batch or n_threads)
        rules = check_vocab_compat(target.vocab, draft.vocab)
        rep.vocab = [x.to_dict() for x in rules]
        rep.vocab_compatible = is_compatible(rules)
        if rep.target["verify_cost_ms"] and rep.draft["verify_cost_ms"]:
            rep.cost_ratio = rep.draft["verify_cost_ms"][1] / rep.target["verify_cost_ms"][1]
    rep.heads.update(heads_report(target, draft))
    curve = rep.target["verify_cost_ms"]
    if curve:
        drafters = [("ngram", 0.0)]
        if rep.cost_ratio is not None:
            drafters.append(("draft-model", rep.cost_ratio))
        for kind, c in drafters:
            for a in ACCEPTANCE_RATES:
                k, s = recommend_draft_length(a, c, curve)
                rep.recommendations.append({"drafter": kind, "cost_ratio": round(c, 4), "acceptance": a,
                                            "n_max": k, "expected_speedup": round(s, 3)})
    return rep


def heads_report(target: llama.Model, draft: llama.Model | None = None) -> dict:
    """Whether each same-trunk head drafter can run on this target (/ draft) pair, and why not."""
    from .drafters.mtp import mtp_support

    out: dict = {}
    # draft-mtp: an MTP -md file carries the head, else the target's own nextn layers (loaded with load_mtp)
    why = mtp_support(draft if draft is not None and draft.n_layer_nextn > 0 else target, loaded_with_mtp=True)
    out["draft-mtp"] = {"supported": why is None, "why": why}
    from .drafters.heads import head_support  # draft-eagle3 / draft-dflash / draft-dspark

    out.update(head_support(target, draft))
    return out
