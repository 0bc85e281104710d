"""Rollback by memory level (spec §6, §7.3, §7.5, §9): checkpoints and one strategy object per level.

The level of each context is probed once at start-up (:func:`llamaspec.probe.can_seq_rm`); the engine then
holds a :class:`Rollback` for the target and asks it two questions per round:

* before verification: does this draft need a target checkpoint? (:meth:`Rollback.needs_checkpoint`)
* after verification with ``n_rollback`` rejected rows: can ``seq_rm`` trim them, or must the checkpoint be
  restored and the accepted tokens replayed? (:meth:`Rollback.needs_restore`)

Every ``seq_rm`` result is checked: a false return where the level promises success raises
:class:`MemoryOpError` instead of silently keeping rejected tokens (design.md, "never ignore a bool").
"""
from __future__ import annotations

from dataclasses import dataclass

from . import _llama as L
from .errors import MemoryOpError
from .probe import Level


@dataclass
class Checkpoint:
    """Speculative checkpoint of one slot (llama.cpp's ``common_prompt_checkpoint`` used as ``spec_ckpt``)."""

    n_tokens: int = 0
    pos_min: int = -1
    pos_max: int = -1
    data_tgt: bytes = b""
    data_dft: bytes = b""

    def update_pos(self, n_tokens: int, pos_min: int, pos_max: int) -> None:
        self.n_tokens, self.pos_min, self.pos_max = n_tokens, pos_min, pos_max
        self.data_tgt = b""
        self.data_dft = b""

    @property
    def empty(self) -> bool:
        return not self.data_tgt

    def update_tgt(self, ctx: L.Context, seq_id: int) -> None:
        self.data_tgt = ctx.state_seq_get(seq_id, L.STATE_FLAGS_PARTIAL_ONLY)

    def update_dft(self, ctx: L.Context, seq_id: int) -> None:
        self.data_dft = ctx.state_seq_get(seq_id, L.STATE_FLAGS_PARTIAL_ONLY)

    def load_tgt(self, ctx: L.Context, seq_id: int) -> None:
        if self.data_tgt:
            ctx.state_seq_set(seq_id, self.data_tgt, L.STATE_FLAGS_PARTIAL_ONLY)

    def load_dft(self, ctx: L.Context, seq_id: int) -> None:
        if self.data_dft:
            ctx.state_seq_set(seq_id, self.data_dft, L.STATE_FLAGS_PARTIAL_ONLY)


class Rollback:
    """What a context of a given level does around verification. Subclasses per level."""

    level: Level = Level.NO

    def __init__(self, ctx: L.Context):
        self.ctx = ctx
        self.n_rs_seq = ctx.n_rs_seq
        # counters, for tests and statistics
        self.n_trims = 0
        self.n_checkpoints = 0
        self.n_restores = 0

    def needs_checkpoint(self, n_draft: int) -> bool:
        return False

    def needs_restore(self, n_rollback: int) -> bool:
        return False

    def trim(self, seq_id: int, pos: int) -> bool:
        """Drop positions ``>= pos`` (rejected draft rows); raises if the memory refuses.

        Returns whether anything was removed."""
        had = self.ctx.memory.pos_max(seq_id) >= pos
        if not self.ctx.memory.seq_rm(seq_id, pos, -1):
            raise MemoryOpError(
                f"seq_rm(seq={seq_id}, p0={pos}) was refused by a {self.level.name} memory; the rejected draft "
                "tokens cannot be removed (this is a bug in the rollback strategy, please report it)"
            )
        if had:
            self.n_trims += 1
        return had


class PartRollback(Rollback):
    """KV caches: trim rejected positions with ``seq_rm``."""

    level = Level.PART


class RsRollback(Rollback):
    """Recurrent state with ``n_rs_seq`` snapshots: bounded trim up to ``n_rs_seq``, checkpoint beyond."""

    level = Level.RS

    def needs_checkpoint(self, n_draft: int) -> bool:
        return n_draft > self.n_rs_seq

    def needs_restore(self, n_rollback: int) -> bool:
        return n_rollback > self.n_rs_seq


class FullRollback(Rollback):
    """Recurrent / hybrid without snapshots: checkpoint before every verification, restore + replay."""

    level = Level.FULL

    def needs_checkpoint(self, n_draft: int) -> bool:
        return True

    def needs_restore(self, n_rollback: int) -> bool:
        return True


class NoRollback(Rollback):
    """No memory: speculation is off."""

    level = Level.NO


def rollback_for(level: Level, ctx: L.Context) -> Rollback:
    return {Level.PART: PartRollback, Level.RS: RsRollback, Level.FULL: FullRollback, Level.NO: NoRollback}[level](ctx)
