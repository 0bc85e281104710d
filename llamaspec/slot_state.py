"""Whole slots out of and into an :class:`~llamaspec.engine.Engine`: save, restore and erase a slot's prompt
cache (llama-server's ``POST /slots/{id}?action=save|restore|erase``, ``llamaspec.Llama.save_state``).

What a slot caches is the token list its last request left in memory (``Slot.cached``, see
:mod:`llamaspec.scheduler`) and the target context's state of its sequence. :func:`export_slot` takes both
(:class:`SavedSlot`); :func:`import_slot` puts them into a slot, so that the next request whose prompt shares
a prefix with them decodes only the rest, exactly as if that slot had served the saved one. The draft
context is not saved (llama-server saves the target only, and its files carry nothing else): a restore
clears the slot's draft memory, and the next request that reuses the restored prefix first decodes it into
the draft context again (``Slot.draft_behind``, ``Scheduler._draft_catch_up``); a drafter that cannot do
that from tokens (EAGLE-3, MTP: they need the target's features) makes that request decode its whole prompt.
The drafters' own per-sequence state is reset.

Every operation runs between two engine steps, under the step lock, on an idle slot: a busy one is waited
for (llama-server defers the task until the slot is free), up to ``timeout`` seconds (None: as long as it
takes). :func:`save_slot_file` / :func:`restore_slot_file` write and read llama-server's file format
(:mod:`llamaspec.slot_file`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from .errors import EngineClosedError, LlamaSpecError, UsageError
from .slot_file import SlotFileError, pack_tokens, unpack_tokens

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine
    from .slot import Slot

__all__ = ["SavedSlot", "SlotBusyError", "SlotFileError", "export_slot", "import_slot", "export_slots",
           "import_slots", "erase_slot", "save_slot_file", "restore_slot_file"]

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


def _check_id(engine: "Engine", slot_id: int) -> None:
    if isinstance(slot_id, bool) or not isinstance(slot_id, int) or not 0 <= slot_id < engine.n_parallel:
        raise UsageError(f"Invalid slot ID: {slot_id!r} (this engine has slots 0..{engine.n_parallel - 1})")


@contextlib.contextmanager
def _idle_slot(engine: "Engine", slot_id: int, timeout: float | None) -> Iterator["Slot"]:
    """``slot_id``'s slot, idle, under the engine's step lock (no step runs meanwhile)."""
    _check_id(engine, slot_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    sched = engine.scheduler
    slot = engine.slots[slot_id]
    while True:
        if engine.closed:
            raise EngineClosedError("this Engine is closed")
        with engine._stepper.lock:  # between two steps (the lock a step holds)
            if sched.free(slot) and not engine.closed:
                yield slot
                return
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise SlotBusyError(f"slot {slot_id} is busy")
        engine.wait_until(lambda: sched.free(slot), 1.0 if left is None else min(1.0, left))


def export_slot(engine: "Engine", slot_id: int, *, timeout: float | None = None) -> SavedSlot:
    """The prompt cache of slot ``slot_id`` (empty when it keeps none)."""
    with _idle_slot(engine, slot_id, timeout) as slot:
        tokens = tuple(slot.cached)
        n = engine.rollback_tgt.n_positions(slot.seq_id)
        if n != len(tokens):
            raise LlamaSpecError(f"slot {slot_id}: its memory holds {n} positions, its cache {len(tokens)} tokens")
        return SavedSlot(tokens, engine.rollback_tgt.save_seq(slot.seq_id) if tokens else b"", slot.t_last)


def export_slots(engine: "Engine", *, timeout: float | None = None) -> list[SavedSlot]:
    """Every slot's prompt cache, in slot order."""
    return [export_slot(engine, i, timeout=timeout) for i in range(engine.n_parallel)]


def import_slots(engine: "Engine", saved: "list[SavedSlot] | tuple[SavedSlot, ...]", *,
                 timeout: float | None = None) -> None:
    """:func:`import_slot` for every slot (``saved`` as :func:`export_slots` returns it)."""
    if len(saved) != engine.n_parallel:
        raise UsageError(f"{len(saved)} saved slots for an engine with {engine.n_parallel}")
    for i, s in enumerate(saved):
        import_slot(engine, i, s, timeout=timeout)


def _forget(engine: "Engine", slot: "Slot") -> None:
    engine.scheduler.release(slot)  # both contexts, the cache, its prompt checkpoint
    if engine.chain is not None:
        engine.chain.reset(slot.seq_id)


