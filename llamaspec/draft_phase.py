"""§7.2-§7.3 of a round (:class:`DraftPhase`, composed by :class:`~llamaspec.round.Round`): every slot that may
draft asks the chain for a draft of the length the budget gives it, in one ``chain.draft()``; then each draft is
taken, the draft context is rolled back to the committed tokens and the target is checkpointed when the draft's
rollback will need it. A failure is confined to its slot (``fail``, the round's): a batched draft that raises
is retried slot by slot to find it.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from .errors import MemoryOpError
from .slot import Slot

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .adaptive import CostModel
    from .chain import Chain
    from .memory import DraftRollback, TargetRollback
    from .policy import DraftBudget

__all__ = ["DraftPhase"]

log = logging.getLogger("llamaspec")

Fail = Callable[[Slot, BaseException], None]
#: a slot's draft request: the slot, its n_max, n_min and p_min (None: the drafter's own)
_Ask = tuple[Slot, int, "int | None", "float | None"]


class DraftPhase:
    """The drafting phase of a round over the Engine's parts (all given at construction)."""

    def __init__(self, chain: "Chain", vocab: "llama.Vocab", rollback_tgt: "TargetRollback",
                 rollback_dft: "DraftRollback", budget: "DraftBudget", cost_model: "CostModel | None"):
        self.chain = chain
        self.vocab = vocab
        self.rollback_tgt = rollback_tgt
        self.rollback_dft = rollback_dft
        self.budget = budget
        self.cost_model = cost_model

    def run(self, gen: list[Slot], fail: Fail, allow: bool = True) -> None:
        """Draft for the generating slots ``gen`` (each slot's ``spec_draft`` is its draft afterwards);
        ``allow`` False (the referee's plain round): no new draft this round (replays still run)."""
        for s in self._draft(gen, fail, allow):
            try:
                self._after_draft(s)
            except Exception as e:  # noqa: BLE001 - confined to this slot
                fail(s, e)

    def _draft(self, gen: list[Slot], fail: Fail, allow: bool = True) -> list[Slot]:
        """§7.2 drafting phase: one ``chain.draft()`` for every slot that may draft; replay rounds skip it.
        When the chain raises, each slot drafts alone, and the slot whose draft raises fails."""
        chain = self.chain
        asked: list[_Ask] = []
        drafting: list[Slot] = []
        for s in gen:
            chain.stop_drafting(s.seq_id)
            try:
                if s.spec_draft:  # replay round: no new draft
                    self.rollback_tgt.check_replay(s.seq_id, s.spec_ckpt)
                    continue
            except Exception as e:  # noqa: BLE001 - confined to this slot
                fail(s, e)
                continue
            drafting.append(s)
        if not allow:
            return []
        chain.n_gen = len(gen)
        for s, n_max, skipped in self.budget.lengths(drafting):
            if skipped:
                s.stats.n_draft_skipped += 1
            if n_max <= 0:
                continue
            try:
                self.rollback_tgt.mark(s.seq_id, s.n_past, s.spec_ckpt)
                self.rollback_dft.before_draft(s.seq_id, s.spec_ckpt)
            except Exception as e:  # noqa: BLE001 - confined to this slot
                fail(s, e)
                continue
            req = s.options.speculative
            n_min, p_min = (req.n_min, req.p_min) if req is not None else (None, None)
            chain.request_draft(s.seq_id, n_max, s.n_past, s.sampled, s.tokens, n_min, p_min, s.n_remaining)
            asked.append((s, n_max, n_min, p_min))
        requested = [a[0] for a in asked]
        if not requested:
            return requested
        try:
            t0 = time.perf_counter()
            chain.draft()
            if self.cost_model is not None:
                lens = [len(chain.result(s.seq_id)[0]) for s in requested]
                ms = (time.perf_counter() - t0) * 1e3 - chain.catch_up_ms()
                self.cost_model.add_draft(sum(lens), max(ms, 0.0), n_seqs=len(requested), n_steps=max(lens))
            return requested
        except Exception as e:  # noqa: BLE001 - find the slot it belongs to
            if len(requested) == 1:
                fail(requested[0], e)
                return []
            log.warning("drafting failed for %d slots together (%s); drafting each alone", len(requested), e)
        return self._draft_each_alone(asked, fail)

    def _draft_each_alone(self, asked: list[_Ask], fail: Fail) -> list[Slot]:
        chain = self.chain
        ok: list[Slot] = []
        for s, *_ in asked:
            chain.reset(s.seq_id)
        for s, n_max, n_min, p_min in asked:
            chain.request_draft(s.seq_id, n_max, s.n_past, s.sampled, s.tokens, n_min, p_min, s.n_remaining)
            try:
                if not self.rollback_dft.recover(s.seq_id, s.n_past, s.spec_ckpt):  # drop the failed batch's rows
                    raise MemoryOpError(f"slot {s.id}: the draft memory could not be restored after a failed draft")
                chain.draft()
                ok.append(s)
            except Exception as e:  # noqa: BLE001 - confined to this slot
                fail(s, e)
        return ok

    def _after_draft(self, s: Slot) -> None:
        """§7.3 post-draft checkpointing: take the draft, roll the draft context back to the committed
        tokens, checkpoint the target when this draft's rollback will need it."""
        result, probs = self.chain.result(s.seq_id)
        draft = list(result)
        n_vocab = self.vocab.n_tokens
        bad = next((i for i, t in enumerate(draft) if not 0 <= t < n_vocab), None)
        if bad is not None:  # a token the target cannot decode ends the draft
            log.warning("slot %d: draft token %d is outside the target vocabulary; draft cut at %d",
                        s.id, draft[bad], bad)
            del draft[bad:]
        s.spec_draft = draft
        s.spec_probs = probs[: len(draft)] if probs is not None else None
        s.stats.n_drafted += len(s.spec_draft)
        self.rollback_dft.after_draft(s.seq_id, s.spec_ckpt)
        t0 = time.perf_counter()
        if self.rollback_tgt.checkpoint(s.seq_id, s.spec_ckpt, len(s.spec_draft)):
            s.spec_ckpt.keep_sampler(s.sampler.clone())
            s.stats.n_checkpoints += 1
            if self.cost_model is not None:
                self.cost_model.add_checkpoint((time.perf_counter() - t0) * 1e3)
