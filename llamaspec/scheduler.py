"""Requests in, slots out: the queue, admission, slot choice, the prompt cache and cancels.

:class:`Scheduler` decides which request runs where (llama-server's task queue and slot selection). The Engine
composes it and calls it at fixed points of a step, under the engine lock:

- ``enqueue()`` (any thread) queues a validated request; requests beyond ``n_parallel`` wait (counted in
  ``n_deferred``). ``admit()`` starts queued requests at the start of a step, in submission order; a request
  whose start fails finishes with ``error`` (its slot is released), never lost between queue and slot.
- Slot choice (llama-server's): ``id_slot`` pins a slot (the request waits for it); otherwise, with a prompt
  cache, the free slot whose cached tokens cover the largest share of the prompt (their common prefix over the
  prompt's length) when that share is above ``slot_prompt_similarity`` (``-sps``, 0.1; 0 turns it off), else
  the least recently used free slot (one never used first); without a prompt cache, the first free slot. A
  share, not any common prefix: every prompt of a model that adds BOS shares one token with every cache.
- Prompt cache (``Engine(cache_prompt=True)``, per request ``cache_prompt``): a finished request leaves its
  tokens in the slot's memory; the next request on that slot decodes only what follows the longest common
  prefix. A trimmable (PART) memory drops the rest with ``seq_rm``; a FULL / RS memory can only continue
  from its whole cached sequence (the new prompt extends it: multi-turn chat), otherwise it starts afresh.
- ``cancel()`` (any thread) is applied at the start of the next step (``apply_cancels``).
- ``retire()`` / ``release()``: what happens to a slot whose request finished or failed.
- ``finish()``: the one place a request ends, whatever ended it.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Callable, Sequence

from .errors import LlamaSpecError
from .memory import PromptCheckpoint, common_prefix
from .request import Request, RequestState
from .slot import FinishReason, GenerationStats, Slot, SlotState, progress_chunk
from .text import TextStream
from .verify.verifiers import verifier_for

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .chain import Chain
    from .memory import DraftRollback, TargetRollback
    from .policy import DraftBudget

log = logging.getLogger("llamaspec")
_FREE = (SlotState.IDLE, SlotState.DONE)  # ``free`` runs per slot every step: a global is cheaper


class Scheduler:
    """The queue and the slots (module docstring). ``make_verifier(mode, sampler, sampling)`` builds a
    request's verifier; ``verify`` is the engine's verification mode."""

    def __init__(self, slots: list[Slot], rollback_tgt: "TargetRollback", rollback_dft: "DraftRollback",
                 chain: "Chain | None", budget: "DraftBudget", *, verify: str, ctx: "llama.Context",
                 is_eog: Callable[[int], bool], synth_cond: Sequence[float] | None, cache_prompt: bool,
                 slot_prompt_similarity: float = 0.1):
        self.slots = slots
        self.rollback_tgt = rollback_tgt
        self.rollback_dft = rollback_dft
        self.chain = chain
        self.budget = budget
        self.verify = verify
        self.ctx = ctx
        self.is_eog = is_eog
        self.synth_cond = synth_cond
        #: keep a finished request's tokens in its slot for the next request's common prefix
        self.cache_prompt = cache_prompt
        self.slot_prompt_similarity = slot_prompt_similarity
        #: guards the queue, the cancels and the totals (any thread)
        self._queue_lock = threading.Lock()
        self._queued: deque[Request] = deque()
        self._cancels: list[Request] = []
        #: which request each busy slot serves (slot id -> request)
        self.serving: dict[int, Request] = {}
        #: requests that had to wait for a free slot
        self.n_deferred = 0
        self.totals = GenerationStats()
        self.n_requests_done = 0

    # -- the queue (any thread) -----------------------------------------------------------------------
    def enqueue(self, req: Request) -> None:
        with self._queue_lock:
            self._queued.append(req)
            if len(self._queued) > sum(self.free(s) for s in self.slots):
                self.n_deferred += 1  # it waits for a slot

    def request_cancel(self, req: Request) -> None:
        with self._queue_lock:
            self._cancels.append(req)

    def has_work(self) -> bool:
        return bool(self._queued or self._cancels or any(s.state not in _FREE for s in self.slots))

    # -- admission (under the engine lock) -------------------------------------------------------------
    @staticmethod
    def free(slot: Slot) -> bool:
        return slot.state in _FREE

    def request_in(self, slot: Slot) -> Request | None:
        """The request ``slot`` serves now (None: idle)."""
        return None if self.free(slot) else self.serving.get(slot.id)

    def _choose_slot(self, req: Request) -> Slot | None:
        if req.options.id_slot >= 0:
            slot = self.slots[req.options.id_slot]
            return slot if self.free(slot) else None
        free = [s for s in self.slots if self.free(s)]
        if not free:
            return None
        if not (self.cache_prompt and req.options.cache_prompt):
            return free[0]
        if self.slot_prompt_similarity > 0 and req.prompt_tokens:
            n = len(req.prompt_tokens)
            shares = [(common_prefix(s.cached, req.prompt_tokens) / n, s) for s in free if s.cached]
            share, best = max(shares, key=lambda x: x[0], default=(0.0, None))
            if best is not None and share > self.slot_prompt_similarity:
                return best
        return min(free, key=lambda s: s.t_last)  # the least recently used cache is the one to lose

    def admit(self) -> None:
        """Queued requests take slots, in submission order; a request pinned to a busy slot waits without
        holding back the others. A request whose start fails finishes with ``error``."""
        if not self._queued:  # (read without the lock: a request queued meanwhile is admitted next step)
            return
        with self._queue_lock:
            if not self._queued:
                return
            waiting = list(self._queued)
        n_free = sum(1 for s in self.slots if self.free(s))
        for req in waiting:
            if req.cancelled:
                with self._queue_lock:
                    self._queued.remove(req)
                self.finish(req, FinishReason.ABORT)
                continue
            if n_free == 0:  # every slot is busy: only cancels can be acted on
                continue
            slot = self._choose_slot(req)
            if slot is None:
                continue
            n_free -= 1
            with self._queue_lock:
                self._queued.remove(req)
            try:
                self._start(slot, req)
            except Exception as e:  # noqa: BLE001 - this request fails, the engine goes on
                self._start_failed(slot, req, e)

    def _start_failed(self, slot: Slot, req: Request, exc: Exception) -> None:
        msg = str(exc) or type(exc).__name__
        log.error("slot %d: request %d could not start: %s", slot.id, req.id, msg)
        slot.state, slot.finish_reason, slot.error = SlotState.DONE, FinishReason.ERROR, msg
        self.forget(slot)
        self.serving.pop(slot.id, None)
        self.finish(req, FinishReason.ERROR, f"the request could not start: {msg}")

    def _start(self, slot: Slot, req: Request) -> None:
        n_cached = self._reuse_cache(slot, req) if (self.cache_prompt and req.options.cache_prompt) else 0
        if not n_cached:
            self.release(slot)
        self._drop_sampler(slot)
        slot.reset()
        self.serving[slot.id] = req
        req.slot = slot
        slot.sampler = req.take_sampler()
        opts = slot.options = req.options
        slot.tokens = list(req.prompt_tokens)
        slot.n_prompt = len(slot.tokens)
        slot.n_prompt_done = n_cached
        slot.want_prompt_ckpt = bool(self.cache_prompt and opts.cache_prompt) and (
            self.rollback_tgt.prompt_checkpoint_pays(slot.n_prompt)
            or self.rollback_dft.prompt_checkpoint_pays(slot.n_prompt))
        slot.stream = TextStream(opts.stop, n_indent=opts.text.n_indent, t_max_predict_ms=opts.text.t_max_predict_ms)
        slot.state = SlotState.PROMPT
        slot.stats.n_prompt = slot.n_prompt
        slot.stats.n_cached = n_cached
        slot.t_start = time.perf_counter()
        spec = opts.speculative
        mode = spec.verify if spec is not None and spec.verify else self.verify
        slot.verifier = verifier_for(mode, slot.sampler, slot.sampling, self.ctx, self.is_eog, self.synth_cond)
        if self.chain is not None:
            self.chain.configure_sampling(slot.seq_id, slot.verifier.draft_temp, slot.sampling.seed)
            with self._queue_lock:
                slot.adaptive = self.budget.controller(self.totals)
        req.state = RequestState.PROMPT
        if opts.progress:  # before any prompt token is decoded: processed == cache
            req.deliver(progress_chunk(slot, req.id))

    def _reuse_cache(self, slot: Slot, req: Request) -> int:
        """Keep the longest usable cached prefix of ``slot`` for ``req``; returns its length (0 = none).

        A prefix is kept by trimming where every memory allows it (:meth:`Rollback.keep_prefix`), else from
        the slot's prompt checkpoint when the new prompt starts with its tokens (§7.6: the chain's
        per-sequence state comes back with it)."""
        cached = slot.cached
        n = min(common_prefix(cached, req.prompt_tokens), len(req.prompt_tokens) - 1)  # >= 1 token to decode
        if n <= 0:
            return 0
        behind = slot.draft_behind  # a restored slot (llamaspec.slot_state): its draft memory is empty
        rbs = [rb for rb in (self.rollback_tgt, self.rollback_dft) if rb.ctx is not None
               and not (behind and rb is self.rollback_dft)]
        if all(rb.keep_prefix(slot.seq_id, n, len(cached)) for rb in rbs):
            return n if not behind or self._draft_catch_up(slot, n) else 0
        if behind:
            return 0
        ckpt = slot.prompt_ckpt
        m = len(ckpt.tokens) if ckpt is not None else 0
        if not 0 < m <= n or tuple(req.prompt_tokens[:m]) != ckpt.tokens:
            return 0
        self.rollback_tgt.load_prompt(slot.seq_id, ckpt.data_tgt, m)
        self.rollback_dft.load_prompt(slot.seq_id, ckpt.data_dft, m)
        if self.chain is not None:
            self.chain.reset(slot.seq_id)
            if ckpt.data_spec:
                self.chain.set_state(slot.seq_id, ckpt.data_spec)
        log.debug("slot %d: %d prompt tokens restored from its prompt checkpoint", slot.id, m)
        return m

    def _draft_catch_up(self, slot: Slot, n: int) -> bool:
        """A restored slot's draft memory is empty: decode the ``n`` kept tokens into it (the drafter that owns
        the draft context does, in its own ids). False where none can (EAGLE-3 and MTP heads need the target's
        features): the prompt is then decoded whole."""
        slot.draft_behind = False
        try:
            return self.chain is not None and self.chain.redecode(slot.seq_id, slot.cached[:n], 0)
        except LlamaSpecError as e:
            log.warning("slot %d: the draft context could not catch up with the restored tokens (%s)", slot.id, e)
            return False

    def save_prompt_checkpoint(self, slot: Slot) -> None:
        """After ``len(prompt) - 1`` prompt tokens: remember the memory for later requests (§7.6)."""
        seq = slot.seq_id
        try:
            slot.prompt_ckpt = PromptCheckpoint(
                tuple(slot.tokens[: slot.n_prompt_done]), self.rollback_tgt.save_prompt(seq),
                self.rollback_dft.save_prompt(seq), self.chain.get_state(seq) if self.chain is not None else None)
        except Exception as e:  # noqa: BLE001 - only a later request's speed depends on it
            slot.prompt_ckpt = None
            log.warning("slot %d: could not save a prompt checkpoint (%s); later requests process their prompt",
                        slot.id, e)

    # -- cancel, retire, release ---------------------------------------------------------------------
    def apply_cancels(self) -> None:
        if not self._cancels:  # (read without the lock: a cancel queued meanwhile is applied next step)
            return
        with self._queue_lock:
            cancels, self._cancels = self._cancels, []
            queued = [req for req in cancels if req in self._queued]
            for req in queued:
                self._queued.remove(req)
        for req in cancels:  # one by one: a cancel that fails drops none of the others
            try:
                if req in queued:
                    self.finish(req, FinishReason.ABORT)
                else:
                    self._cancel_running(req)
            except Exception as e:  # noqa: BLE001 - this request ends anyway; the engine goes on
                self._cancel_failed(req, e)

    def _cancel_running(self, req: Request) -> None:
        slot = req.slot
        if req.done or slot is None or self.serving.get(slot.id) is not req:
            return
        slot.finish_reason = FinishReason.ABORT
        slot.state = SlotState.DONE
        self.forget(slot)
        self.finish(req, FinishReason.ABORT, stats=slot.stats)

    def _cancel_failed(self, req: Request, exc: Exception) -> None:
        """Cancelling ``req`` raised (freeing its memory: an RPC server gone): it ends all the same, and its
        slot keeps no cache whose memory may be half freed."""
        log.error("request %d: cancelling it failed: %s", req.id, str(exc) or type(exc).__name__)
        slot = req.slot
        if slot is not None and self.serving.get(slot.id) is req:
            slot.state, slot.finish_reason = SlotState.DONE, FinishReason.ABORT
            slot.tokens, slot.cached, slot.prompt_ckpt = [], [], None
            with contextlib.suppress(Exception):
                self._drop_sampler(slot)
        self.finish(req, FinishReason.ABORT)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None,
               stats: GenerationStats | None = None) -> None:
        """End ``req`` (every way a request ends goes through here, once): ``stats``, its slot's, count in the
        totals; the sampler it never handed to a slot is freed."""
        if stats is not None:
            self.record(stats)
        with contextlib.suppress(Exception):  # (freeing a sampler never keeps a request from ending)
            req.close_sampler()
        if not req.done:
            req.finish(reason, error)

    def release(self, slot: Slot) -> None:
        """Forget the slot's sequence in both contexts (and its cache)."""
        self.rollback_tgt.release(slot.seq_id)
        self.rollback_dft.release(slot.seq_id)
        slot.tokens = []
        slot.cached = []
        slot.prompt_ckpt = None
        slot.draft_behind = False
        self._drop_sampler(slot)

    def forget(self, slot: Slot) -> None:
        """:meth:`release`, and the drafters forget the sequence."""
        if self.chain is not None:
            self.chain.reset(slot.seq_id)
        self.release(slot)

    def retire(self, slot: Slot) -> None:
        """A request finished normally: keep its tokens as the slot's prompt cache, or release them."""
        req = self.serving.get(slot.id)
        if self.cache_prompt and req is not None and req.options.cache_prompt:
            slot.cached = list(slot.tokens)
            self._drop_sampler(slot)
        else:
            self.release(slot)
        slot.t_last = time.monotonic()

    def abort_all(self) -> None:
        """The engine closes: every queued or running request finishes with ``abort``."""
        for s in self.slots:
            req = self.serving.get(s.id)
            if req is not None:
                self.finish(req, FinishReason.ABORT)
            self._drop_sampler(s)
        with self._queue_lock:
            queued, self._queued = list(self._queued), deque()
        for req in queued:
            self.finish(req, FinishReason.ABORT)

    def _drop_sampler(self, slot: Slot) -> None:
        slot.spec_ckpt.drop_sampler()
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state in (SlotState.PROMPT, SlotState.GENERATING)]

    # -- reporting ----------------------------------------------------------------------------------
    def record(self, stats: GenerationStats) -> None:
        with self._queue_lock:
            self.totals.merge(stats)
            self.n_requests_done += 1

    def slots_info(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots``, in short)."""
        out = []
        for s in self.slots:
            req = self.request_in(s)
            out.append({
                "id": s.id,
                "state": s.state.value,
                "is_processing": req is not None,
                "id_task": req.id if req is not None else None,
                "n_prompt": s.n_prompt if req is not None else 0,
                "n_prompt_done": s.n_prompt_done if req is not None else 0,
                "n_predicted": len(s.generated) if req is not None else 0,
                "n_cached": len(s.cached) if req is None else s.stats.n_cached,
                "n_past": s.n_past,
            })
        return out

    def request_metrics(self) -> dict:
        """Totals over finished requests plus what is queued and running now."""
        with self._queue_lock:
            t = self.totals
            return {
                "prompt_tokens_total": t.n_prompt - t.n_cached,
                "prompt_tokens_cached_total": t.n_cached,
                "prompt_seconds_total": t.t_prompt_s,
                "tokens_predicted_total": t.n_predicted + t.n_eog,  # llama-server counts the EOG token
                "tokens_predicted_seconds_total": t.t_decode_s,
                "spec_decode_num_draft_tokens_total": t.n_drafted,
                "spec_decode_num_accepted_tokens_total": t.n_accepted,
                "spec_decode_num_drafts_total": t.n_verif_steps,
                "spec_decode_num_accepted_tokens_per_pos_total": list(t.n_accepted_per_pos),
                "requests_total": self.n_requests_done,
                "requests_processing": sum(not self.free(s) for s in self.slots),
                "requests_deferred": len(self._queued),
                "requests_deferred_total": self.n_deferred,
            }
