"""The engine: one loop for 1..N slots, plain and speculative.

``submit()`` returns a :class:`~llamaspec.request.Request` that owns its output; each slot is one sequence
(``seq_id`` = slot id) of the target context and serves one request at a time. A slot goes through
``PROMPT`` (decoded in chunks of ``n_batch``, each followed by ``chain.process``; then ``chain.begin`` and the
first token is sampled), ``GENERATING`` and ``DONE`` (the slot can serve the next queued request).

:meth:`Engine.step` cancels and admits (:class:`~llamaspec.scheduler.Scheduler`), runs one round
(:class:`~llamaspec.round.Round`, §7.2–§7.5: draft, checkpoint, one batched decode, verify, roll back, emit) and
acts on its :class:`~llamaspec.round.RoundOutcome`: failed slots are released, finished ones retired, chunks delivered
to their requests. Who owns what: :mod:`llamaspec.referee` whether speculating pays now, :mod:`llamaspec.policy` how
far each slot drafts, :mod:`llamaspec.memory` every memory operation, :mod:`llamaspec.verify` the verification rules
(one verifier per request), :mod:`llamaspec.sampler` the target sampler (llama.cpp's ``common_sampler``), the chain
the drafters. ``docs/architecture.md`` has the whole picture. Threads: one thread at a time runs ``step()``
(:mod:`llamaspec.stepper`); ``submit()`` and ``cancel()`` may be called from any thread. A failure in one slot
finishes that request with ``error``; the others go on.

Vocabulary follows llama.cpp: ``sampled`` is the last token sampled by the target, **not yet decoded**; ``n_past``
the tokens in the sequence's memory: after every round ``seq_pos_max(seq) == n_past - 1`` in both contexts.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import threading
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import _llama as llama
from .adaptive import CostModel
from .auto import AutoChain
from .chain import Chain
from .contexts import build_parts
from .drafters.base import Drafter
from .errors import EngineClosedError, UsageError
from .memory import DraftRollback, TargetRollback
from .params import ADAPTIVE_DRAFT_N_MAX, ADAPTIVE_TYPES, VERIFY_MODES, SpecParams
from .policy import DraftBudget
from .referee import Referee
from .options import Caps, RequestOptions
from .request import Request, RequestState, check_prompt
from .round import Round, RoundOutcome
from .sampler import TargetSampler
from .scheduler import Scheduler
from .slot_state import SlotStore
from .stepper import Stepper, native_use
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats, Slot, SlotState

__all__ = ["Engine", "Chunk", "FinishReason", "GenerationResult", "GenerationStats", "Request", "RequestState", "Slot", "SlotState"]

log = logging.getLogger("llamaspec")

DEFAULT_N_CTX = 4096
_GENERATING, _PROMPT = SlotState.GENERATING, SlotState.PROMPT  # read per slot per step: a global is cheaper


def _cancel_on_exit(req: Request) -> Iterator[Chunk]:
    """``req``'s chunks; leaving early (an exception, an abandoned iterator) cancels the request."""
    try:
        yield from req.chunks()
    finally:
        if not req.done:
            req.cancel()


