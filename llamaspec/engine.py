"""The engine: one loop for 1..N slots (design.md, "one loop"), plain and speculative.

``submit()`` returns a :class:`~llamaspec.request.Request` that owns its output; each slot is one sequence
(``seq_id`` = slot id) of the target context and serves one request at a time. A slot goes through
``PROMPT`` (its prompt is decoded in chunks of ``n_batch``, each chunk followed by ``chain.process``; then
``chain.begin`` and the first token is sampled from the last row), ``GENERATING`` and ``DONE`` (its
sequence is removed from memory so the slot can be reused by the next queued request).

:meth:`Engine.step` runs one round (:mod:`llamaspec.round`, spec §7.2–§7.5): draft, checkpoint, one
batched decode, verify, roll back, emit. Who owns what: :mod:`llamaspec.memory` every memory operation,
:mod:`llamaspec.verify` the verification rules (one verifier per request), :mod:`llamaspec.sampler` the
target sampler (llama.cpp's ``common_sampler``), the chain the drafters. ``docs/architecture.md`` has the
whole picture.

Threads: one thread at a time runs ``step()`` (an engine lock); ``submit()`` and ``cancel()`` may be called
from any thread. Errors: a failure in one slot finishes that request with ``error``; the others go on.

Vocabulary follows llama.cpp: ``sampled`` is the last token sampled by the target and **not yet decoded**;
``n_past`` is the number of tokens in the target memory for the sequence, so after every round
``seq_pos_max(seq) == n_past - 1`` on the target and the draft context (restored on every exit path).
"""
from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import _llama as llama
from .chain import Chain
from .contexts import build_parts
from .drafters.base import Drafter
from .errors import ContextOverflowError, EngineClosedError, LlamaSpecError, UsageError
from .memory import DraftRollback, TargetRollback
from .params import SpecParams
from .request import Request, RequestState
from .round import SpeculativeRound
from .sampler import TargetSampler
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats, Slot, SlotState
from .text import TextStream
from .verify.verifiers import verifier_for

__all__ = ["Engine", "Chunk", "FinishReason", "GenerationResult", "GenerationStats", "Request", "RequestState", "Slot",
           "SlotState"]

log = logging.getLogger("llamaspec")

DEFAULT_N_CTX = 4096
VERIFY_MODES = ("match", "rejection")


