"""Rollback by memory level (spec §6, §7.2–§7.5, §9): one object per context owns every memory operation.

The level of each context is probed once at start-up (:func:`llamaspec.probe.can_seq_rm`). The engine then
holds a :class:`TargetRollback` for the target context and a :class:`DraftRollback` for the draft context
(a no-op one when there is none) and asks them to act at fixed points of the round; it never calls
``seq_rm`` or loads a state itself:

=====================  ==========================================  ==========================================
round step             target (:class:`TargetRollback`)            draft (:class:`DraftRollback`)
=====================  ==========================================  ==========================================
before drafting §7.2   ``mark``: remember ``n_past`` / positions    ``before_draft``: FULL saves its state
after drafting §7.3    ``checkpoint``: state + sampler when the     ``after_draft``: FULL reloads, then drop
                       level needs one for this draft length       what drafting decoded
partial accept §7.5.4  ``restore``: reload, trim, sampler back      ``restore``: reload, trim
commit §7.5.8          ``commit``: trim rejected rows               ``commit``: trim (FULL: reload + re-decode)
after an error         ``recover``: memory == committed tokens?     ``recover``: the same for the draft
=====================  ==========================================  ==========================================

Every ``seq_rm`` result is checked: a false return where the level promises success raises
:class:`MemoryOpError` instead of silently keeping rejected tokens (design.md, "never ignore a bool").
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from . import _llama as llama
from .errors import MemoryOpError
from .level import Level

if TYPE_CHECKING:  # pragma: no cover
    from .sampler import TargetSampler
    from .slot import Slot

log = logging.getLogger("llamaspec")


@dataclass
class Checkpoint:
    """Speculative checkpoint of one slot (llama.cpp's ``common_prompt_checkpoint`` used as ``spec_ckpt``).

    ``sampler`` is the target sampler as it was before verification, kept while a target checkpoint is
    held (a restore puts it back so the replay draws the same random numbers)."""

    n_tokens: int = 0
    pos_min: int = -1
    pos_max: int = -1
    data_tgt: bytes = b""
    data_dft: bytes = b""
    sampler: "TargetSampler | None" = field(default=None, repr=False)

    def update_pos(self, n_tokens: int, pos_min: int, pos_max: int) -> None:
        self.n_tokens, self.pos_min, self.pos_max = n_tokens, pos_min, pos_max
        self.data_tgt = b""
        self.data_dft = b""
        self.drop_sampler()

    @property
    def empty(self) -> bool:
        return not self.data_tgt

    def drop_sampler(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


@dataclass
class PromptCheckpoint:
    """A slot's memory after all but the last token of its prompt (spec §7.6, llama-server's prompt
    checkpoints): what a later request that shares the prefix ``tokens`` restores where trimming cannot
    give it back (FULL / RS memories, or a sliding-window cache whose window was pruned). ``data_spec`` is
    the chain's per-sequence state at that point (``chain.get_state``); empty data = nothing to load."""

    tokens: tuple[int, ...] = ()
    data_tgt: bytes = b""
    data_dft: bytes = b""
    data_spec: bytes | None = None


class SeqMemory:
    """Checked memory operations on one context, for the drafters that keep rows of their own in the draft
    context (draft-simple with ``reuse_kv``, EAGLE-3, MTP): the only way a drafter reaches memory. A refused
    trim raises :class:`MemoryOpError` (design.md, "never ignore a bool"); a shared memory whose ``seq_rm`` is a
    no-op that returns true (spec §6.2) passes."""

    def __init__(self, ctx: "llama.Context"):
        self.ctx = ctx

    def pos_min(self, seq_id: int) -> int:
        return self.ctx.memory.pos_min(seq_id)

    def pos_max(self, seq_id: int) -> int:
        return self.ctx.memory.pos_max(seq_id)

    def trim(self, seq_id: int, pos: int) -> bool:
        """Drop positions ``>= pos`` of ``seq_id``; returns whether anything was there to drop."""
        memory = self.ctx.memory
        had = memory.pos_max(seq_id) >= pos
        if not memory.seq_rm(seq_id, pos, -1):
            raise MemoryOpError(f"seq_rm(seq={seq_id}, p0={pos}) was refused by the draft context's memory; the "
                                "drafter's own rows cannot be dropped (a bug: please report it)")
        return had


