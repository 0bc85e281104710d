"""Property-based fuzzing of :class:`~llamaspec.engine.Engine` from several threads at once (Hypothesis), on the
tiny random models: threads submit, read and cancel requests (the engine thread steps, or the readers do)
while another closes the engine. Properties: nothing hangs, nothing but ``UsageError`` / ``EngineClosedError``
escapes (nor out of a step in the engine thread), memory keeps ``seq_pos_max == n_past - 1`` between steps,
every request ends (``close()`` aborts the rest), greedy output is the request's alone, and an engine left open
has nothing left over. Plus the regression test of a ``submit`` racing ``close()``.

Each example builds and closes an engine: a few in the suite, a tenth of ``LLAMASPEC_FUZZ_EXAMPLES`` (or
``scripts/fuzz.py engine -n N``) in long runs.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llamaspec import _llama as L  # noqa: E402
from llamaspec.engine import Engine, FinishReason, SlotState  # noqa: E402
from llamaspec.errors import EngineClosedError, UsageError  # noqa: E402
from llamaspec.options import RequestOptions

from helpers import EXACT, divergence_is_near_tie  # noqa: E402
# the request strategies, the engine settings and the oracles of the single-threaded fuzzer (and its fixture)
from test_fuzz_engine import (FIXED, KINDS, N_BATCH, N_CTX, _spec, alone, check_nothing_leaked,  # noqa: E402,F401
                              text_prompts, token_prompts)

#: examples of the threaded property (each builds and closes an engine): a few in the suite, a tenth of N in long runs
THREAD_EXAMPLES = max(1, int(os.environ["LLAMASPEC_FUZZ_EXAMPLES"]) // 10) if not FIXED else 6
JOIN_S = 60.0  # a thread still running after this is a hang
thread_work = st.lists(st.tuples(st.one_of(token_prompts, text_prompts), st.integers(0, 24),
                                 st.one_of(st.none(), st.integers(0, 5))), min_size=1, max_size=5)


def _worker(eng: Engine, plans, out: list) -> None:
    """Submit each (prompt, n_predict, cancel after that many chunks) and read it to its end; ``out`` gets
    ``(outcome, plan, request)``: done / cancelled / refused (UsageError) / closed (EngineClosedError) / the
    exception that should not have happened."""
    greedy = L.SamplingParams(temp=0.0)
    for plan in plans:
        prompt, n_predict, cancel_at = plan
        req = None
        try:
            req = eng.submit(prompt, RequestOptions(n_predict=n_predict, sampling=greedy))
            for i, _ in enumerate(req.chunks(timeout=JOIN_S)):
                if cancel_at is not None and i >= cancel_at:
                    req.cancel()
                    break
            req.result(timeout=JOIN_S)
            out.append(("cancelled" if cancel_at is not None else "done", plan, req))
        except UsageError:
            out.append(("refused", plan, req))
        except EngineClosedError:
            out.append(("closed", plan, req))
            return
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out.append((e, plan, req))
            return


def _check_memory(eng: Engine, stop, bad: list) -> None:
    """Between steps (under the step lock): every generating slot has ``seq_pos_max == n_past - 1``."""
    while not stop.is_set():
        with eng._stepper.lock:
            if eng.closed:
                return
            for s in eng.scheduler.active:
                if s.state is SlotState.GENERATING and eng.ctx.memory.pos_max(s.seq_id) != s.n_past - 1:
                    bad.append((s.id, eng.ctx.memory.pos_max(s.seq_id), s.n_past))
        stop.wait(0.002)


@settings(max_examples=THREAD_EXAMPLES, deadline=None, derandomize=FIXED, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kind=st.sampled_from(["none", "draft-simple", "ngram-simple"]), work=st.lists(thread_work, min_size=2, max_size=4),
       close_after=st.one_of(st.none(), st.floats(0.0, 0.15)), background=st.booleans())
def test_threads_race_submit_cancel_and_close(tiny_model, alone, kind, work, close_after, background):
    """The module's properties (see its docstring) for one mix of threads, spec type and close time."""
    class Escaped(logging.Handler):  # an exception out of a step (the engine thread logs it and goes on)
        def emit(self, record):
            if record.exc_info:
                escaped.append(self.format(record))

    escaped: list = []
    handler = Escaped(logging.ERROR)
    logging.getLogger("llamaspec").addHandler(handler)
    n_par, draft, _ = KINDS[kind]
    eng = Engine(tiny_model("llama"), draft=tiny_model("llama-draft") if draft else None, spec=_spec(kind),
                 n_ctx=N_CTX, n_parallel=n_par, n_batch=N_BATCH, n_threads=1, **EXACT)
    try:
        if background:
            eng.start()
        outs: list = [[] for _ in work]
        stop, bad = threading.Event(), []
        threads = [threading.Thread(target=_worker, args=(eng, w, o), daemon=True) for w, o in zip(work, outs)]
        checker = threading.Thread(target=_check_memory, args=(eng, stop, bad), daemon=True)
        for t in [checker, *threads]:
            t.start()
        if close_after is not None:
            stop.wait(close_after)
            eng.close()
        for t in threads:
            t.join(JOIN_S)
            assert not t.is_alive(), f"a thread hangs ({kind}, background={background}, close after {close_after})"
        stop.set()
        checker.join(JOIN_S)
        assert not bad, f"seq_pos_max != n_past - 1 between steps: {bad}"
        for outcome, (prompt, n_predict, _), req in (x for o in outs for x in o):
            assert isinstance(outcome, str), f"{type(outcome).__name__}: {outcome} escaped ({prompt!r:.80})"
            if req is not None and close_after is not None:
                assert req.done, "close() left a request unfinished"
            if outcome == "done" and not eng.closed:
                assert req.finish_reason is FinishReason.LENGTH, (req.finish_reason, req.error)
                ref_tokens = alone(req.prompt_tokens, n_predict, req.options.sampling, [])[0]
                ok, why = (True, "") if req.tokens == ref_tokens else divergence_is_near_tie(
                    tiny_model("llama"), req.prompt_tokens, ref_tokens, req.tokens, sampling=req.options.sampling, **EXACT)
                assert ok, f"greedy output differs from the request alone: {why}"
        if not eng.closed:  # what the readers left (a cancel not yet applied) the next steps finish
            for _ in range(200):
                if not eng.scheduler.has_work():
                    break
                if background:
                    time.sleep(0.01)
                else:
                    eng.step()
            check_nothing_leaked(eng, kind, alone)
        assert not escaped, escaped[0]
    finally:
        logging.getLogger("llamaspec").removeHandler(handler)
        eng.close()


