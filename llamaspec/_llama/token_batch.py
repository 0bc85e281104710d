"""A token-only batch filled from numpy in a few calls: the decode path of the hot loop.

``llama_batch_ext`` takes a row in three calls across the ctypes boundary (add, position, output flag), which
on a small model costs more than the decode itself. A batch of plain token rows (no embeddings, one sequence
each) goes instead through the classic ``llama_batch`` + ``llama_decode``, which the vendored llama.cpp turns
into the same ``llama_batch_ext`` in C++ (``llama_batch_compat``): same rows, same outputs, same batch
indices for ``llama_get_logits_ith``. The arrays are allocated once per context and written with numpy slice
assignments; the struct points at them (it is never passed to ``llama_batch_free``).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
from llama_cpp import llama_cpp as native

__all__ = ["TokenBatch"]

#: up to this many rows the arrays are written item by item (numpy's slice assignment costs ~0.5 us each)
_FEW = 4


class TokenBatch:
    """Preallocated arrays for up to ``n_max`` token rows and the ``llama_batch`` that points at them."""

    def __init__(self, n_max: int):
        self.n_max = n_max
        self.token = np.zeros(n_max, dtype=np.int32)
        self.pos = np.zeros(n_max, dtype=np.int32)
        self.n_seq_id = np.ones(n_max, dtype=np.int32)
        self.seq = np.zeros(n_max, dtype=np.int32)
        self.logits = np.zeros(n_max, dtype=np.int8)
        #: the same arrays as memoryviews: a few rows are written faster item by item than by numpy
        self._mv = tuple(memoryview(a) for a in (self.token, self.pos, self.seq, self.logits))
        i32p = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self._seq_ptrs = (i32p * n_max)(*[ctypes.cast(base + 4 * i, i32p) for i in range(n_max)])
        b = native.llama_batch()
        b.n_tokens = 0
        b.token = self.token.ctypes.data_as(ctypes.POINTER(native.llama_token))
        b.embd = None
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(native.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(i32p)
        b.seq_id = ctypes.cast(self._seq_ptrs, ctypes.POINTER(ctypes.POINTER(native.llama_seq_id)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.batch = b

    def fill(self, rows: Sequence, n_vocab: int, n_seq_max: int) -> tuple[int, int]:
        """Write ``rows`` (``.token``, ``.pos``, ``.seq_id``, ``.output``); returns ``(code, i)``: the first row
        ``i`` whose token is outside the vocabulary (code -2) or whose sequence is outside ``0..n_seq_max - 1``
        (code -3) (llama_batch_ext_add's codes), or ``(0, -1)``."""
        self.logits[:len(rows)] = [r.output for r in rows]
        return self._write([r.token for r in rows], [r.pos for r in rows], [r.seq_id for r in rows], n_vocab,
                           n_seq_max)

    def fill_outputs(self, tokens: list[int], pos: list[int], seq: list[int], n_vocab: int,
                     n_seq_max: int) -> tuple[int, int]:
        """:meth:`fill` from columns, every row an output (a generation round without drafts)."""
        self.logits[:len(tokens)] = 1
        return self._write(tokens, pos, seq, n_vocab, n_seq_max)

    def _write(self, tok: list[int], pos: list[int], seq: list[int], n_vocab: int, n_seq_max: int) -> tuple[int, int]:
        n = len(tok)
        if n <= _FEW:
            m_tok, m_pos, m_seq, _ = self._mv
            for i in range(n):
                m_tok[i], m_pos[i], m_seq[i] = tok[i], pos[i], seq[i]
        else:
            self.token[:n] = tok
            self.pos[:n] = pos
            self.seq[:n] = seq
        self.batch.n_tokens = n
        # checked on the lists: for the few rows of a generation round far cheaper than numpy's comparisons
        if min(tok) < 0 or max(tok) >= n_vocab:
            return -2, next(i for i, t in enumerate(tok) if not 0 <= t < n_vocab)
        if min(seq) < 0 or max(seq) >= n_seq_max:
            return -3, next(i for i, q in enumerate(seq) if not 0 <= q < n_seq_max)
        return 0, -1

    def decode(self, ctx_ptr: int) -> int:
        return native.llama_decode(ctx_ptr, self.batch)

    @staticmethod
    def takes(rows: Sequence) -> bool:
        """Whether these rows are plain token rows (no embedding row, no embedding input)."""
        return all(r.token is not None and r.embd is None for r in rows)
