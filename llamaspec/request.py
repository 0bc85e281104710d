"""Requests: what :meth:`Engine.submit` returns. Each request owns its output.

A :class:`Request` has an id, a state, its own queue of :class:`~llamaspec.slot.Chunk` objects, and once it
is done a :class:`~llamaspec.slot.GenerationResult` (tokens, text, finish reason, statistics, and the error
message when it failed). :meth:`Engine.step` delivers every chunk to the request that produced it; a request
iterates over its own chunks only, so any number of requests can be consumed in any order, from any thread.

Thread model: native state is touched by one thread at a time (an engine lock): inside
:meth:`Engine.step`, and in ``submit()`` / ``cancel()``, which may be called from any thread: ``submit()``
tokenises and builds the request's samplers itself, and both act at once when no step runs (admitting,
freeing), else the next step does (llamaspec.stepper). A request reaches its engine only through the two methods of :class:`Driver`:
``wait`` (make progress or wait for it: without an engine thread the Engine runs ``step()`` whenever no other
thread is stepping; with one, a server's, it just waits) and ``cancel``.
"""
from __future__ import annotations

import enum
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

from .errors import ContextOverflowError, LlamaSpecError, RequestError, UsageError
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats

if TYPE_CHECKING:  # pragma: no cover
    from .logprobs import TokenProb
    from .options import RequestOptions
    from .sampler import TargetSampler
    from .slot import Slot

__all__ = ["Driver", "Request", "RequestState"]

log = logging.getLogger("llamaspec")


class Driver(Protocol):
    """What a request needs of its engine (the Engine implements it)."""

    def wait(self, request: "Request", timeout: float | None) -> bool:
        """Make progress for ``request`` (run a step, or wait for the thread that does) until it has output
        or is done; False when ``timeout`` passed first."""

    def cancel(self, request: "Request") -> None:
        """Abandon ``request`` at the next step (any thread)."""


def check_prompt(tokens: Sequence[int], *, n_vocab: int, n_ctx_seq: int, n_ctx_train: int) -> None:
    """Raise :class:`UsageError` (or :class:`ContextOverflowError`) naming what is wrong with a prompt's tokens
    (the options are checked by :meth:`RequestOptions.validate <llamaspec.options.RequestOptions.validate>`)."""
    if not tokens:
        raise UsageError("the prompt is empty (and the model adds no BOS token): give at least one token")
    bad = [t for t in tokens if not 0 <= t < n_vocab]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
    if len(tokens) >= n_ctx_seq:
        raise ContextOverflowError(
            f"the prompt has {len(tokens)} tokens but the context holds {n_ctx_seq} per sequence; "
            f"shorten the prompt or raise --ctx-size (this model was trained for {n_ctx_train})"
        )


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for a free slot
    PROMPT = "prompt"  # its prompt is being decoded
    GENERATING = "generating"
    DONE = "done"  # finished: see finish_reason (stop, length, abort, error)


_DONE = RequestState.DONE  # ``done`` is read often (every step, by every waiter): a global is cheaper
#: guards every request's done callbacks (held for a list swap or an append: one lock for all is enough)
_CALLBACKS_LOCK = threading.Lock()


class Request:
    """One generation request (see the module docstring). Create it with :meth:`Engine.submit`."""

    def __init__(self, driver: Driver, request_id: int, tokens: list[int], options: "RequestOptions",
                 sampler: "TargetSampler"):
        self.id = request_id
        self.prompt_tokens = tokens
        #: what the request asks for (validated, frozen: llamaspec.options); its slot references it
        self.options = options
        #: one entry per emitted token when ``options.probs`` asked for them (and the end-of-generation token's)
        self.token_probs: "list[TokenProb]" = []
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
        self._driver = driver
        self._sampler: "TargetSampler | None" = sampler  # handed to the slot on admission
        #: the same sampler, still readable once the slot has it (``last_token``: the token that ended the request)
        self.target_sampler = sampler
        self._chunks: deque[Chunk] = deque()
        self._cancel = False
        self._done = threading.Event()
        #: what add_done_callback registered (None once the request is done and they ran)
        self._callbacks: "list[Callable[[Request], None]] | None" = []

    def __repr__(self) -> str:
        return f"Request(id={self.id}, state={self.state.value}, tokens={len(self.tokens)})"

    # -- state --------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.state is _DONE

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
        self._driver.cancel(self)

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
                                list(self.prompt_tokens), list(self.drafted_mask), self.error,
                                list(self.token_probs) if self.options.probs is not None else None)

    def _next_chunk(self, timeout: float | None) -> Chunk | None:
        while True:
            if self._chunks:
                return self._chunks.popleft()
            if self._done.is_set():
                return self._chunks.popleft() if self._chunks else None
            if not self._driver.wait(self, timeout):
                raise LlamaSpecError(f"request {self.id}: no output within {timeout} s")

    # -- engine side (the Engine and its Scheduler call these) -------------------------------------
    @property
    def cancelled(self) -> bool:
        """``cancel()`` was called."""
        return self._cancel

    @property
    def has_output(self) -> bool:
        """Chunks are waiting to be read, or the request is done."""
        return bool(self._chunks) or self.done

    def take_sampler(self) -> "TargetSampler | None":
        """The target sampler built at submit, handed to the slot that serves the request."""
        sampler, self._sampler = self._sampler, None
        return sampler

    def deliver(self, ch: Chunk) -> None:
        """One chunk this request produced (inside a step)."""
        self.tokens.extend(ch.tokens)
        if ch.probs:
            self.token_probs.extend(ch.probs)
        n = len(ch.tokens)
        k = min(ch.n_from_draft, n)  # the leading k tokens were drafted
        self.drafted_mask += [True] * k + [False] * (n - k) if k else [False] * n
        self._text.append(ch.text)
        self._chunks.append(ch)

    def close_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.slot is not None:
            self._stats = self.slot.stats
            self.stop_type, self.stopping_word, self.truncated = (self.slot.stop_type, self.slot.stopping_word,
                                                                  self.slot.truncated)
        self.state = RequestState.DONE
        self.finish_reason = reason
        self.error = error
        self._done.set()
        with _CALLBACKS_LOCK:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a callback never stops the step that finished the request
                log.exception("request %s: a done callback failed", self.id)

    def add_done_callback(self, fn: "Callable[[Request], None]") -> None:
        """Call ``fn(request)`` once the request is done: at once when it is, else from the thread that finishes
        it (the engine's, inside a step: ``fn`` must be quick and must not wait on the engine)."""
        with _CALLBACKS_LOCK:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)
