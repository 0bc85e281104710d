"""Whole slots out of and into an :class:`~llamaspec.engine.Engine`: save, restore and erase a slot's prompt
cache (llama-server's ``POST /slots/{id}?action=save|restore|erase``, ``llamaspec.Llama.save_state``).

What a slot caches is the token list its last request left in memory (``Slot.cached``, see
:mod:`llamaspec.scheduler`) and the target context's state of its sequence. The Engine's
:class:`SlotStore` (``Engine.slot_store``) saves both (:meth:`SlotStore.save`, a :class:`SavedSlot`) and
restores them into a slot (:meth:`SlotStore.restore`), so that the next request whose prompt shares
a prefix with them decodes only the rest, exactly as if that slot had served the saved one. The draft
context is not saved (llama-server saves the target only, and its files carry nothing else): a restore
clears the slot's draft memory, and the next request that reuses the restored prefix first decodes it into
the draft context again (``Slot.draft_behind``, ``Scheduler._draft_catch_up``); a drafter that cannot do
that from tokens (EAGLE-3, MTP: they need the target's features) makes that request decode its whole prompt.
The drafters' own per-sequence state is reset.

Every operation runs between two engine steps, under the step lock, on an idle slot: a busy one is waited
for (llama-server defers the task until the slot is free), up to ``timeout`` seconds (None: as long as it
takes). :meth:`SlotStore.save_file` / :meth:`SlotStore.restore_file` write and read llama-server's file
format (:mod:`llamaspec.slot_file`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .errors import EngineClosedError, LlamaSpecError, UsageError
from .slot_file import SlotFileError, pack_tokens, unpack_tokens

if TYPE_CHECKING:  # pragma: no cover
    from .memory import TargetRollback
    from .scheduler import Scheduler
    from .slot import Slot
    from .stepper import Stepper

__all__ = ["SavedSlot", "SlotBusyError", "SlotFileError", "SlotStore"]

log = logging.getLogger("llamaspec")


@dataclass(frozen=True)
class SavedSlot:
    """A slot's prompt cache: its ``tokens`` and the target's state of them (every cache of the sequence)."""

    tokens: tuple[int, ...]
    state: bytes
    #: when the slot was last used (``time.monotonic()``): which cache a new request may evict first
    t_last: float = 0.0


class SlotBusyError(LlamaSpecError):
    """The slot still served a request when the timeout passed."""


class SlotStore:
    """Save, restore and erase the prompt caches of an Engine's slots (module docstring), between two steps:
    composed by the Engine over its scheduler (which slot is free; ``forget``), the target's rollback (the
    sequence states) and its stepper (the step lock). ``n_vocab`` / ``n_ctx_seq`` check restored tokens;
    ``has_draft``: a restored slot's draft memory must catch up; ``closed()``: the engine is closed."""

    def __init__(self, scheduler: "Scheduler", rollback_tgt: "TargetRollback", stepper: "Stepper", *, n_vocab: int,
                 n_ctx_seq: int, has_draft: bool, closed: Callable[[], bool]):
        self.scheduler, self.rollback_tgt, self.stepper = scheduler, rollback_tgt, stepper
        self.n_vocab, self.n_ctx_seq, self.has_draft, self.closed = n_vocab, n_ctx_seq, has_draft, closed

    @property
    def n_slots(self) -> int:
        return len(self.scheduler.slots)

    @contextlib.contextmanager
    def _idle(self, slot_id: int, timeout: float | None) -> Iterator["Slot"]:
        """``slot_id``'s slot, idle, under the step lock (no step runs meanwhile)."""
        if isinstance(slot_id, bool) or not isinstance(slot_id, int) or not 0 <= slot_id < self.n_slots:
            raise UsageError(f"Invalid slot ID: {slot_id!r} (this engine has slots 0..{self.n_slots - 1})")
        deadline = None if timeout is None else time.monotonic() + timeout
        free, slot = self.scheduler.free, self.scheduler.slots[slot_id]
        while True:
            if self.closed():
                raise EngineClosedError("this Engine is closed")
            with self.stepper.lock:  # between two steps (the lock a step holds)
                if free(slot) and not self.closed():
                    yield slot
                    return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise SlotBusyError(f"slot {slot_id} is busy")
            self.stepper.wait(lambda: free(slot), 1.0 if left is None else min(1.0, left))

    def _cached(self, slot: "Slot") -> list[int]:
        """The slot's prompt cache, checked against its memory."""
        tokens, n = list(slot.cached), self.rollback_tgt.n_positions(slot.seq_id)
        if n != len(tokens):
            raise LlamaSpecError(f"slot {slot.id}: its memory holds {n} positions, its cache {len(tokens)} tokens")
        return tokens

    def save(self, slot_id: int, *, timeout: float | None = None) -> SavedSlot:
        """The prompt cache of slot ``slot_id`` (empty when it keeps none)."""
        with self._idle(slot_id, timeout) as slot:
            tokens = self._cached(slot)
            return SavedSlot(tuple(tokens), self.rollback_tgt.save_seq(slot.seq_id) if tokens else b"", slot.t_last)

    def save_all(self, *, timeout: float | None = None) -> list[SavedSlot]:
        """Every slot's prompt cache, in slot order."""
        return [self.save(i, timeout=timeout) for i in range(self.n_slots)]

    def restore_all(self, saved: Sequence[SavedSlot], *, timeout: float | None = None) -> None:
        """:meth:`restore` for every slot (``saved`` as :meth:`save_all` returns it)."""
        if len(saved) != self.n_slots:
            raise UsageError(f"{len(saved)} saved slots for an engine with {self.n_slots}")
        for i, s in enumerate(saved):
            self.restore(i, s, timeout=timeout)

    def restore(self, slot_id: int, saved: SavedSlot, *, timeout: float | None = None) -> None:
        """Make ``saved`` the prompt cache of slot ``slot_id`` (what it cached before is dropped). On any error
        :class:`SlotFileError` and the slot is left empty (usable)."""
        with self._load(slot_id, timeout) as slot:
            if saved.tokens:
                self.rollback_tgt.load_seq(slot.seq_id, saved.state)
            self._adopt(slot, list(saved.tokens))
            if saved.t_last:
                slot.t_last = saved.t_last

    def erase(self, slot_id: int, *, timeout: float | None = None) -> int:
        """Drop the prompt cache of slot ``slot_id``; returns how many tokens it held."""
        with self._idle(slot_id, timeout) as slot:
            n = len(slot.cached)
            self.scheduler.forget(slot)
            return n

    def save_file(self, slot_id: int, path: "str | os.PathLike[str]", *,
                  timeout: float | None = None) -> tuple[int, int]:
        """Write slot ``slot_id``'s prompt cache to ``path`` in llama-server's format (atomically: a temporary
        file renamed into place): ``(tokens, bytes written)``."""
        path = os.fspath(path)
        with self._idle(slot_id, timeout) as slot:
            tokens = self._cached(slot)
            # a short temporary name: the file's own may be as long as a name can be (255 bytes)
            fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".tmp", dir=os.path.dirname(path) or ".")
            os.close(fd)
            try:
                n_bytes = self.rollback_tgt.save_seq_file(slot.seq_id, tmp, pack_tokens(tokens))
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        return len(tokens), n_bytes

    def restore_file(self, slot_id: int, path: "str | os.PathLike[str]", *,
                     timeout: float | None = None) -> tuple[int, int]:
        """Load a slot file (llama-server's or ours) into slot ``slot_id``: ``(tokens, bytes read)``. A file
        that cannot be restored raises :class:`SlotFileError` and leaves the slot empty (as llama-server)."""
        path = os.fspath(path)
        with self._load(slot_id, timeout) as slot:
            if not os.path.isfile(path):
                raise SlotFileError(f"no slot file {os.path.basename(path)}")
            words, n_bytes = self.rollback_tgt.load_seq_file(slot.seq_id, path)
            tokens = unpack_tokens(words)
            self._adopt(slot, tokens)
        return len(tokens), n_bytes

    @contextlib.contextmanager
    def _load(self, slot_id: int, timeout: float | None) -> Iterator["Slot"]:
        """``slot_id``'s slot, idle and emptied, for the block to load a state into; a block that fails
        leaves it empty again and raises :class:`SlotFileError`."""
        with self._idle(slot_id, timeout) as slot:
            self.scheduler.forget(slot)  # both contexts, the cache, its prompt checkpoint, the drafters
            try:
                yield slot
            except LlamaSpecError as e:
                self.scheduler.forget(slot)
                if isinstance(e, SlotFileError):
                    raise
                raise SlotFileError(f"No available space in KV cache or invalid slot save file ({e})") from e

    def _adopt(self, slot: "Slot", tokens: list[int]) -> None:
        """The target memory of ``slot`` was just loaded with ``tokens``: check them against it and make them
        the slot's prompt cache (else :class:`SlotFileError`)."""
        n = self.rollback_tgt.n_positions(slot.seq_id)
        if len(tokens) > self.n_ctx_seq:
            raise SlotFileError(f"Restored prompt does not fit in the slot context ({len(tokens)} > {self.n_ctx_seq} "
                                "tokens)")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.n_vocab for t in tokens):
            raise SlotFileError("Invalid tokens in slot save file")
        if n != len(tokens):
            raise SlotFileError(f"the slot state holds {n} positions but {len(tokens)} tokens")
        slot.cached = tokens
        slot.draft_behind = bool(tokens) and self.has_draft
        slot.t_last = time.monotonic()
        log.info("slot %d: %d tokens restored", slot.id, len(tokens))