class Rollback:
    """The memory of one context at its probed level: what it can trim and what needs a checkpoint."""

    def __init__(self, ctx: "llama.Context | None", level: Level):
        self.ctx = ctx
        self.level = level
        self.n_rs_seq = ctx.n_rs_seq if ctx is not None else 0
        self.n_swa = ctx.model.n_swa if ctx is not None else 0

    # -- the prompt cache (spec §7.6) ----------------------------------------------------------------
    def prompt_checkpoint_pays(self, n_prompt: int) -> bool:
        """Whether a prompt of ``n_prompt`` tokens should leave a :class:`PromptCheckpoint`: always on FULL /
        RS memories (a prefix cannot be trimmed back), on a sliding-window cache only when the prompt is
        longer than the window (shorter ones keep their window: trimming works)."""
        if self.ctx is None or n_prompt < 2:
            return False
        if self.level in (Level.FULL, Level.RS):
            return True
        return self.n_swa > 0 and n_prompt - 1 > self.n_swa

    def keep_prefix(self, seq_id: int, n: int, n_cached: int) -> bool:
        """Keep the first ``n`` of the ``n_cached`` cached tokens of ``seq_id`` by trimming, if the memory
        can: PART trims (a sliding-window cache only while the window before ``n`` is still complete);
        FULL / RS only keep the whole cached sequence."""
        if self.ctx is None:
            return True
        if self.level is not Level.PART:
            return n == n_cached
        memory = self.ctx.memory
        # a sliding-window cache reuses the cells of positions that left the window of the longer cached
        # sequence: the window before ``n`` must still be there (llama-server's rule)
        if self.n_swa > 0 and memory.pos_min(seq_id) > max(0, n - self.n_swa):
            return False
        return memory.seq_rm(seq_id, n, -1)

    def save_prompt(self, seq_id: int) -> bytes:
        """State for a :class:`PromptCheckpoint` (empty where a trim is enough: plain PART)."""
        if self.ctx is None or (self.level is Level.PART and self.n_swa <= 0):
            return b""
        return self._save(seq_id)

    def load_prompt(self, seq_id: int, data: bytes, n: int) -> None:
        """Back to a :class:`PromptCheckpoint` of ``n`` tokens: load its state, drop what follows."""
        if self.ctx is None:
            return
        self._load(seq_id, data)
        self.trim(seq_id, n)

    # -- the level's rules (spec §9) ----------------------------------------------------------------
    def needs_checkpoint(self, n_draft: int) -> bool:
        """Whether verifying a draft of ``n_draft`` tokens needs a state checkpoint first."""
        if self.level is Level.FULL:
            return True
        return self.level is Level.RS and n_draft > self.n_rs_seq

    def needs_restore(self, n_rollback: int) -> bool:
        """Whether dropping ``n_rollback`` rejected rows needs the checkpoint (``seq_rm`` cannot do it)."""
        if self.level is Level.FULL:
            return True
        return self.level is Level.RS and n_rollback > self.n_rs_seq

    # -- primitives -------------------------------------------------------------------------------
    def trim(self, seq_id: int, pos: int) -> bool:
        """Drop positions ``>= pos``; raises if the memory refuses. Returns whether anything was removed."""
        memory = self.ctx.memory
        had = memory.pos_max(seq_id) >= pos
        if not memory.seq_rm(seq_id, pos, -1):
            raise MemoryOpError(
                f"seq_rm(seq={seq_id}, p0={pos}) was refused by a {self.level.name} memory; the rejected draft "
                "tokens cannot be removed (this is a bug in the rollback strategy, please report it)"
            )
        return had

    def release(self, seq_id: int) -> None:
        """Forget a sequence entirely (its request ended)."""
        if self.ctx is None or not self.ctx.ptr or self.ctx.memory is None:
            return
        if not self.ctx.memory.seq_rm(seq_id, 0, -1):
            log.warning("seq_rm refused to clear sequence %d of a %s memory", seq_id, self.level.name)

    def _save(self, seq_id: int) -> bytes:
        return self.ctx.state_seq_get(seq_id, llama.STATE_FLAGS_PARTIAL_ONLY)

    def _load(self, seq_id: int, data: bytes) -> None:
        if data:
            self.ctx.state_seq_set(seq_id, data, llama.STATE_FLAGS_PARTIAL_ONLY)

    def recover(self, slot: "Slot") -> bool:
        """After an error mid-round: make this memory hold exactly the slot's committed tokens
        (``seq_pos_max == n_past - 1``). Returns False when that is impossible (the slot must be aborted)."""
        if self.ctx is None or not self.ctx.ptr or self.ctx.memory is None:
            return True
        memory, seq_id, n_past = self.ctx.memory, slot.seq_id, slot.n_past
        if memory.pos_max(seq_id) >= n_past and not memory.seq_rm(seq_id, n_past, -1):
            ckpt = slot.spec_ckpt
            data = self._checkpoint_data(ckpt)
            if ckpt.n_tokens == n_past and data:
                try:
                    self._load(seq_id, data)
                except Exception as e:  # noqa: BLE001 - reported below as an unrecoverable slot
                    log.error("slot %d: reloading the checkpoint failed: %s", slot.id, e)
                    return False
                memory.seq_rm(seq_id, n_past, -1)
        return memory.pos_max(seq_id) == n_past - 1

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        raise NotImplementedError


