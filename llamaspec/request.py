"""Requests: what :meth:`Engine.submit` returns. Each request owns its output (design.md 11).

A :class:`Request` has an id, a state, its own queue of :class:`~llamaspec.slot.Chunk` objects, and once it
is done a :class:`~llamaspec.slot.GenerationResult` (tokens, text, finish reason, statistics, and the error
message when it failed). :meth:`Engine.step` delivers every chunk to the request that produced it; a request
iterates over its own chunks only, so any number of requests can be consumed in any order, from any thread.

Thread model (design.md 12): native state is touched only inside :meth:`Engine.step`, which one thread at a
time runs (an engine lock). ``submit()`` and ``cancel()`` may be called from any thread: they only queue
work for the next step. A request iterated without an engine thread drives the engine itself (it runs
``step()`` whenever no other thread is stepping); with an engine thread (a server), it just waits.
"""
from __future__ import annotations

import enum
import threading
from collections import deque
from typing import TYPE_CHECKING, Iterator, Sequence

from .errors import LlamaSpecError, RequestError
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .engine import Engine
    from .sampler import TargetSampler
    from .slot import Slot

__all__ = ["Request", "RequestState"]


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for a free slot
    PROMPT = "prompt"  # its prompt is being decoded
    GENERATING = "generating"
    DONE = "done"  # finished: see finish_reason (stop, length, abort, error)


class Request:
    """One generation request (see the module docstring). Create it with :meth:`Engine.submit`."""

    def __init__(self, engine: "Engine", request_id: int, tokens: list[int], *, n_predict: int,
                 sampling: "llama.SamplingParams", sampler: "TargetSampler", stop: Sequence[str]):
        self.id = request_id
        self.prompt_tokens = tokens
        self.n_predict = n_predict
        self.sampling = sampling
        self.stop = tuple(stop)
        self.speculative = None  # RequestSpec | None: per-request speculative settings
        self.id_slot = -1
        self.cache_prompt = True
        self.state = RequestState.QUEUED
        self.finish_reason: FinishReason | None = None
        #: the error message when ``finish_reason`` is ``error``
        self.error: str | None = None
        self.slot: "Slot | None" = None
        #: why it stopped (llama-server's stop_type: "eos", "word", "limit"; None when aborted or failed),
        #: the stop string that matched, and whether a full context (not n_predict) ended it
        self.stop_type: str | None = None
        self.stopping_word = ""
        self.truncated = False
        self.tokens: list[int] = []
        self.drafted_mask: list[bool] = []
        self._text: list[str] = []
        self._stats = GenerationStats(n_prompt=len(tokens))
        self._engine = engine
        self._sampler: "TargetSampler | None" = sampler  # handed to the slot on admission
        self._chunks: deque[Chunk] = deque()
        self._cancel = False
        self._done = threading.Event()

    def __repr__(self) -> str:
        return f"Request(id={self.id}, state={self.state.value}, tokens={len(self.tokens)})"

    # -- state --------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state is RequestState.DONE

    @property
    def text(self) -> str:
        """The text emitted so far (final once the request is done)."""
        return "".join(self._text)

    @property
    def stats(self) -> GenerationStats:
        return self.slot.stats if self.slot is not None and not self.done else self._stats

    @property
    def seq_id(self) -> int | None:
        return self.slot.seq_id if self.slot is not None else None

    # -- control ------------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Abandon the request (any thread). It finishes with ``abort`` at the next step; its memory is
        freed and its slot becomes reusable. Chunks already delivered stay readable."""
        self._cancel = True
        self._engine._cancel_soon(self)

    # -- output -------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Chunk]:
        return self.chunks()

    def chunks(self, *, timeout: float | None = None) -> Iterator[Chunk]:
        """The request's chunks as they are produced, until it is done. Abandoning the iterator does not
        cancel the request (``Engine.stream`` does)."""
        while True:
            ch = self._next_chunk(timeout)
            if ch is None:
                return
            yield ch

    def result(self, *, timeout: float | None = None) -> GenerationResult:
        """Wait until the request is done and return everything it produced (undelivered chunks are
        consumed). A request that failed returns its result with ``finish_reason`` ``error`` and
        ``error`` set; :meth:`raise_for_error` turns that into an exception."""
        for _ in self.chunks(timeout=timeout):
            pass
        return self.to_result()

    def raise_for_error(self) -> None:
        if self.finish_reason is FinishReason.ERROR:
            raise RequestError(f"request {self.id} failed: {self.error}")

    def to_result(self) -> GenerationResult:
        return GenerationResult(list(self.tokens), self.text, self.finish_reason or FinishReason.ABORT, self.stats,
                                list(self.prompt_tokens), list(self.drafted_mask), self.error)

    # -- engine side ------------------------------------------------------------------------------
    def _next_chunk(self, timeout: float | None) -> Chunk | None:
        engine = self._engine
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._done.is_set():
                return self._chunks.popleft() if self._chunks else None
            if not engine._pump(self, timeout):
                raise LlamaSpecError(f"request {self.id}: no output within {timeout} s")

    def _deliver(self, ch: Chunk) -> None:
        """Called by the engine (inside step) with each chunk this request produced."""
        self.tokens.extend(ch.tokens)
        self.drafted_mask.extend(i < ch.n_from_draft for i in range(len(ch.tokens)))
        self._text.append(ch.text)
        self._chunks.append(ch)

    def _close_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def _finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.slot is not None:
            self._stats = self.slot.stats
            self.stop_type, self.stopping_word, self.truncated = (self.slot.stop_type, self.slot.stopping_word,
                                                                  self.slot.truncated)
        self.state = RequestState.DONE
        self.finish_reason = reason
        self.error = error
        self._done.set()
