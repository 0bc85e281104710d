"""A context's memory (KV cache / recurrent state): the sequence operations of :class:`Memory`
(``Context.memory``)."""
from __future__ import annotations

import weakref
from llama_cpp import llama_cpp as native

from ..errors import LlamaSpecError
from . import rpc

__all__ = ["Memory"]


class Memory:
    """Sequence operations on a context's memory (KV cache / recurrent state).

    Holds its context weakly (``Context.memory`` is the strong edge); raises :class:`LlamaSpecError` once
    the context is closed or gone.
    """

    def __init__(self, ctx):  # (a Context: not imported here, which imports this module)
        self._ctx_ref = weakref.ref(ctx)

    @property
    def ptr(self):
        """The native ``llama_memory_t``; :class:`LlamaSpecError` when the context is closed."""
        ctx = self._ctx_ref()
        if ctx is None or not ctx.ptr:
            raise LlamaSpecError("context is closed: its memory can no longer be used")
        return ctx._mem

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq_id``; returns llama.cpp's bool (never ignore it)."""
        return bool(native.llama_memory_seq_rm(self.ptr, seq_id, p0, p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Move positions ``[p0, p1)`` of ``seq_id`` by ``delta`` (a context shift; only where
        :attr:`can_shift`)."""
        native.llama_memory_seq_add(self.ptr, seq_id, p0, p1, delta)

    @property
    def can_shift(self) -> bool:
        """Whether positions can be moved (:meth:`seq_add`): a KV cache with RoPE, not a recurrent state."""
        return bool(native.llama_memory_can_shift(self.ptr))

    def pos_min(self, seq_id: int) -> int:
        return int(native.llama_memory_seq_pos_min(self.ptr, seq_id))

    def pos_max(self, seq_id: int) -> int:
        return int(native.llama_memory_seq_pos_max(self.ptr, seq_id))

    def clear(self, data: bool = True) -> None:
        ctx = self._ctx_ref()
        if data and ctx is not None and ctx._rpc:  # clearing the data clears buffers on the servers
            rpc.call(native.llama_memory_clear, self.ptr, data, what="a memory clear", timeout=rpc.DECODE_TIMEOUT_S)
        else:
            native.llama_memory_clear(self.ptr, data)