class TargetRollback(Rollback):
    """The target context: checkpoints before verification when its level needs them, restore + replay."""

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        return ckpt.data_tgt

    def mark(self, slot: "Slot") -> None:
        """Before drafting (§7.2): the checkpoint describes the committed tokens (no state saved yet)."""
        memory = self.ctx.memory
        slot.spec_ckpt.update_pos(slot.n_past, memory.pos_min(slot.seq_id), memory.pos_max(slot.seq_id))

    def checkpoint(self, slot: "Slot") -> None:
        """After drafting (§7.3): save the state (and the sampler) when this draft's rollback needs it."""
        if not slot.spec_draft or not self.needs_checkpoint(len(slot.spec_draft)):
            return
        ckpt = slot.spec_ckpt
        ckpt.data_tgt = self._save(slot.seq_id)
        ckpt.drop_sampler()
        ckpt.sampler = slot.sampler.clone()
        slot.stats.n_checkpoints += 1

    def check_replay(self, slot: "Slot") -> None:
        """A replay round re-decodes from the checkpoint; on FULL memories there must be one (§7.2)."""
        if self.level is Level.FULL and slot.spec_ckpt.empty:
            raise MemoryOpError(f"slot {slot.id}: replay round without a target checkpoint")

    def restore(self, slot: "Slot") -> None:
        """Partial acceptance that ``seq_rm`` cannot undo (§7.5 step 4): reload the checkpoint, drop what
        follows it, and put the sampler back as it was before verification."""
        ckpt = slot.spec_ckpt
        if ckpt.empty:
            raise MemoryOpError(f"slot {slot.id}: partial acceptance needs a checkpoint, none was taken")
        self._load(slot.seq_id, ckpt.data_tgt)
        self.trim(slot.seq_id, ckpt.pos_max + 1)
        if ckpt.sampler is not None:
            slot.sampler.copy_from(ckpt.sampler)
            ckpt.drop_sampler()
        slot.stats.n_restores += 1

    def commit(self, slot: "Slot") -> None:
        """After acceptance (§7.5 step 8): drop the rejected rows."""
        slot.spec_ckpt.drop_sampler()
        if self.trim(slot.seq_id, slot.n_past):
            slot.stats.n_trims += 1


class DraftRollback(Rollback):
    """The draft model's context. A FULL draft memory is saved before drafting and reloaded after it; where
    llama.cpp aborts (a FULL draft with a trimming target, spec §7.5), it reloads and re-decodes instead."""

    def __init__(self, ctx: "llama.Context | None", level: Level, *, keep_drafted: bool = False):
        super().__init__(ctx, level)
        #: leave what drafting decoded in the draft context (``reuse_kv``: the drafter skips those rows)
        self.keep_drafted = keep_drafted

    @property
    def active(self) -> bool:
        return self.ctx is not None

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        return ckpt.data_dft

    def before_draft(self, slot: "Slot") -> None:
        if self.ctx is not None and self.level is Level.FULL:
            slot.spec_ckpt.data_dft = self._save(slot.seq_id)

    def after_draft(self, slot: "Slot") -> None:
        """Drop whatever drafting decoded (§7.3 step 2): the verification batch is mirrored into it."""
        if self.ctx is None:
            return
        ckpt = slot.spec_ckpt
        if self.level is Level.FULL:
            self._load(slot.seq_id, ckpt.data_dft)
        if not self.keep_drafted:
            self.trim(slot.seq_id, ckpt.pos_max + 1)

    def restore(self, slot: "Slot") -> None:
        if self.ctx is None:
            return
        ckpt = slot.spec_ckpt
        self._load(slot.seq_id, ckpt.data_dft)
        self._trim_or_redecode(slot, ckpt.pos_max + 1)

    def commit(self, slot: "Slot") -> None:
        if self.ctx is not None:
            self._trim_or_redecode(slot, slot.n_past)

    def _trim_or_redecode(self, slot: "Slot", pos: int) -> None:
        """Trim at ``pos``; a FULL memory that refuses is reloaded from the checkpoint and the committed
        tokens after it are decoded again."""
        memory, seq_id = self.ctx.memory, slot.seq_id
        if memory.seq_rm(seq_id, pos, -1):
            return
        ckpt = slot.spec_ckpt
        if self.level is not Level.FULL or not ckpt.data_dft:
            raise MemoryOpError(f"seq_rm on the draft context was refused (slot {slot.id}, pos {pos})")
        self._load(seq_id, ckpt.data_dft)
        if not memory.seq_rm(seq_id, ckpt.pos_max + 1, -1):
            raise MemoryOpError(f"could not roll back the draft context of slot {slot.id}")
        redo = slot.prompt[ckpt.n_tokens : pos]
        if redo:
            self.ctx.decode_tokens(redo, ckpt.n_tokens, seq_id, output_last=True)
