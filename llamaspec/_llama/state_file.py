"""Sequence-state files: llama.cpp's ``llama_state_seq_save_file`` / ``llama_state_seq_load_file``, the files
llama-server's ``POST /slots/{id}?action=save|restore`` writes and reads (three 32-bit words: magic ``ggsq``,
version, the number of token words; the token words; then the sequence state, streamed by llama.cpp).

A file is read here, not by ``llama_state_seq_load_file``: llama.cpp reads a state cut short past the end of
the file and then aborts the process (``GGML_ASSERT(nread <= state_size)``), so the header and the token list
are checked in Python and the state is handed over as a buffer (``llama_state_seq_set_data``, which refuses a
short one), all of it or the file is refused. Messages name the file, never its directory.

Only the rollback module (:mod:`llamaspec.memory`) calls these, as every other memory operation.
"""
from __future__ import annotations

import ctypes
import os
import struct
from typing import TYPE_CHECKING, Sequence

from llama_cpp import llama_cpp as native

from ..errors import StateError

if TYPE_CHECKING:  # pragma: no cover
    from .context import Context

__all__ = ["seq_save_file", "seq_load_file"]


def seq_save_file(ctx: "Context", path: "str | os.PathLike[str]", seq_id: int, words: Sequence[int]) -> int:
    """Write ``words`` (the token list, as the caller packs it) and the whole state of ``seq_id`` to ``path``;
    returns the file's size. :class:`StateError` when llama.cpp could not write it."""
    arr = (native.llama_token * max(1, len(words)))(*words)
    n = int(ctx._native(native.llama_state_seq_save_file, ctx.live_ptr(), os.fsencode(path), seq_id, arr,
                        len(words), what="a state save"))
    if n == 0:
        raise StateError(f"llama.cpp could not write the state of sequence {seq_id} to {os.path.basename(path)}")
    return n


def seq_load_file(ctx: "Context", path: "str | os.PathLike[str]", seq_id: int) -> tuple[list[int], int]:
    """Load a :func:`seq_save_file` file into ``seq_id``: ``(its token words, bytes read)``. :class:`StateError`
    when it is not such a file, is cut short or too long, or its state does not fit this context (llama.cpp
    leaves the sequence empty)."""
    name = os.path.basename(os.fspath(path))
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(12)
        if len(head) < 12:
            raise StateError(f"{name} is not a sequence state file (its {len(head)} bytes hold no header)")
        magic, version, n_words = struct.unpack("=III", head)
        if magic != native.LLAMA_STATE_SEQ_MAGIC or version != native.LLAMA_STATE_SEQ_VERSION:
            raise StateError(f"{name} is not a sequence state file of this llama.cpp (magic {magic:#010x}, "
                             f"version {version})")
        n_state = size - 12 - 4 * n_words
        if n_state <= 0:
            raise StateError(f"{name} is cut short: its header counts {n_words} token words, its {size} bytes "
                             "hold fewer, or no state after them")
        raw = f.read(4 * n_words)
        words = list(struct.unpack(f"={n_words}i", raw)) if len(raw) == 4 * n_words else None
        # the in-memory form llama_state_seq_set_data reads: llama.cpp's 8-byte prefix (a magic word and a
        # sequence id, as llama_state_seq_get_data writes them), then the file's state
        prefix = ctx.state_seq_get(seq_id)[:8]
        buf = (ctypes.c_uint8 * (len(prefix) + n_state))()
        ctypes.memmove(buf, prefix, len(prefix))
        got = f.readinto(memoryview(buf).cast("B")[len(prefix):]) if words is not None else 0
    if words is None or got != n_state:
        raise StateError(f"{name} changed while it was read")
    n = int(ctx._native(native.llama_state_seq_set_data_ext, ctx.live_ptr(), buf, len(buf), seq_id, 0,
                        what="a state load"))
    if n == 0:
        raise StateError(f"the state in {name} is cut short or does not fit this context (another model or "
                         "settings?)")
    if n != len(buf):
        raise StateError(f"{name} has {len(buf) - n} bytes after its state: not a file llama.cpp wrote")
    return words, size
