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
from .adaptive import CostModel
from .chain import Chain
from .contexts import build_parts
from .drafters.base import Drafter
from .errors import EngineClosedError, LlamaSpecError, UsageError
from .memory import DraftRollback, TargetRollback
from .params import ADAPTIVE_DRAFT_N_MAX, ADAPTIVE_TYPES, SpecParams
from .request import Request, RequestState
from .round import SpeculativeRound
from .scheduler import Scheduler
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats, Slot, SlotState

__all__ = ["Engine", "Chunk", "FinishReason", "GenerationResult", "GenerationStats", "Request", "RequestState", "Slot",
           "SlotState"]

log = logging.getLogger("llamaspec")

DEFAULT_N_CTX = 4096
VERIFY_MODES = ("match", "rejection")


class Engine(Scheduler, SpeculativeRound):
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
        cache_prompt: bool = False,
        rpc_servers: "Sequence[str] | str | None" = None,
        rpc_servers_draft: "Sequence[str] | str | None" = None,
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

        * ``rpc_servers`` (``--rpc``): ``"host:port"`` list (or one comma-separated string) of llama.cpp RPC
          servers (``ggml-rpc-server``) that hold the target's offloaded layers, split by ``tensor_split`` in
          the order given; ``rpc_servers_draft`` (``--rpc-draft``) the same for the draft, which stays local
          by default. Needs a llama.cpp built with RPC (:mod:`llamaspec._llama.rpc`). A server that fails
          mid-generation fails the requests with one :class:`~llamaspec.errors.RpcError` line; the engine
          then refuses new work and the process needs a restart to use RPC again.

        The offload settings apply to models this engine loads from a path: a ``target`` or ``draft`` passed
        as an already loaded :class:`~llamaspec._llama.Model` keeps its own placement (load it with
        ``Model(path, n_gpu_layers=...)``). Bad values raise :class:`UsageError` before anything is loaded.

        ``cache_prompt``: a finished request's tokens stay in its slot's memory, and the next request with
        a common prefix decodes only the rest (llama-server's prompt cache; see :mod:`llamaspec.scheduler`).
        """
        if n_parallel < 1:
            raise UsageError(f"n_parallel must be >= 1, got {n_parallel}")
        if n_ctx < 8:
            raise UsageError(f"context size must be >= 8, got {n_ctx}")
        if n_batch < 1:
            raise UsageError(f"batch size must be >= 1, got {n_batch}")
        if verify not in VERIFY_MODES:
            raise UsageError(f"unknown verification mode {verify!r} (valid: {', '.join(VERIFY_MODES)})")
        if spec is None:  # llamaspec's defaults: the draft model's length is adaptive up to a larger ceiling
            spec = SpecParams()
            spec.draft.n_max = ADAPTIVE_DRAFT_N_MAX
        else:
            spec = copy.deepcopy(spec)
        if draft is not None and spec.types_are_default:
            from .drafters.heads import infer_draft_type  # a head / MTP GGUF selects its drafter (spec §1.1)

            spec.add_types(infer_draft_type(draft))
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
                            tensor_split=tensor_split, rpc_servers=rpc_servers, rpc_servers_draft=rpc_servers_draft)
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
        #: keep a finished request's tokens in its slot for the next request's common prefix
        self.cache_prompt = cache_prompt
        self.totals = GenerationStats()
        self.n_requests_done = 0
        #: adaptive draft length (SpecParams.draft_adaptive, on by default): online costs in units of one target
        #: decode; for chains of draft-model drafters only (n-gram drafters and auto choose their own lengths)
        self.cost_model = CostModel() if (self.chain is not None and spec.draft_adaptive_on()
                                          and all(t in ADAPTIVE_TYPES for t in self.chain.types)) else None
        self.n_decode_total = 0  # target decode calls
        self.n_busy_slots_total = 0  # slots in them, summed (/ n_decode_total = busy slots per decode)
        self._thread: threading.Thread | None = None
        self._stop_thread = False

    @property
    def _keep_draft_kv(self) -> bool:
        return self.rollback_dft.keep_drafted

    # ------------------------------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every native object. Requests still queued or running finish with ``abort``; any later call
        raises :class:`EngineClosedError`."""
        if getattr(self, "_thread", None) is not None:
            self.stop()
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
            gen = [s for s in self.slots if s.state is SlotState.GENERATING and s.sampled is not None]
            prompts = [s for s in self.slots if s.state is SlotState.PROMPT]
            if gen or prompts:
                self._round(gen, prompts, out)
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
                self._record(req, ch.slot.stats)
                req._finish(ch.slot.finish_reason or FinishReason.STOP, ch.slot.error)

    def _notify(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _pump(self, req: Request, timeout: float | None) -> bool:
        """Make progress for ``req``: run a step when no other thread is, else wait for one. False when
        ``timeout`` passed without output."""
        deadline = None if timeout is None else time.monotonic() + timeout
        threaded = self._thread is not None and self._thread.is_alive()
        while True:
            if not threaded and self._step_lock.acquire(blocking=False):
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
