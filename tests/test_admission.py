"""A request whose start fails is never lost (issue 21, finding 1): it finishes with ``error``, its consumer
does not wait forever, the exception does not surface in another caller, and the engine goes on.

The failure is injected where real ones happen (a state load of the prompt cache, a drafter's ``set_state``,
an RPC error): inside the scheduler's start of a request, after it left the queue.
"""
from __future__ import annotations

import threading

import pytest

from llamaspec import scheduler as S
from llamaspec.engine import Engine, FinishReason, RequestState
from llamaspec.errors import StateError
from llamaspec.params import SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT

PROMPT = [1, 5, 9, 13, 22, 7]


def _spec() -> SpecParams:
    p = SpecParams()
    p.draft.n_max = 3
    p.draft_adaptive = False
    return p


@pytest.fixture
def fail_next_start(monkeypatch):
    """The next ``n`` request starts raise StateError, as a failed prompt-cache load does."""
    left = [0]
    real = S.verifier_for

    def flaky(*a, **k):
        if left[0] > 0:
            left[0] -= 1
            raise StateError("state_seq_set failed (injected)")
        return real(*a, **k)

    monkeypatch.setattr(S, "verifier_for", flaky)

    def arm(n: int = 1) -> None:
        left[0] = n

    return arm


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_failed_start_finishes_the_request_with_error(tiny_model, fail_next_start, with_draft):
    kw = dict(draft=tiny_model("llama-draft"), spec=_spec()) if with_draft else {}
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=2, **kw, **EXACT) as e:
        alone = e.generate(PROMPT, n_predict=8).tokens
        fail_next_start(1)
        bad = e.submit(PROMPT, RequestOptions(n_predict=8))  # admitted at once: the failure must not escape submit()
        res = bad.result(timeout=30)
        assert bad.state is RequestState.DONE
        assert res.finish_reason is FinishReason.ERROR
        assert "could not start" in res.error and "injected" in res.error
        # the slot it was given is free again and serves the next request exactly as before
        assert all(s["is_processing"] is False for s in e.slots_info())
        assert all(e.ctx.memory.pos_max(i) == -1 for i in range(2))  # nothing of it left in memory
        again = e.generate(PROMPT, n_predict=8)
        assert again.tokens == alone


def test_a_failed_start_does_not_surface_in_another_consumer(tiny_model, fail_next_start):
    """The failing request waits behind a busy slot, so it is admitted inside another request's step."""
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=1, **EXACT) as e:
        first = e.submit(PROMPT, RequestOptions(n_predict=12))
        second = e.submit(PROMPT[:3], RequestOptions(n_predict=4))
        assert second.state is RequestState.QUEUED
        fail_next_start(1)
        out = first.result(timeout=30)  # steps run here, and admit `second` when `first` is done
        assert out.finish_reason is not FinishReason.ERROR
        res = second.result(timeout=30)
        assert res.finish_reason is FinishReason.ERROR and "injected" in res.error


def test_a_failed_start_with_an_engine_thread_does_not_hang(tiny_model, fail_next_start):
    with Engine(tiny_model("llama"), n_ctx=256, n_parallel=1, **EXACT) as e:
        e.start()
        fail_next_start(1)
        req = e.submit(PROMPT, RequestOptions(n_predict=4))
        done = threading.Event()
        got = {}

        def consume():
            got["res"] = req.result(timeout=30)
            done.set()

        threading.Thread(target=consume, daemon=True).start()
        assert done.wait(30), "the consumer of a request whose start failed waited forever"
        assert got["res"].finish_reason is FinishReason.ERROR
        ok = e.submit(PROMPT, RequestOptions(n_predict=4)).result(timeout=30)
        assert ok.finish_reason is not FinishReason.ERROR and len(ok.tokens) == 4


def test_replay_rounds_do_not_mark_the_targets_token_as_drafted(tiny_model):
    """Issue 21, finding 4: on a FULL target a partly accepted draft is restored and replayed; the replay's
    last token is the target's own, so the drafted mask counts exactly the accepted drafted tokens."""
    p = _spec()
    with Engine(tiny_model("mamba"), draft=tiny_model("mamba-draft"), spec=p, n_ctx=256, **EXACT) as e:
        res = e.generate(PROMPT, n_predict=48)
    st = res.stats
    assert st.n_replays > 0  # the path under test ran
    assert len(res.drafted_mask) == len(res.tokens)
    # every emitted token marked as drafted is an accepted draft token (the last chunk may cut some off)
    assert sum(res.drafted_mask) <= st.n_accepted
    assert sum(res.drafted_mask) >= st.n_accepted - 3  # at most one draft's worth (n_max 3) cut at the end


def test_decode_costs_are_timed_to_the_end_of_the_work(tiny_model, monkeypatch):
    """Issue 24: on CUDA / Metal ``llama_decode`` returns before its kernels finish. A context whose decode
    returns at once and whose work ends only when waited for must still be priced by the work's time."""
    from llamaspec import _llama as L

    real_decode = L.Context.decode
    pending = {"ms": 0.0}

    def early_decode(self, rows, *a, **k):
        real_decode(self, rows, *a, **k)
        pending["ms"] = 30.0  # the "kernels" still run: 30 ms of work that only a wait sees

    def wait(self):
        import time
        time.sleep(pending["ms"] / 1e3)
        pending["ms"] = 0.0

    monkeypatch.setattr(L.Context, "decode", early_decode)
    monkeypatch.setattr(L.Context, "wait_for_outputs", wait)
    monkeypatch.setattr(L.Context, "synchronize", wait)
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=_spec(), n_ctx=256, **EXACT) as e:
        e.generate(PROMPT, n_predict=12)
        measured = e.cost_model.decode_ms
    assert measured and min(measured.values()) >= 25.0, measured