def test_close_waits_for_a_submit_under_way(tiny_model, monkeypatch):
    """A ``submit`` that passed the open check and is tokenising when ``close()`` starts: close waits for it
    (it must not free the model under the native call) and then aborts the request it queued (before, the
    request was queued after close finished the queue: never done, its reader got EngineClosedError)."""
    eng = Engine(tiny_model("llama"), n_ctx=N_CTX, n_threads=1)
    inside, go, out = threading.Event(), threading.Event(), []
    real = L.Vocab.tokenize

    def slow(self, *a, **kw):
        inside.set()
        go.wait(10)
        return real(self, *a, **kw)  # raised "model ... is closed" when close() did not wait

    monkeypatch.setattr(L.Vocab, "tokenize", slow)
    submitter = threading.Thread(target=lambda: out.append(eng.submit("ab12", RequestOptions(n_predict=4))))
    submitter.start()
    assert inside.wait(10)
    closer = threading.Thread(target=eng.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() did not wait for the submit under way"
    go.set()
    submitter.join(10)
    closer.join(10)
    assert not closer.is_alive() and eng.closed
    assert out and out[0].done and out[0].finish_reason is FinishReason.ABORT
    with pytest.raises(EngineClosedError):
        eng.submit("ab", RequestOptions(n_predict=1))