class Engine:
    """Owns the target (and optional draft) model and context, the chain, and N slots; composes the
    :class:`~llamaspec.scheduler.Scheduler` (which request runs where) and the :class:`~llamaspec.round.Round`
    (one speculative round), and drives them: it is the :class:`~llamaspec.request.Driver` of its requests.

    >>> with Engine("target.gguf", draft="draft.gguf") as eng:  # doctest: +SKIP
    ...     print(eng.generate("def fibonacci(n):", n_predict=32).text)
    """

    def __init__(
        self,
        target: llama.Model | str | Path,
        *,
        draft: llama.Model | str | Path | None = None,
        spec: SpecParams | None = None,
        verify: str = "match",
        n_ctx: int = DEFAULT_N_CTX, n_parallel: int = 1, n_batch: int = 512, n_ubatch: int | None = None,
        n_threads: int | None = None, n_threads_draft: int | None = None,
        flash_attn: bool | None = None, kv_f32: bool = False, n_rs_seq: int | None = None,
        drafters: "Sequence[Drafter] | None" = None, n_threads_batch: int | None = None,
        n_gpu_layers: int | None = None, n_gpu_layers_draft: int | None = None, main_gpu: int | None = None,
        split_mode: str | None = None, tensor_split: "Sequence[float] | None" = None, cache_prompt: bool = False,
        rpc_servers: "Sequence[str] | str | None" = None, rpc_servers_draft: "Sequence[str] | str | None" = None,
        context_shift: bool = False, slot_prompt_similarity: float = 0.1,
    ):
        """``drafters``: your own :class:`~llamaspec.drafters.base.Drafter` objects, in priority order, used
        instead of the chain that ``spec`` describes (their ``n_seq`` must equal ``n_parallel``).

        GPU offload, threads and RPC servers (``n_gpu_layers``, ``n_gpu_layers_draft``, ``split_mode``,
        ``tensor_split``, ``main_gpu``, ``n_threads``, ``n_threads_batch``, ``n_threads_draft``, ``rpc_servers``,
        ``rpc_servers_draft``) have llama.cpp's meaning: :func:`llamaspec.contexts.build_parts` says each.

        ``cache_prompt``: a finished request's tokens stay in its slot's memory, and the next request with
        a common prefix decodes only the rest (llama-server's prompt cache; see :mod:`llamaspec.scheduler`).
        ``slot_prompt_similarity``: with it, a request takes the free slot whose cache covers more than this share
        of its prompt, else the least recently used one (llama-server's ``-sps``; 0: least recently used only).
        ``context_shift``: a full context drops old tokens instead of ending the request (:mod:`llamaspec.ctx_shift`).
        """
        for name, v, lo in (("n_parallel", n_parallel, 1), ("context size", n_ctx, 8), ("batch size", n_batch, 1)):
            if v < lo:
                raise UsageError(f"{name} must be >= {lo}, got {v}")
        if not 0.0 <= slot_prompt_similarity <= 1.0:
            raise UsageError(f"slot prompt similarity must be in [0, 1], got {slot_prompt_similarity}")
        if verify not in VERIFY_MODES:
            raise UsageError(f"unknown verification mode {verify!r} (valid: {', '.join(VERIFY_MODES)})")
        if spec is None:  # llamaspec's defaults: the draft model's length is adaptive up to a larger ceiling
            spec = SpecParams()
            spec.draft.n_max = ADAPTIVE_DRAFT_N_MAX
        else:
            spec = copy.deepcopy(spec)
        if draft is not None and spec.types_are_default:
            from .drafters.heads import infer_draft_type  # a head / MTP GGUF selects its drafter (§1.1)

            spec.add_types(infer_draft_type(draft))
        if spec.draft.n_max < 0:
            raise UsageError(f"--spec-draft-n-max must be >= 0, got {spec.draft.n_max}")
        self.spec = spec
        self.verify = verify
        self.n_parallel = n_parallel
        self._owned: list = []
        self._closed = False
        #: the one cost model (llamaspec.adaptive): the round measures into it, the adaptive length and auto use it
        self.cost_model = CostModel()
        parts = build_parts(target, draft, spec, drafters, cost_model=self.cost_model, n_ctx=n_ctx,
                            n_parallel=n_parallel, n_batch=n_batch,
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
        self.rollback_dft = DraftRollback(self.ctx_dft, self.dft_level, reuse_kv=parts.reuse_kv)
        self.vocab = self.model.vocab
        self.slots = [Slot(i) for i in range(n_parallel)]
        adaptive = (self.chain is not None and spec.draft_adaptive_on()
                    and all(t in ADAPTIVE_TYPES for t in self.chain.types))
        #: rows one slot may put in a decode: its [sampled] + draft must fit n_batch and its output rows
        n_rows_max_per_seq = min(self.ctx.n_batch, self.ctx.n_outputs_max_per_seq, self.ctx.n_outputs_max)
        self.budget = DraftBudget(self.ctx.n_ctx_seq, n_rows_max_per_seq, self.chain.n_max if self.chain else 0,
                                  self.cost_model if adaptive else None, self.rollback_tgt.needs_checkpoint)
        self.scheduler = Scheduler(self.slots, self.rollback_tgt, self.rollback_dft, self.chain, self.budget,
                                   verify=verify, ctx=self.ctx, is_eog=self.vocab.is_eog,
                                   synth_cond=self.synth_cond, cache_prompt=cache_prompt,
                                   slot_prompt_similarity=slot_prompt_similarity)
        #: speculate or not from delivered throughput (llamaspec.referee), with the adaptive policies
        judged = self.chain is not None and spec.referee_on() and (adaptive or isinstance(self.chain, AutoChain))
        self.referee = Referee(arms=self.chain.arms) if judged else None
        self.round = Round(self.ctx, self.chain, self.vocab, self.rollback_tgt, self.rollback_dft, self.budget,
                           self.cost_model if self.chain is not None else None,  # plain decoding: nothing to price
                           spec.replay_accept_corrected, self.referee)
        self.round.shift.enable(context_shift)
        self._stepper = Stepper(self._step, self.scheduler.has_work, lambda: self._closed)
        #: save / restore / erase a slot's prompt cache between two steps (llamaspec.slot_state)
        self.slot_store = SlotStore(self.scheduler, self.rollback_tgt, self._stepper, n_vocab=self.vocab.n_tokens,
                                    n_ctx_seq=self.n_ctx_seq, has_draft=self.ctx_dft is not None,
                                    closed=lambda: self._closed)
        self._id_lock, self._next_id = threading.Lock(), 0

    # ------------------------------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Free every native object. Requests still queued or running finish with ``abort``; any later call
        raises :class:`EngineClosedError`."""
        stepper = getattr(self, "_stepper", None)
        if stepper is not None:  # no new submit; those under way end (and queue) first; the thread stops
            stepper.close(lambda: setattr(self, "_closed", True))
        lock = stepper.lock if stepper is not None else None
        if lock is not None:
            lock.acquire()
        try:
            self._closed = True
            if getattr(self, "scheduler", None) is not None:
                self.scheduler.abort_all()
            for obj in reversed(getattr(self, "_owned", [])):
                obj.close()
            self._owned = []
        finally:
            if lock is not None:
                lock.release()
                stepper.notify()

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

    @property
    def cache_prompt(self) -> bool:
        """A finished request's tokens stay in its slot for the next request's common prefix."""
        return self.scheduler.cache_prompt

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    @native_use
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    @native_use
    def submit(self, prompt: str | Sequence[int], options: RequestOptions | None = None, *,
               on_done: "Callable[[Request], None] | None" = None) -> Request:
        """Queue a request (any thread) and return its :class:`~llamaspec.request.Request`.

        ``options`` (:class:`~llamaspec.options.RequestOptions`; None: greedy, until end of generation) is
        validated once against this engine's :attr:`caps` (a :class:`UsageError` names the field) and held by the
        request. ``on_done(request)`` runs once it is done (``Request.add_done_callback``). When no step runs,
        the request is admitted at once (native work: its prompt may start decoding), else at the next step."""
        opts = (options if options is not None else RequestOptions()).validate(self.caps)
        tokens = (self.tokenize(prompt, parse_special=opts.parse_special) if isinstance(prompt, str)
                  else list(prompt))
        check_prompt(tokens, n_vocab=self.vocab.n_tokens, n_ctx_seq=self.n_ctx_seq,
                     n_ctx_train=self.model.n_ctx_train)
        sampler = TargetSampler(self.vocab, opts.sampling, logits_processor=opts.hooks.logits_processor,
                                penalize_prompt=opts.hooks.penalize_prompt)
        with self._id_lock:
            self._next_id += 1
            req = Request(self, self._next_id, tokens, opts, sampler)
        if on_done is not None:
            req.add_done_callback(on_done)
        self.scheduler.enqueue(req)
        self._stepper.run_now(self.scheduler.admit)
        return req

    @property
    def caps(self) -> Caps:
        """What a request's options are checked against (:meth:`RequestOptions.validate`)."""
        return Caps(n_vocab=self.vocab.n_tokens, n_ctx_seq=self.n_ctx_seq, n_parallel=self.n_parallel,
                    n_max=self.chain.n_max if self.chain is not None else 0)

    def cancel(self, request: "Request | Slot") -> None:
        """Abandon a request (any thread): its memory is freed and its slot becomes reusable (also the
        :class:`~llamaspec.request.Driver` side of ``Request.cancel``)."""
        if isinstance(request, Slot):
            request = self.scheduler.serving.get(request.id)
            return request.cancel() if request is not None else None
        self.scheduler.request_cancel(request)
        self._stepper.run_now(self.scheduler.apply_cancels)

    @property
    def active(self) -> list[Slot]:
        return self.scheduler.active

    def request_in_slot(self, slot_id: int) -> Request | None:
        """The request slot ``slot_id`` serves now (None: idle)."""
        return self.scheduler.request_in(self.slots[slot_id])

    @property
    def n_deferred(self) -> int:
        """Requests that had to wait for a free slot."""
        return self.scheduler.n_deferred

    @property
    def totals(self) -> GenerationStats:
        """Statistics summed over finished requests."""
        return self.scheduler.totals

    @property
    def n_requests_done(self) -> int:
        return self.scheduler.n_requests_done

    # ------------------------------------------------------------------------------------------
    # one step
    # ------------------------------------------------------------------------------------------
    def step(self) -> list[Chunk]:
        """Run one round for every active slot; every chunk goes to its request's queue and is returned.

        A failure in one slot (its drafter, decode or verification) finishes that request with ``error``;
        the others go on. Only an interrupt (``KeyboardInterrupt``) leaves ``step``; memory is consistent
        even then."""
        return self._stepper.step()

    def _step(self) -> list[Chunk]:
        self._check_open()
        sched = self.scheduler
        sched.apply_cancels()
        sched.admit()
        out = RoundOutcome()
        try:
            gen = [s for s in self.slots if s.state is _GENERATING and s.sampled is not None]
            prompts = [s for s in self.slots if s.state is _PROMPT]
            if gen or prompts:
                self.round.run(gen, prompts, out)
        except BaseException:
            self._settle(out)
            self._recover()
            raise
        self._settle(out)
        for s in out.prompt_checkpoints:
            if s.state is SlotState.PROMPT:
                sched.save_prompt_checkpoint(s)
        return out.chunks

    def _settle(self, out: RoundOutcome) -> None:
        """Act on what the round did: free failed slots, retire finished ones, deliver every chunk."""
        sched = self.scheduler
        for s in out.failed:
            self._confined(s, sched.release, s)
        for s in out.finished:
            self._confined(s, sched.retire, s)
        for ch in out.chunks:  # one by one: a request whose delivery fails ends, the others get theirs
            slot = self.slots[ch.slot_id]
            req = sched.serving.get(ch.slot_id)
            if req is None:
                continue
            try:
                ch.request_id = req.id
                if req.state is RequestState.PROMPT and slot.state is not SlotState.PROMPT:
                    req.state = RequestState.GENERATING
                req.deliver(ch)
                if ch.finished:
                    sched.finish(req, slot.finish_reason or FinishReason.STOP, slot.error, stats=slot.stats)
            except Exception as e:  # noqa: BLE001 - this request ends with the error; the engine goes on
                log.error("slot %d: delivering to request %d failed: %s", slot.id, req.id, e)
                sched.finish(req, FinishReason.ERROR, str(e) or type(e).__name__)

    def _confined(self, slot: Slot, fn, *args) -> None:
        """``fn(*args)`` for one slot; if it raises (an RPC server gone), the slot keeps no half-freed cache."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001
            log.error("slot %d: settling it failed: %s", slot.id, str(e) or type(e).__name__)
            slot.tokens, slot.cached, slot.prompt_ckpt = [], [], None

    def _recover(self) -> None:
        """After an interrupt mid-round: a live slot whose memory cannot be put back is aborted."""
        for s in self.round.recover(self.slots):
            self.scheduler.release(s)
            req = self.scheduler.serving.get(s.id)
            if req is not None:
                self.scheduler.finish(req, FinishReason.ABORT)

    # ------------------------------------------------------------------------------------------
    # driving (llamaspec.stepper): the Driver of every request, and the engine thread
    # ------------------------------------------------------------------------------------------
    def wait(self, req: Request, timeout: float | None) -> bool:
        """Make progress for ``req`` (the :class:`~llamaspec.request.Driver` side of reading a request)."""
        return self._stepper.wait(lambda: req.has_output, timeout)

    def wait_until(self, ready: Callable[[], bool], timeout: float | None) -> bool:
        """Make progress (or wait for the engine thread's) until ``ready()``; False when ``timeout`` passed."""
        return self._stepper.wait(ready, timeout)

    def start(self) -> None:
        """Run steps in a background thread while there is work (idempotent). Requests then only wait."""
        self._check_open()
        self._stepper.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the background thread (the current step finishes first)."""
        self._stepper.stop(timeout)

    # ------------------------------------------------------------------------------------------
    # convenience
    # ------------------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], options: RequestOptions | None = None, **fields) -> Iterator[Chunk]:
        """Generate for one prompt, yielding a :class:`Chunk` per round. ``fields``: :class:`RequestOptions`
        fields, over ``options`` (``stream(p, n_predict=8)``). Abandoning the iterator cancels the request,
        which frees its slot and memory."""
        yield from _cancel_on_exit(self.submit(prompt, RequestOptions.of(options, **fields)))

    def generate(self, prompt: str | Sequence[int], options: RequestOptions | None = None, *,
                 on_chunk: Callable[[Chunk], None] | None = None, **fields) -> GenerationResult:
        """Generate for one prompt and return the whole result (``fields`` as for :meth:`stream`). Raises
        :class:`~llamaspec.errors.RequestError` when the request failed."""
        req = self.submit(prompt, RequestOptions.of(options, **fields))
        with contextlib.closing(_cancel_on_exit(req)) as chunks:
            for ch in chunks:
                if on_chunk is not None:
                    on_chunk(ch)
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
                reqs.append(self.submit(p, RequestOptions(n_predict=n_predict, sampling=sp, stop=tuple(stop))))
            index = {r.id: i for i, r in enumerate(reqs)}
            while not all(r.done for r in reqs):
                for ch in self.step():
                    if on_chunk is not None and ch.request_id in index:
                        on_chunk(index[ch.request_id], ch)
        finally:
            for r in reqs:
                if not r.done:
                    r.cancel()
        return [r.result() for r in reqs]

    # ------------------------------------------------------------------------------------------
    # statistics
    # ------------------------------------------------------------------------------------------
    def slots_info(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots``, in short)."""
        return self.scheduler.slots_info()

    def metrics(self) -> dict:
        """Totals over finished requests plus what is running now (llama-server's ``/metrics`` names)."""
        m = self.scheduler.request_metrics()
        c = self.round.counters
        m["n_decode_total"] = c.n_decode
        m["n_busy_slots_per_decode"] = c.n_busy_slots / c.n_decode if c.n_decode else 0.0
        return m

    def drafter_stats(self) -> list[dict]:
        return self.chain.stats_dicts() if self.chain else []

    def stats_lines(self) -> list[str]:
        return self.chain.stats_lines() if self.chain else []