def _adopt(engine: "Engine", slot: "Slot", tokens: list[int]) -> None:
    """The target memory of ``slot`` was just loaded with ``tokens``: check them against it and make them the
    slot's prompt cache (else :class:`SlotFileError`, and the slot is left empty)."""
    n_vocab = engine.vocab.n_tokens
    if len(tokens) > engine.n_ctx_seq:
        bad = f"Restored prompt does not fit in the slot context ({len(tokens)} > {engine.n_ctx_seq} tokens)"
    elif any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n_vocab for t in tokens):
        bad = "Invalid tokens in slot save file"
    elif engine.rollback_tgt.n_positions(slot.seq_id) != len(tokens):
        bad = (f"the slot state holds {engine.rollback_tgt.n_positions(slot.seq_id)} positions but "
               f"{len(tokens)} tokens")
    else:
        bad = None
    if bad is not None:
        _forget(engine, slot)
        raise SlotFileError(bad)
    slot.cached = tokens
    slot.draft_behind = bool(tokens) and engine.rollback_dft.ctx is not None
    slot.t_last = time.monotonic()
    log.info("slot %d: %d tokens restored", slot.id, len(tokens))


def _load_failed(engine: "Engine", slot: "Slot", e: Exception) -> SlotFileError:
    _forget(engine, slot)
    return SlotFileError(f"No available space in KV cache or invalid slot save file ({e})")


def import_slot(engine: "Engine", slot_id: int, saved: SavedSlot, *, timeout: float | None = None) -> None:
    """Make ``saved`` the prompt cache of slot ``slot_id`` (what it cached before is dropped). On any error
    :class:`SlotFileError` and the slot is left empty (usable)."""
    with _idle_slot(engine, slot_id, timeout) as slot:
        _forget(engine, slot)
        if saved.tokens:
            try:
                engine.rollback_tgt.load_seq(slot.seq_id, saved.state)
            except LlamaSpecError as e:
                raise _load_failed(engine, slot, e) from e
        _adopt(engine, slot, list(saved.tokens))
        if saved.t_last:
            slot.t_last = saved.t_last


def erase_slot(engine: "Engine", slot_id: int, *, timeout: float | None = None) -> int:
    """Drop the prompt cache of slot ``slot_id``; returns how many tokens it held."""
    with _idle_slot(engine, slot_id, timeout) as slot:
        n = len(slot.cached)
        _forget(engine, slot)
        return n


def save_slot_file(engine: "Engine", slot_id: int, path: "str | os.PathLike[str]", *,
                   timeout: float | None = None) -> tuple[int, int]:
    """Write slot ``slot_id``'s prompt cache to ``path`` in llama-server's format (atomically: a temporary file
    renamed into place): ``(tokens, bytes written)``."""
    path = os.fspath(path)
    with _idle_slot(engine, slot_id, timeout) as slot:
        tokens = list(slot.cached)
        n = engine.rollback_tgt.n_positions(slot.seq_id)
        if n != len(tokens):
            raise LlamaSpecError(f"slot {slot_id}: its memory holds {n} positions, its cache {len(tokens)} tokens")
        # a short temporary name: the file's own may be as long as a name can be (255 bytes)
        fd, tmp = tempfile.mkstemp(prefix=".slot-", suffix=".tmp", dir=os.path.dirname(path) or ".")
        os.close(fd)
        try:
            n_bytes = engine.rollback_tgt.save_seq_file(slot.seq_id, tmp, pack_tokens(tokens))
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return len(tokens), n_bytes


def restore_slot_file(engine: "Engine", slot_id: int, path: "str | os.PathLike[str]", *,
                      timeout: float | None = None) -> tuple[int, int]:
    """Load a slot file (llama-server's or ours) into slot ``slot_id``: ``(tokens, bytes read)``. A file that
    cannot be restored raises :class:`SlotFileError` and leaves the slot empty (as llama-server)."""
    path = os.fspath(path)
    with _idle_slot(engine, slot_id, timeout) as slot:
        _forget(engine, slot)
        if not os.path.isfile(path):
            raise SlotFileError(f"no slot file {os.path.basename(path)}")
        try:
            words, n_bytes = engine.rollback_tgt.load_seq_file(slot.seq_id, path)
        except LlamaSpecError as e:
            raise _load_failed(engine, slot, e) from e
        try:
            tokens = unpack_tokens(words)
        except SlotFileError:
            _forget(engine, slot)
            raise
        _adopt(engine, slot, tokens)
    return len(tokens), n_bytes
