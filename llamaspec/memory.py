"""Rollback by memory level (§6, §7.2–§7.5, §9): one object per context owns every memory operation.

The level of each context is probed once at start-up (:func:`llamaspec.probe.can_seq_rm`). The engine then
holds a :class:`TargetRollback` for the target context and a :class:`DraftRollback` for the draft context
(a no-op one when there is none) and asks them to act at fixed points of the round; it never calls
``seq_rm`` or loads a state itself:

=====================  ==========================================  ==========================================
round step             target (:class:`TargetRollback`)            draft (:class:`DraftRollback`)
=====================  ==========================================  ==========================================
before drafting §7.2   ``mark``: remember ``n_past`` / positions    ``before_draft``: FULL saves its state
after drafting §7.3    ``checkpoint``: state when the level needs   ``after_draft``: FULL reloads, then drop
                       one for this draft length (True: saved)     what drafting decoded
partial accept §7.5.4  ``restore``: reload, trim                    ``restore``: reload, trim
commit §7.5.8          ``commit``: trim rejected rows (True: some   ``commit``: trim (FULL: reload + re-decode)
                       were there)
after an error         ``recover``: memory == committed tokens?     ``recover``: the same for the draft
=====================  ==========================================  ==========================================

The verbs take a sequence id, its committed length ``n_past`` and its :class:`Checkpoint`, and say what they
did; they know nothing of slots, samplers or statistics (the round keeps the sampler with the checkpoint and
counts checkpoints, restores and trims). Every ``seq_rm`` result is checked: a false return where the level
promises success raises :class:`MemoryOpError` instead of silently keeping rejected tokens (no
boolean result of llama.cpp is ignored). Drafters that keep rows of their own in the draft context reach it through
:class:`SeqMemory`, never directly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from . import _llama as llama
from .errors import MemoryOpError
from .level import Level

if TYPE_CHECKING:  # pragma: no cover
    from .sampler import TargetSampler

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

    def keep_sampler(self, sampler: "TargetSampler") -> None:
        """Keep ``sampler`` (a clone of the target sampler before verification) with the state."""
        self.drop_sampler()
        self.sampler = sampler

    def take_sampler(self) -> "TargetSampler | None":
        """The kept sampler, handed over (the checkpoint no longer holds it)."""
        sampler, self.sampler = self.sampler, None
        return sampler

    def drop_sampler(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
            self.sampler = None


@dataclass
class PromptCheckpoint:
    """A slot's memory after all but the last token of its prompt (§7.6, llama-server's prompt
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
    trim raises :class:`MemoryOpError` (no boolean result is ignored); a shared memory whose ``seq_rm`` is a
    no-op that returns true (§6.2) passes."""

    def __init__(self, ctx: "llama.Context"):
        self.ctx = ctx

    def pos_max(self, seq_id: int) -> int:
        return self.ctx.memory.pos_max(seq_id)

    def trim(self, seq_id: int, pos: int) -> bool:
        """Drop positions ``>= pos`` of ``seq_id``; returns whether anything was there to drop."""
        return _trim(self.ctx.memory, seq_id, pos, "the draft context's memory; the drafter's own rows cannot be "
                     "dropped (a bug: please report it)")


def _trim(memory: "llama.Memory", seq_id: int, pos: int, refused_by: str) -> bool:
    """``seq_rm(seq_id, pos, -1)``, checked (:class:`MemoryOpError` naming ``refused_by``); whether anything was
    there to drop."""
    had = memory.pos_max(seq_id) >= pos
    if not memory.seq_rm(seq_id, pos, -1):
        raise MemoryOpError(f"seq_rm(seq={seq_id}, p0={pos}) was refused by {refused_by}")
    return had


class Rollback:
    """The memory of one context at its probed level: what it can trim and what needs a checkpoint."""

    def __init__(self, ctx: "llama.Context | None", level: Level):
        self.ctx = ctx
        self.level = level
        self.n_rs_seq = ctx.n_rs_seq if ctx is not None else 0
        self.n_swa = ctx.model.n_swa if ctx is not None else 0

    # -- the prompt cache (§7.6) ----------------------------------------------------------------
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

    def keep_common_prefix(self, seq_id: int, cached: list[int], tokens: Sequence[int], n_max: int) -> int:
        """For a context beside the engine that keeps the known ``cached`` tokens of one sequence (compat's draft
        model and scorer): keep their longest common prefix with ``tokens``, at most ``n_max`` tokens
        (:meth:`keep_prefix`), else start over. ``cached`` is cut to what is kept; returns its length."""
        n = min(common_prefix(cached, tokens), n_max)
        if n < len(cached) and not self.keep_prefix(seq_id, n, len(cached)):
            self.release(seq_id)
            n = 0
        del cached[n:]
        return n

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

    # -- whole sequences (slot save / restore: llamaspec.slot_state) --------------------------------
    def n_positions(self, seq_id: int) -> int:
        """Positions of ``seq_id`` in memory (``pos_max + 1``; 0 without a context)."""
        return self.ctx.memory.pos_max(seq_id) + 1 if self._live() else 0

    def save_seq(self, seq_id: int) -> bytes:
        """The whole state of ``seq_id`` (every cache and recurrent state: llama-server's slot files)."""
        return self.ctx.state_seq_get(seq_id, llama.STATE_FLAGS_NONE) if self._live() else b""

    def load_seq(self, seq_id: int, data: bytes) -> None:
        """Load a :meth:`save_seq` state into ``seq_id`` (raises :class:`~llamaspec.errors.StateError` when
        it does not fit this context; llama.cpp leaves the sequence empty then)."""
        if self._live():
            self.ctx.state_seq_set(seq_id, data, llama.STATE_FLAGS_NONE)

    def save_seq_file(self, seq_id: int, path: str, words: "list[int]") -> int:
        """:meth:`save_seq` into a llama.cpp sequence-state file with ``words`` as its token list; its size."""
        return llama.seq_save_file(self.ctx, path, seq_id, words)

    def load_seq_file(self, seq_id: int, path: str) -> "tuple[list[int], int]":
        """Load a :meth:`save_seq_file` file into ``seq_id``: (its token words, bytes read)."""
        return llama.seq_load_file(self.ctx, path, seq_id)

    # -- the level's rules (§9) ----------------------------------------------------------------
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

    # -- context shift (llama-server's --context-shift) ---------------------------------------------
    def can_shift(self) -> bool:
        """Whether this memory can drop a span in the middle of a sequence and move what follows down (a
        trimmable KV cache whose positions can move: llama.cpp's ``memory_can_shift``, and no recurrent or
        hybrid model); True without one."""
        if not self._live():
            return True
        model = self.ctx.model  # a recurrent state cannot lose tokens in the middle (llama.cpp would wipe it)
        if getattr(model, "is_recurrent", False) or getattr(model, "is_hybrid", False):
            return False
        return self.level is Level.PART and self.ctx.memory.can_shift

    def shift(self, seq_id: int, n_keep: int, n_discard: int, n_past: int) -> None:
        """Drop positions ``[n_keep, n_keep + n_discard)`` of the ``n_past`` of ``seq_id`` and move the rest
        down by ``n_discard`` (only where :meth:`can_shift`); raises if the memory refuses."""
        if not self._live():
            return
        memory = self.ctx.memory
        if not memory.seq_rm(seq_id, n_keep, n_keep + n_discard):
            raise MemoryOpError(f"seq_rm(seq={seq_id}, p0={n_keep}, p1={n_keep + n_discard}) was refused by a "
                                f"{self.level.name} memory: the context cannot be shifted")
        memory.seq_add(seq_id, n_keep + n_discard, n_past, -n_discard)

    # -- primitives -------------------------------------------------------------------------------
    def trim(self, seq_id: int, pos: int) -> bool:
        """Drop positions ``>= pos``; raises if the memory refuses. Returns whether anything was removed."""
        return _trim(self.ctx.memory, seq_id, pos, f"a {self.level.name} memory; the rejected draft tokens cannot be "
                     "removed (this is a bug in the rollback strategy, please report it)")

    def release(self, seq_id: int) -> None:
        """Forget a sequence entirely (its request ended)."""
        if not self._live():
            return
        if not self.ctx.memory.seq_rm(seq_id, 0, -1):
            log.warning("seq_rm refused to clear sequence %d of a %s memory", seq_id, self.level.name)

    def _live(self) -> bool:
        return self.ctx is not None and bool(self.ctx.ptr) and self.ctx.memory is not None

    def _save(self, seq_id: int) -> bytes:
        return self.ctx.state_seq_get(seq_id, llama.STATE_FLAGS_PARTIAL_ONLY)

    def _load(self, seq_id: int, data: bytes) -> None:
        if data:
            self.ctx.state_seq_set(seq_id, data, llama.STATE_FLAGS_PARTIAL_ONLY)

    def recover(self, seq_id: int, n_past: int, ckpt: Checkpoint) -> bool:
        """After an error mid-round: make this memory hold exactly the ``n_past`` committed tokens of
        ``seq_id`` (``seq_pos_max == n_past - 1``). False when that is impossible (the slot must be aborted)."""
        if not self._live():
            return True
        memory = self.ctx.memory
        if memory.pos_max(seq_id) >= n_past and not memory.seq_rm(seq_id, n_past, -1):
            data = self._checkpoint_data(ckpt)
            if ckpt.n_tokens == n_past and data:
                try:
                    self._load(seq_id, data)
                except Exception as e:  # noqa: BLE001 - reported below as an unrecoverable slot
                    log.error("sequence %d: reloading the checkpoint failed: %s", seq_id, e)
                    return False
                memory.seq_rm(seq_id, n_past, -1)
        return memory.pos_max(seq_id) == n_past - 1

    def recover_prompt(self, seq_id: int, n_done: int) -> bool:
        """After a failed prompt chunk: back to the ``n_done`` prompt tokens decoded before it (only a
        trimmable memory can drop a chunk). False when that is impossible."""
        if self.ctx is None:
            return True
        memory = self.ctx.memory
        if memory.pos_max(seq_id) >= n_done and (self.level is not Level.PART or not memory.seq_rm(seq_id, n_done, -1)):
            return False
        return memory.pos_max(seq_id) == n_done - 1

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        raise NotImplementedError


class TargetRollback(Rollback):
    """The target context: checkpoints before verification when its level needs them, restore + replay."""

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        return ckpt.data_tgt

    def mark(self, seq_id: int, n_past: int, ckpt: Checkpoint) -> None:
        """Before drafting (§7.2): the checkpoint describes the committed tokens (no state saved yet)."""
        memory = self.ctx.memory
        ckpt.update_pos(n_past, memory.pos_min(seq_id), memory.pos_max(seq_id))

    def checkpoint(self, seq_id: int, ckpt: Checkpoint, n_draft: int) -> bool:
        """After drafting (§7.3): save the state when rolling back a draft of ``n_draft`` tokens needs it.
        True when a state was saved (the caller keeps the sampler with it)."""
        if not n_draft or not self.needs_checkpoint(n_draft):
            return False
        ckpt.data_tgt = self._save(seq_id)
        return True

    def check_replay(self, seq_id: int, ckpt: Checkpoint) -> None:
        """A replay round re-decodes from the checkpoint; on FULL memories there must be one (§7.2)."""
        if self.level is Level.FULL and ckpt.empty:
            raise MemoryOpError(f"sequence {seq_id}: replay round without a target checkpoint")

    def restore(self, seq_id: int, ckpt: Checkpoint) -> None:
        """Partial acceptance that ``seq_rm`` cannot undo (§7.5 step 4): reload the checkpoint and drop what
        follows it (the caller puts the sampler back as it was before verification)."""
        if ckpt.empty:
            raise MemoryOpError(f"sequence {seq_id}: partial acceptance needs a checkpoint, none was taken")
        self._load(seq_id, ckpt.data_tgt)
        self.trim(seq_id, ckpt.pos_max + 1)

    def commit(self, seq_id: int, n_past: int) -> bool:
        """After acceptance (§7.5 step 8): drop the rejected rows. True when there were some."""
        return self.trim(seq_id, n_past)


class DraftRollback(Rollback):
    """The draft model's context. A FULL draft memory is saved before drafting and reloaded after it; where
    llama.cpp aborts (a FULL draft with a trimming target, §7.5), it reloads and says from where the
    committed tokens must be decoded again (the drafter decodes them, in its own ids)."""

    def __init__(self, ctx: "llama.Context | None", level: Level, *, reuse_kv: bool = False):
        super().__init__(ctx, level)
        #: draft-KV reuse: leave what drafting decoded in the draft context (the drafter skips those rows)
        self.reuse_kv = reuse_kv

    def _checkpoint_data(self, ckpt: Checkpoint) -> bytes:
        return ckpt.data_dft

    def before_draft(self, seq_id: int, ckpt: Checkpoint) -> None:
        if self.ctx is not None and self.level is Level.FULL:
            ckpt.data_dft = self._save(seq_id)

    def after_draft(self, seq_id: int, ckpt: Checkpoint) -> None:
        """Drop whatever drafting decoded (§7.3 step 2): the verification batch is mirrored into it."""
        if self.ctx is None:
            return
        if self.level is Level.FULL:
            self._load(seq_id, ckpt.data_dft)
        if not self.reuse_kv:
            self.trim(seq_id, ckpt.pos_max + 1)

    def restore(self, seq_id: int, ckpt: Checkpoint) -> int | None:
        """Back to the checkpoint. Returns None, or the position from which the committed tokens must be
        decoded again into the draft context (see :meth:`commit`)."""
        if self.ctx is None:
            return None
        self._load(seq_id, ckpt.data_dft)
        return self._trim_or_reload(seq_id, ckpt.pos_max + 1, ckpt)

    def commit(self, seq_id: int, n_past: int, ckpt: Checkpoint) -> int | None:
        """Drop the rejected rows. Returns None, or, where a FULL memory refused the trim and was reloaded
        from its checkpoint, the position from which the committed tokens up to ``n_past`` must be decoded
        again: the drafter does that (``Drafter.redecode``, in its own token ids)."""
        if self.ctx is None:
            return None
        return self._trim_or_reload(seq_id, n_past, ckpt)

    def recover(self, seq_id: int, n_past: int, ckpt: Checkpoint) -> bool:
        """:meth:`Rollback.recover`; with draft-KV reuse the draft memory may also stay *behind* ``n_past``:
        rounds that did not draft are not mirrored, the next draft catches up from ``pos_max + 1``."""
        return super().recover(seq_id, n_past, ckpt) or self._behind(seq_id, n_past)

    def recover_prompt(self, seq_id: int, n_done: int) -> bool:
        return super().recover_prompt(seq_id, n_done) or self._behind(seq_id, n_done)

    def _behind(self, seq_id: int, n: int) -> bool:
        return self.reuse_kv and self._live() and self.ctx.memory.pos_max(seq_id) < n

    def _trim_or_reload(self, seq_id: int, pos: int, ckpt: Checkpoint) -> int | None:
        memory = self.ctx.memory
        if memory.seq_rm(seq_id, pos, -1):
            return None
        if self.level is not Level.FULL or not ckpt.data_dft:
            raise MemoryOpError(f"seq_rm on the draft context was refused (sequence {seq_id}, pos {pos})")
        self._load(seq_id, ckpt.data_dft)
        if not memory.seq_rm(seq_id, ckpt.pos_max + 1, -1):
            raise MemoryOpError(f"could not roll back the draft context of sequence {seq_id}")
        return ckpt.n_tokens if ckpt.n_tokens < pos else None
