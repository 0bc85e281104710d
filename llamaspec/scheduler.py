"""Requests in, slots out: the queue, slot choice, the prompt cache, cancels and the engine thread.

:class:`Scheduler` is the part of :class:`~llamaspec.engine.Engine` that decides which request runs where
(llama-server's task queue and slot selection):

- ``submit()`` (any thread) validates the request and queues it; requests beyond ``n_parallel`` wait
  (counted in ``n_deferred``). Admission happens at the start of a step, or at once when no step runs.
- Slot choice: ``id_slot`` pins a slot (the request waits for it); otherwise, with a prompt cache, the free
  slot whose cached tokens share the longest prefix with the prompt, else the least recently used one;
  without one, the first free slot.
- Prompt cache (``Engine(cache_prompt=True)``, per request ``cache_prompt``): a finished request leaves its
  tokens in the slot's memory; the next request on that slot decodes only what follows the longest common
  prefix. A trimmable (PART) memory drops the rest with ``seq_rm``; a FULL / RS memory can only continue
  from its whole cached sequence (the new prompt extends it: multi-turn chat), otherwise it starts afresh.
- ``cancel()`` (any thread) is applied at the start of the next step.
- ``start()`` runs steps in a background thread while there is work (a server's engine thread).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

from . import _llama as llama
from .adaptive import DraftLengthController
from .errors import ContextOverflowError, UsageError
from .memory import PromptCheckpoint
from .params import RequestSpec
from .request import Request, RequestState
from .sampler import TargetSampler
from .slot import FinishReason, GenerationStats, Slot, SlotState
from .text import TextStream
from .verify.verifiers import verifier_for

log = logging.getLogger("llamaspec")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix.

    >>> common_prefix([1, 2, 3, 4], [1, 2, 5])
    2
    """
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Mixin of the Engine (see the module docstring). Uses the Engine's ``slots``, locks and rollbacks."""

    # -- submit ---------------------------------------------------------------------------------------
    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        n_predict: int = -1,
        sampling: llama.SamplingParams | None = None,
        stop: Sequence[str] = (),
        parse_special: bool = False,
        speculative: RequestSpec | None = None,
        id_slot: int = -1,
        cache_prompt: bool = True,
    ) -> Request:
        """Queue a request (any thread) and return its :class:`~llamaspec.request.Request`.

        ``n_predict=0`` decodes the prompt only. ``speculative`` lowers the engine's draft settings for this
        request (``n_max=0``: no drafting). ``id_slot`` pins a slot. ``cache_prompt`` reuses the slot's
        cached prefix when the engine keeps a prompt cache."""
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
        if not -1 <= id_slot < self.n_parallel:
            raise UsageError(f"id_slot must be -1 (any) or 0..{self.n_parallel - 1}, got {id_slot}")
        if speculative is not None:
            speculative.validate(self.chain.n_max if self.chain is not None else 0)
        sampling = sampling or llama.SamplingParams(temp=0.0)
        sampler = TargetSampler(self.vocab, sampling)
        with self._admin:
            self._next_id += 1
            req = Request(self, self._next_id, tokens, n_predict=n_predict, sampling=sampling, sampler=sampler,
                          stop=stop)
            req.speculative, req.id_slot, req.cache_prompt = speculative, id_slot, cache_prompt
            self._queued.append(req)
            if len(self._queued) > sum(s.state in (SlotState.IDLE, SlotState.DONE) for s in self.slots):
                self.n_deferred += 1  # it waits for a slot
        if self._step_lock.acquire(blocking=False):
            try:
                if not self._closed:
                    self._admit()
            finally:
                self._step_lock.release()
        self._notify()
        return req

    # -- admission ----------------------------------------------------------------------------------
    def _free(self, slot: Slot) -> bool:
        return slot.state in (SlotState.IDLE, SlotState.DONE)

    def _choose_slot(self, req: Request) -> Slot | None:
        if req.id_slot >= 0:
            slot = self.slots[req.id_slot]
            return slot if self._free(slot) else None
        free = [s for s in self.slots if self._free(s)]
        if not free:
            return None
        if not (self.cache_prompt and req.cache_prompt):
            return free[0]
        best = max(free, key=lambda s: (common_prefix(s.cached, req.prompt_tokens), -s.t_last))
        if best.cached and common_prefix(best.cached, req.prompt_tokens) > 0:
            return best
        return min(free, key=lambda s: s.t_last)  # the least recently used cache is the one to lose

    def _admit(self) -> None:
        """Queued requests take slots, in submission order (under the step lock); a request pinned to a busy
        slot waits without holding back the others."""
        with self._admin:
            waiting = list(self._queued)
        for req in waiting:
            if req._cancel:
                with self._admin:
                    self._queued.remove(req)
                req._close_sampler()
                req._finish(FinishReason.ABORT)
                continue
            slot = self._choose_slot(req)
            if slot is None:
                continue
            with self._admin:
                self._queued.remove(req)
            self._start(slot, req)

    def _start(self, slot: Slot, req: Request) -> None:
        n_cached = self._reuse_cache(slot, req) if (self.cache_prompt and req.cache_prompt) else 0
        if not n_cached:
            self._release(slot)
        self._drop_sampler(slot)
        slot.reset()
        slot.request, req.slot = req, slot
        slot.sampler, req._sampler = req._sampler, None
        slot.sampling = req.sampling
        slot.spec_req = req.speculative
        slot.prompt = list(req.prompt_tokens)
        slot.n_prompt = len(slot.prompt)
        slot.n_prompt_done = n_cached
        slot.want_prompt_ckpt = bool(self.cache_prompt and req.cache_prompt) and (
            self.rollback_tgt.prompt_checkpoint_pays(slot.n_prompt) or self.rollback_dft.prompt_checkpoint_pays(slot.n_prompt))
        slot.n_predict = req.n_predict
        slot.stream = TextStream(req.stop)
        slot.state = SlotState.PROMPT
        slot.stats.n_prompt = slot.n_prompt
        slot.stats.n_cached = n_cached
        slot._t0 = time.perf_counter()
        mode = req.speculative.verify if req.speculative is not None and req.speculative.verify else self.verify
        slot.verifier = verifier_for(mode, slot, self.ctx, self.vocab.is_eog, self.synth_cond)
        if self.chain is not None:
            self.chain.configure_sampling(slot.seq_id, slot.verifier.draft_temp, slot.sampling.seed)
            if self.cost_model is not None:
                t = self.totals  # a new request starts from the engine-wide acceptance
                prior = t.n_accepted / t.n_drafted if t.n_drafted >= 32 else 0.7
                slot.adaptive = DraftLengthController(self.chain.n_max, prior_rate=min(max(prior, 0.05), 0.98))
        req.state = RequestState.PROMPT

    def _reuse_cache(self, slot: Slot, req: Request) -> int:
        """Keep the longest usable cached prefix of ``slot`` for ``req``; returns its length (0 = none).

        A prefix is kept by trimming where every memory allows it (:meth:`Rollback.keep_prefix`), else from
        the slot's prompt checkpoint when the new prompt starts with its tokens (spec §7.6: the chain's
        per-sequence state comes back with it)."""
        cached = slot.cached
        n = min(common_prefix(cached, req.prompt_tokens), len(req.prompt_tokens) - 1)  # >= 1 token to decode
        if n <= 0:
            return 0
        rbs = [rb for rb in (self.rollback_tgt, self.rollback_dft) if rb.ctx is not None]
        if all(rb.keep_prefix(slot.seq_id, n, len(cached)) for rb in rbs):
            return n
        ck = slot.prompt_ckpt
        m = len(ck.tokens) if ck is not None else 0
        if not 0 < m <= n or tuple(req.prompt_tokens[:m]) != ck.tokens:
            return 0
        self.rollback_tgt.load_prompt(slot.seq_id, ck.data_tgt, m)
        self.rollback_dft.load_prompt(slot.seq_id, ck.data_dft, m)
        if self.chain is not None:
            self.chain.reset(slot.seq_id)
            if ck.data_spec:
                self.chain.set_state(slot.seq_id, ck.data_spec)
        log.debug("slot %d: %d prompt tokens restored from its prompt checkpoint", slot.id, m)
        return m

    def _save_prompt_ckpt(self, slot: Slot) -> None:
        """After ``len(prompt) - 1`` prompt tokens: remember the memory for later requests (§7.6)."""
        seq = slot.seq_id
        try:
            slot.prompt_ckpt = PromptCheckpoint(
                tuple(slot.prompt[: slot.n_prompt_done]), self.rollback_tgt.save_prompt(seq),
                self.rollback_dft.save_prompt(seq), self.chain.get_state(seq) if self.chain is not None else None)
        except Exception as e:  # noqa: BLE001 - only a later request's speed depends on it
            slot.prompt_ckpt = None
            log.warning("slot %d: could not save a prompt checkpoint (%s); later requests process their prompt", slot.id, e)

    # -- cancel, release ----------------------------------------------------------------------------
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
            self._record(req, slot.stats)
            req._finish(FinishReason.ABORT)

    def _release(self, slot: Slot) -> None:
        """Forget the slot's sequence in both contexts (and its cache)."""
        self.rollback_tgt.release(slot.seq_id)
        self.rollback_dft.release(slot.seq_id)
        slot.prompt = []
        slot.cached = []
        slot.prompt_ckpt = None
        self._drop_sampler(slot)

    def _retire(self, slot: Slot) -> None:
        """A request finished normally: keep its tokens as the slot's prompt cache, or release them."""
        if self.cache_prompt and slot.request is not None and slot.request.cache_prompt:
            slot.cached = list(slot.prompt)
            self._drop_sampler(slot)
        else:
            self._release(slot)
        slot.t_last = time.monotonic()

    def _drop_sampler(self, slot: Slot) -> None:
        slot.spec_ckpt.drop_sampler()
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state in (SlotState.PROMPT, SlotState.GENERATING)]

    @property
    def n_queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._queued)

    # -- the engine thread -------------------------------------------------------------------------
    def start(self) -> None:
        """Run steps in a background thread while there is work (idempotent). Requests then only wait."""
        self._check_open()
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop_thread = False
        self._thread = threading.Thread(target=self._loop, name="llamaspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the background thread (the current step finishes first)."""
        self._stop_thread = True
        self._notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        self._thread = None

    def _has_work(self) -> bool:
        return bool(self._queued or self._cancels or any(not self._free(s) for s in self.slots))

    def _loop(self) -> None:
        while not self._stop_thread and not self._closed:
            if not self._has_work():
                with self._cv:
                    self._cv.wait(0.05)
                continue
            try:
                self.step()
            except Exception:  # noqa: BLE001 - an engine thread must not die; step confines errors to slots
                log.exception("engine step failed")
                time.sleep(0.01)

    # -- reporting ----------------------------------------------------------------------------------
    def _record(self, req: Request, stats: GenerationStats) -> None:
        with self._admin:
            self.totals.merge(stats)
            self.n_requests_done += 1

    def slots_info(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots``, in short)."""
        out = []
        for s in self.slots:
            req = s.request if not self._free(s) else None
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

    def metrics(self) -> dict:
        """Totals over finished requests plus what is running now (llama-server's ``/metrics`` names)."""
        with self._admin:
            t = self.totals
            return {
                "prompt_tokens_total": t.n_prompt - t.n_cached,
                "prompt_tokens_cached_total": t.n_cached,
                "prompt_seconds_total": t.t_prompt_s,
                "tokens_predicted_total": t.n_predicted,
                "tokens_predicted_seconds_total": t.t_decode_s,
                "n_decode_total": self.n_decode_total,
                "n_busy_slots_per_decode": self.n_busy_slots_total / self.n_decode_total if self.n_decode_total else 0.0,
                "spec_decode_num_draft_tokens_total": t.n_drafted,
                "spec_decode_num_accepted_tokens_total": t.n_accepted,
                "spec_decode_num_drafts_total": t.n_verif_steps,
                "spec_decode_num_accepted_tokens_per_pos_total": list(t.n_accepted_per_pos),
                "requests_total": self.n_requests_done,
                "requests_processing": sum(not self._free(s) for s in self.slots),
                "requests_deferred": len(self._queued),
                "requests_deferred_total": self.n_deferred,
            }
