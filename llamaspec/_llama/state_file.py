"""Sequence-state files: llama.cpp's ``llama_state_seq_save_file`` / ``llama_state_seq_load_file``, the files
llama-server's ``POST /slots/{id}?action=save|restore`` writes and reads (three 32-bit words: magic ``ggsq``,
version, the number of token words; the token words; then the sequence state, streamed by llama.cpp).

Only the rollback module (:mod:`llamaspec.memory`) calls these, as every other memory operation.
"""
from __future__ import annotations

import ctypes
import os
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
        raise StateError(f"llama.cpp could not write the state of sequence {seq_id} to {os.fspath(path)}")
    return n


def seq_load_file(ctx: "Context", path: "str | os.PathLike[str]", seq_id: int) -> tuple[list[int], int]:
    """Load a :func:`seq_save_file` file into ``seq_id``: ``(its token words, bytes read)``. :class:`StateError`
    when it is not such a file or its state does not fit this context (llama.cpp leaves the sequence empty)."""
    p = os.fsencode(path)
    count = ctypes.c_size_t(0)
    ptr = ctx.live_ptr()
    # first only the header: how many token words there are (nothing is loaded)
    if not native.llama_state_seq_load_file(ptr, p, seq_id, None, 0, ctypes.byref(count)):
        raise StateError(f"{os.fspath(path)} is not a sequence state file of this llama.cpp")
    arr = (native.llama_token * max(1, count.value))()
    n = int(ctx._native(native.llama_state_seq_load_file, ptr, p, seq_id, arr, len(arr), ctypes.byref(count),
                        what="a state load"))
    if n == 0:
        raise StateError(f"the state in {os.fspath(path)} does not fit this context (another model or settings?)")
    return list(arr[:count.value]), n