class Engine(SpeculativeRound):
    """Owns the target (and optional draft) model and context, the chain, and N slots.

    >>> # doctest: +SKIP
    >>> with Engine("target.gguf", draft="draft.gguf") as eng:
    ...     print(eng.generate("def fibonacci(n):", n_predict=32).text)
    """

    def __init__(
        self,
        target: llama.Model | str | Path,
        *,
        draft: llama.Model | str | Path | None = None,
        spec: SpecParams | None = None,
        verify: str = "match",
        n_ctx: int = DEFAULT_N_CTX,
        n_parallel: int = 1,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        n_threads_draft: int | None = None,
        flash_attn: bool | None = None,
        kv_f32: bool = False,
        n_rs_seq: int | None = None,
        drafters: "Sequence[Drafter] | None" = None,
        n_threads_batch: int | None = None,
        n_gpu_layers: int | None = None,
        n_gpu_layers_draft: int | None = None,
        main_gpu: int | None = None,
        split_mode: str | None = None,
        tensor_split: "Sequence[float] | None" = None,
    ):
        """``drafters``: your own :class:`~llamaspec.drafters.base.Drafter` objects, in priority order, used
        instead of the chain that ``spec`` describes (their ``n_seq`` must equal ``n_parallel``).

        GPU offload and threads, with llama.cpp's meaning (None = llama.cpp's default; CLI flag in brackets):

        * ``n_gpu_layers`` (``-ngl``): target layers in VRAM; -1 (llama.cpp's default) = all, 0 = CPU only.
          A CPU-only build of llama.cpp ignores it. ``n_gpu_layers_draft`` (``-ngld``): the same for the draft.
        * ``split_mode`` (``-sm``): ``"none"``, ``"layer"`` (llama.cpp's default), ``"row"`` or ``"tensor"``;
          ``tensor_split`` (``-ts``): proportions per GPU, e.g. ``[3, 1]``; ``main_gpu`` (``-mg``): the GPU
          used with split mode none. The draft model uses the target's placement.
        * ``n_threads`` (``-t``, default: all available cores), ``n_threads_batch`` (``-tb``, default
          ``n_threads``); ``n_threads_draft`` (``-td``, default ``n_threads``) for the draft's generation, whose
          batch threads follow ``n_threads_batch`` (as llama.cpp's ``-tbd`` default).

        The offload settings apply to models this engine loads from a path: a ``target`` or ``draft`` passed
        as an already loaded :class:`~llamaspec._llama.Model` keeps its own placement (load it with
        ``Model(path, n_gpu_layers=...)``). Bad values raise :class:`UsageError` before anything is loaded.
        """
        if n_parallel < 1:
            raise UsageError(f"n_parallel must be >= 1, got {n_parallel}")
        if n_ctx < 8:
            raise UsageError(f"context size must be >= 8, got {n_ctx}")
        if n_batch < 1:
            raise UsageError(f"batch size must be >= 1, got {n_batch}")
        if verify not in VERIFY_MODES:
            raise UsageError(f"unknown verification mode {verify!r} (valid: {', '.join(VERIFY_MODES)})")
        spec = copy.deepcopy(spec) if spec is not None else SpecParams()
        if draft is not None and spec.types_are_default:
            spec.add_types("draft-simple")
        if spec.draft.n_max < 0:
            raise UsageError(f"--spec-draft-n-max must be >= 0, got {spec.draft.n_max}")
        self.spec = spec
        self.verify = verify
        self.n_parallel = n_parallel
        self._owned: list = []
        self._closed = False
        parts = build_parts(target, draft, spec, drafters, n_ctx=n_ctx, n_parallel=n_parallel, n_batch=n_batch,
                            n_ubatch=n_ubatch, n_threads=n_threads, n_threads_draft=n_threads_draft,
                            flash_attn=flash_attn, kv_f32=kv_f32, n_rs_seq=n_rs_seq,
                            n_threads_batch=n_threads_batch, n_gpu_layers=n_gpu_layers,
                            n_gpu_layers_draft=n_gpu_layers_draft, main_gpu=main_gpu, split_mode=split_mode,
                            tensor_split=tensor_split)
        self._owned = parts.owned
        self.model, self.ctx, self.tgt_level = parts.model, parts.ctx, parts.tgt_level
        self.model_dft, self.ctx_dft, self.dft_level = parts.model_dft, parts.ctx_dft, parts.dft_level
        self.chain: Chain | None = parts.chain
        self.synth_cond = parts.synth_cond
        self.rollback_tgt = TargetRollback(self.ctx, self.tgt_level)
        self.rollback_dft = DraftRollback(self.ctx_dft, self.dft_level, keep_drafted=parts.keep_drafted)
        self.vocab = self.model.vocab
        self.slots = [Slot(i) for i in range(n_parallel)]
        #: rows one slot may put in a decode: its [sampled] + draft must fit n_batch and its output rows
        self._n_rows_max_per_seq = min(self.ctx.n_batch, self.ctx.n_outputs_max_per_seq, self.ctx.n_outputs_max)
        # requests and threads (llamaspec.request): one thread at a time runs step(); submit/cancel queue work
        self._step_lock = threading.RLock()
        self._admin = threading.Lock()
        self._cv = threading.Condition()
        self._queued: deque[Request] = deque()
        self._cancels: list[Request] = []
        self._next_id = 0
        #: requests that had to wait for a free slot
        self.n_deferred = 0

    @property
    def _keep_draft_kv(self) -> bool:
        return self.rollback_dft.keep_drafted

    # ------------------------------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every native object. Requests still queued or running finish with ``abort``; any later call
        raises :class:`EngineClosedError`."""
        lock = getattr(self, "_step_lock", None)
        if lock is not None:
            lock.acquire()
        try:
            self._closed = True
            for s in getattr(self, "slots", []):
                if s.request is not None and not s.request.done:
                    s.request._finish(FinishReason.ABORT)
                s.spec_ckpt.drop_sampler()
                if s.sampler is not None:
                    s.sampler.close()
                    s.sampler = None
            for req in getattr(self, "_queued", ()):
                req._finish(FinishReason.ABORT)
                req._close_sampler()
            for obj in reversed(getattr(self, "_owned", [])):
                obj.close()
            self._owned = []
        finally:
            if lock is not None:
                lock.release()
                self._notify()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("this Engine is closed (close() or a with-block ended); create a new Engine")

    @property
    def speculative(self) -> bool:
        return self.chain is not None

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self._check_open()
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        n_predict: int = -1,
        sampling: llama.SamplingParams | None = None,
        stop: Sequence[str] = (),
        parse_special: bool = False,
    ) -> Request:
        """Queue a request (any thread); it takes the first free slot, at once when one is free and no
        other thread is stepping, else at the next :meth:`step`. ``n_predict=0`` decodes the prompt only."""
        self._check_open()
        tokens = self.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise UsageError("the prompt is empty (and the model adds no BOS token): give at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab.n_tokens]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab.n_tokens - 1})")
        if len(tokens) >= self.n_ctx_seq:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx_seq} per sequence; "
                f"shorten the prompt or raise --ctx-size (this model was trained for {self.model.n_ctx_train})"
            )
        if n_predict < -1:
            raise UsageError(f"n_predict must be >= -1 (-1 = until end of generation or context), got {n_predict}")
        sampling = sampling or llama.SamplingParams(temp=0.0)
        sampler = TargetSampler(self.vocab, sampling)
        with self._admin:
            self._next_id += 1
            req = Request(self, self._next_id, tokens, n_predict=n_predict, sampling=sampling, sampler=sampler,
                          stop=stop)
            self._queued.append(req)
            if len(self._queued) > sum(s.state in (SlotState.IDLE, SlotState.DONE) for s in self.slots):
                self.n_deferred += 1  # it waits for a slot
        if self._step_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._admit()
            finally:
                self._step_lock.release()
        return req

    def _admit(self) -> None:
        """Queued requests take free slots, in submission order (under the step lock)."""
        while True:
            slot = next((s for s in self.slots if s.state in (SlotState.IDLE, SlotState.DONE)), None)
            with self._admin:
                if slot is None or not self._queued:
                    return
                req = self._queued.popleft()
            if req._cancel:
                req._close_sampler()
                req._finish(FinishReason.ABORT)
                continue
            self._release(slot)
            slot.reset()
            slot.request, req.slot = req, slot
            slot.sampler, req._sampler = req._sampler, None
            slot.sampling = req.sampling
            slot.prompt = list(req.prompt_tokens)
            slot.n_prompt = len(slot.prompt)
            slot.n_predict = req.n_predict
            slot.stream = TextStream(req.stop)
            slot.state = SlotState.PROMPT
            slot.stats.n_prompt = slot.n_prompt
            slot.verifier = verifier_for(self.verify, slot, self.ctx, self.vocab.is_eog, self.synth_cond)
            if self.chain is not None:
                self.chain.configure_sampling(slot.seq_id, slot.verifier.draft_temp, slot.sampling.seed)
            req.state = RequestState.PROMPT

    def cancel(self, request: "Request | Slot") -> None:
        """Abandon a request (any thread): its memory is freed and its slot becomes reusable."""
        req = request.request if isinstance(request, Slot) else request
        if req is not None:
            req.cancel()

    def _cancel_soon(self, req: Request) -> None:
        with self._admin:
            self._cancels.append(req)
        if self._step_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._apply_cancels()
            finally:
                self._step_lock.release()
                self._notify()

    def _apply_cancels(self) -> None:
        with self._admin:
            cancels, self._cancels = self._cancels, []
            for req in cancels:
                if req in self._queued:
                    self._queued.remove(req)
                    req._close_sampler()
                    req._finish(FinishReason.ABORT)
        for req in cancels:
            slot = req.slot
            if req.done or slot is None or slot.request is not req:
                continue
            slot.finish_reason = FinishReason.ABORT
            slot.state = SlotState.DONE
            if self.chain is not None:
                self.chain.reset(slot.seq_id)
            self._release(slot)
            req._finish(FinishReason.ABORT)

    def _release(self, slot: Slot) -> None:
        self.rollback_tgt.release(slot.seq_id)
        self.rollback_dft.release(slot.seq_id)
        slot.prompt = []
        slot.spec_ckpt.drop_sampler()
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state in (SlotState.PROMPT, SlotState.GENERATING)]

    @property
    def n_queued(self) -> int:
        """Requests waiting for a free slot."""
        return len(self._queued)

    # ------------------------------------------------------------------------------------------
    # one round
    # ------------------------------------------------------------------------------------------
    def step(self) -> list[Chunk]:
        """Run one round for every active slot; every chunk goes to its request's queue and is returned.

        A failure in one slot (its drafter, decode or verification) finishes that request with ``error``;
        the others go on. Only an interrupt (``KeyboardInterrupt``) leaves ``step``; memory is consistent
        even then."""
        with self._step_lock:
            try:
                return self._step()
            finally:
                self._notify()

    def _step(self) -> list[Chunk]:
        self._check_open()
        self._apply_cancels()
        self._admit()
        out: list[Chunk] = []
        try:
            for slot in [s for s in self.slots if s.state is SlotState.PROMPT]:
                try:
                    out.append(self._process_prompt(slot))
                except Exception as e:  # noqa: BLE001 - confined to this slot
                    out.append(self._fail(slot, e))
            gen = [s for s in self.slots if s.state is SlotState.GENERATING and s.sampled is not None]
            if gen:
                self._round(gen, out)
        except BaseException:
            self._recover()
            self._deliver(out)
            raise
        self._deliver(out)
        return out

    def _deliver(self, out: list[Chunk]) -> None:
        for ch in out:
            req = ch.request
            if req is None:
                continue
            req._deliver(ch)
            if ch.finished:
                req._finish(ch.slot.finish_reason or FinishReason.STOP, ch.slot.error)

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _pump(self, req: Request, timeout: float | None) -> bool:
        """Make progress for ``req``: run a step when no other thread is, else wait for one. False when
        ``timeout`` passed without output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._step_lock.acquire(blocking=False):
                try:
                    if not req._chunks and not req.done:
                        self._step()
                finally:
                    self._step_lock.release()
                    self._notify()
                return True
            with self._cv:
                self._cv.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
            if req._chunks or req.done:
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _fail(self, slot: Slot, exc: BaseException) -> Chunk:
        """Finish one slot's request with ``error``: its memory is released, the other slots go on."""
        msg = str(exc) if isinstance(exc, LlamaSpecError) and str(exc) else f"{type(exc).__name__}: {exc}"
        log.error("slot %d: request failed: %s", slot.id, msg)
        if self.chain is not None:
            self.chain.reset(slot.seq_id)
        slot.spec_draft, slot.spec_probs, slot.spec_is_replay, slot.spec_i_batch = [], None, False, []
        slot.finish_reason, slot.error = FinishReason.ERROR, msg
        slot.state = SlotState.DONE
        slot.sampled = None
        slot.prompt_tokens = slot.prompt[: slot.n_prompt]
        text = slot.stream.flush() if slot.stream is not None else ""
        self._release(slot)
        return Chunk(slot, [], text, True, 0, slot.request)

    def _recover(self) -> None:
        """After an interrupt mid-round: every live slot's memory must hold exactly its committed tokens
        (the rollback objects put it back), or the slot is aborted; drafters forget the round."""
        for s in self.slots:
            if s.state not in (SlotState.PROMPT, SlotState.GENERATING):
                continue
            if self.chain is not None:
                self.chain.reset(s.seq_id)
            s.spec_draft, s.spec_probs, s.spec_is_replay, s.spec_i_batch = [], None, False, []
            if s.state is SlotState.PROMPT or not (self.rollback_tgt.recover(s) and self.rollback_dft.recover(s)):
                if s.state is SlotState.GENERATING:
                    log.error("could not restore memory of slot %d after an error; the slot is closed", s.id)
                self._release(s)
                s.state = SlotState.DONE
                s.finish_reason = FinishReason.ABORT
                if s.request is not None:
                    s.request._finish(FinishReason.ABORT)
            s.spec_ckpt.drop_sampler()

    # ------------------------------------------------------------------------------------------
    # convenience
    # ------------------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], **kw) -> Iterator[Chunk]:
        """Generate for one prompt, yielding a :class:`Chunk` per round (``submit``'s keywords).
        Abandoning the iterator cancels the request, which frees its slot and memory."""
        req = self.submit(prompt, **kw)
        try:
            yield from req.chunks()
        finally:
            if not req.done:
                req.cancel()

    def generate(self, prompt: str | Sequence[int], *, on_chunk: Callable[[Chunk], None] | None = None,
                 **kw) -> GenerationResult:
        """Generate for one prompt and return the whole result (``submit``'s keywords). Raises
        :class:`~llamaspec.errors.RequestError` when the request failed."""
        req = self.submit(prompt, **kw)
        try:
            for ch in req.chunks():
                if on_chunk is not None:
                    on_chunk(ch)
        finally:
            if not req.done:
                req.cancel()
        req.raise_for_error()
        return req.to_result()

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        n_predict: int = -1,
        sampling: llama.SamplingParams | Sequence[llama.SamplingParams] | None = None,
        stop: Sequence[str] = (),
        on_chunk: Callable[[int, Chunk], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts, ``n_parallel`` at a time, in one batched loop. A request that
        fails has ``finish_reason`` ``error`` and its message in ``error``; the others are unaffected."""
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise UsageError("give one sampling setting, or one per prompt")
        reqs: list[Request] = []
        try:
            for p, sp in zip(prompts, samplings):
                reqs.append(self.submit(p, n_predict=n_predict, sampling=sp, stop=stop))
            index = {r.id: i for i, r in enumerate(reqs)}
            while not all(r.done for r in reqs):
                for ch in self.step():
                    if on_chunk is not None and ch.request is not None and ch.request.id in index:
                        on_chunk(index[ch.request.id], ch)
        finally:
            for r in reqs:
                if not r.done:
                    r.cancel()
        return [r.result() for r in reqs]

    # ------------------------------------------------------------------------------------------
    # statistics
    # ------------------------------------------------------------------------------------------
    def drafter_stats(self) -> list[dict]:
        return self.chain.stats_dicts() if self.chain else []

    def stats_lines(self) -> list[str]:
        return self.chain.stats_lines() if self.chain else []
