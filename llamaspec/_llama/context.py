"""Contexts: batch decode with the output-row guard, logits, sequence state and memory operations.

Why the checks matter (§5.2): a decode whose output rows exceed the context's ``n_outputs_max``
makes llama.cpp call ``GGML_ASSERT`` and abort the whole Python process. :meth:`Context.decode` counts
output rows first and raises :class:`OutputLimitError` instead. Every call on a closed context raises
:class:`LlamaSpecError` instead of handing a NULL pointer to C.
"""
from __future__ import annotations

import collections
import ctypes
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence, TypeVar

import numpy as np
from llama_cpp import llama_cpp as native

from ..errors import ContextError, DecodeError, LlamaSpecError, OutputLimitError, StateError, UsageError
from . import rpc
from .kv_memory import Memory
from .log import _forget_native_errors, _last_native_error, backend_init
from .model import Model, _Owned
from .threads import ThreadTuner, free_cores
from .token_batch import TokenBatch

PROCESS_ENCODE = native.LLAMA_PROCESS_TYPE_ENCODE
PROCESS_DECODE = native.LLAMA_PROCESS_TYPE_DECODE
STATE_FLAGS_NONE = native.LLAMA_STATE_SEQ_FLAGS_NONE
STATE_FLAGS_PARTIAL_ONLY = native.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
CONTEXT_TYPE_DEFAULT = getattr(native, "LLAMA_CONTEXT_TYPE_DEFAULT", 0)
CONTEXT_TYPE_MTP = getattr(native, "LLAMA_CONTEXT_TYPE_MTP", 1)

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1

_SeqT = TypeVar("_SeqT", bound=Sequence)


def chunks(seq: _SeqT, size: int) -> Iterator[_SeqT]:
    """Consecutive slices of ``seq`` of ``size`` items (the last one may be shorter).

    >>> list(chunks([1, 2, 3, 4, 5], 2))
    [[1, 2], [3, 4], [5]]
    >>> list(chunks([], 3))
    []
    >>> chunks([1], 0)
    Traceback (most recent call last):
    ValueError: chunk size must be >= 1, got 0
    """
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    return (seq[i : i + size] for i in range(0, len(seq), size))


def _process_sync(ptr, kind, batch) -> int:
    rc = native.llama_process(ptr, kind, batch)
    if rc == 0:
        native.llama_synchronize(ptr)
    return rc


@dataclass
class Row:
    """One batch row: token (or None for an embedding-only row), position, sequence, output flag.

    ``embd`` optionally carries an input embedding for the row (MTP / EAGLE-3 style drafters).
    """

    token: int | None
    pos: int
    seq_id: int
    output: bool = False
    embd: np.ndarray | None = None


@dataclass
class ContextParams:
    n_ctx: int = 4096
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    n_rs_seq: int = 0
    n_outputs_max: int = 0  # 0 = n_batch (llama.cpp semantics)
    n_outputs_max_per_seq: int = 0  # 0 = n_outputs_max
    n_threads: int | None = None
    n_threads_batch: int | None = None
    ctx_type: int = CONTEXT_TYPE_DEFAULT
    flash_attn: bool | None = None  # None = auto
    kv_f32: bool = False  # F32 KV cache (exactness tests); default F16
    swa_full: bool = False
    kv_unified: bool | None = None
    embeddings: bool = False
    no_perf: bool = True
    extra: dict = field(default_factory=dict)


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover
        return max(1, os.cpu_count() or 1)


class Context(_Owned):
    """A llama.cpp context with decode through ``llama_batch_ext`` + ``llama_process``.

    ``decode(rows)`` validates the batch (capacity, output-row limit of §5.2, sequence ids) before
    handing it to llama.cpp, so that no call can hit a native abort.
    """

    def __init__(self, model: Model, params: ContextParams | None = None, *, ctx_other: "Context | None" = None, **kw):
        self.ptr = None
        self._rpc = False
        backend_init()
        p = params or ContextParams()
        for k, v in kw.items():
            if not hasattr(p, k):
                raise UsageError(f"unknown context parameter {k!r}")
            setattr(p, k, v)
        if p.n_ctx < 1 or p.n_batch < 1 or p.n_seq_max < 1:
            raise UsageError(f"invalid context size: n_ctx={p.n_ctx}, n_batch={p.n_batch}, n_seq_max={p.n_seq_max}")
        self.model = model  # the one strong edge between the wrappers: a context keeps its model alive
        self.params = p
        cp = native.llama_context_default_params()
        for k in ("n_ctx", "n_batch", "n_seq_max", "n_rs_seq", "n_outputs_max", "n_outputs_max_per_seq", "ctx_type",
                  "swa_full", "embeddings", "no_perf"):
            setattr(cp, k, getattr(p, k))
        cp.n_ubatch = min(p.n_ubatch, p.n_batch)
        nt = p.n_threads or default_threads()
        cp.n_threads = nt
        cp.n_threads_batch = p.n_threads_batch or nt
        if p.flash_attn is not None:
            cp.flash_attn_type = 1 if p.flash_attn else 0
        if p.kv_f32:
            cp.type_k = cp.type_v = GGML_TYPE_F32
        if p.kv_unified is not None:
            cp.kv_unified = p.kv_unified
        for k, v in p.extra.items():
            setattr(cp, k, v)
        if ctx_other is not None:
            cp.ctx_other = ctx_other.live_ptr()
        self._ctx_other = ctx_other
        # effective output limits, computed exactly as llama-context.cpp does (§5.2); n_seq_max rows are reserved
        # on every decode: a context whose n_outputs_max is below that aborts inside llama_init_from_model
        # already, so refuse it here
        self.n_outputs_max = p.n_batch if (p.n_outputs_max == 0 or model.has_encoder) else p.n_outputs_max
        if p.n_seq_max > self.n_outputs_max:
            raise ContextError(
                f"n_seq_max={p.n_seq_max} exceeds n_outputs_max={self.n_outputs_max}: llama.cpp would abort "
                "(docs/architecture.md §5.2); raise n_outputs_max (see output_limits())"
            )
        model_ptr = model.live_ptr()
        #: the model is on RPC servers: native calls that reach them run guarded (see _llama.rpc)
        self._rpc = bool(getattr(model, "rpc_servers", ()))
        model._acquire()  # the native model must outlive this context (see _llama.model)
        _forget_native_errors()
        try:
            ptr = (rpc.call(native.llama_init_from_model, model_ptr, cp, what=f"creating a context on {model.path.name}")
                   if self._rpc else native.llama_init_from_model(model_ptr, cp))
        except BaseException:
            model._release()
            raise
        if not ptr:
            model._release()
            why = _last_native_error("llama.cpp returned no context")
            raise ContextError(f"could not create a context for {model.path.name} (n_ctx={p.n_ctx}, n_batch={p.n_batch}, n_seq_max={p.n_seq_max}): {why}")
        self.ptr = ptr
        self._holds_model = True
        for k in ("n_ctx", "n_ctx_seq", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq"):  # what llama.cpp made of them
            setattr(self, k, int(getattr(native, f"llama_{k}")(ptr)))
        self.n_vocab: int = model.vocab.n_tokens
        self._row_t = ctypes.c_float * self.n_vocab  # one row of logits (``logits``)
        if p.n_outputs_max == 0 or model.has_encoder:
            self.n_outputs_max = self.n_batch
        self.n_outputs_max_per_seq = (
            self.n_outputs_max if p.n_outputs_max_per_seq == 0 else min(p.n_outputs_max_per_seq, self.n_outputs_max)
        )
        self._batch = native.llama_batch_ext_init(ptr)
        if not self._batch:
            self.close()
            raise ContextError("llama_batch_ext_init failed")
        self._pos = (native.llama_pos * 4)()
        self._tokens = TokenBatch(self.n_batch)
        self._mem = native.llama_get_memory(ptr)
        self.memory = Memory(self) if self._mem else None
        self.n_decodes = 0
        #: the thread count of each decode, measured (tune_threads; None: the configured one, always)
        self.threads: ThreadTuner | None = None
        #: samplers run inside the decode (``extra["samplers"]``): a row may have a sampled token, not logits
        self.has_backend_samplers = bool(p.extra.get("samplers"))

    # -- decode ---------------------------------------------------------------------------------
    def check_outputs(self, n_outputs: int) -> None:
        """Raise :class:`OutputLimitError` when a batch with ``n_outputs`` output rows would abort."""
        need = max(n_outputs, self.n_seq_max)
        if need > self.n_outputs_max:
            raise OutputLimitError(
                f"batch asks for {n_outputs} output rows (reserving {need}), but this context allows "
                f"n_outputs_max={self.n_outputs_max}; llama.cpp would abort the process. Size the context "
                "with output_limits() (§5.1)"
            )

    def _check_size(self, n: int) -> None:
        if n > self.n_batch:
            raise OutputLimitError(
                f"batch of {n} rows exceeds n_batch={self.n_batch}: raise the batch size (-b/--batch-size) "
                "or lower the draft length (--spec-draft-n-max)"
            )

    def decode(self, rows: Sequence[Row], *, kind: int = PROCESS_DECODE) -> None:
        """Decode ``rows`` in one ``llama_process`` call. Output row i of the batch is addressed by its
        batch index (``logits(i)``)."""
        ptr = self.live_ptr()
        n = len(rows)
        if n == 0:
            return
        self._check_size(n)
        n_out = sum(1 for r in rows if r.output)
        self.check_outputs(n_out)
        if self.n_outputs_max_per_seq < n_out and self.has_backend_samplers:  # (the cheap test first)
            worst = max(collections.Counter(r.seq_id for r in rows if r.output).values())
            if worst > self.n_outputs_max_per_seq:
                raise OutputLimitError(
                    f"a sequence asks for {worst} output rows, n_outputs_max_per_seq={self.n_outputs_max_per_seq}"
                )
        if kind == PROCESS_DECODE and not self._rpc and TokenBatch.takes(rows):  # the hot loop's path
            code, bad = self._tokens.fill(rows, self.n_vocab, self.n_seq_max)
            if code:
                raise DecodeError(self._add_error(code, rows[bad]), status=code)
            self._decoded(self._timed(n, self._tokens.decode, ptr), n)
            return
        b = self._batch
        native.llama_batch_ext_clear(b)
        pos = self._pos
        add_token = native.llama_batch_ext_add_token
        set_pos = native.llama_batch_ext_set_pos
        set_out = native.llama_batch_ext_set_output_logits
        for i, r in enumerate(rows):
            if r.token is not None:
                idx = add_token(b, r.seq_id, r.token)
            else:
                idx = native.llama_batch_ext_add(b, r.seq_id)
            if idx < 0:
                raise DecodeError(self._add_error(idx, r), status=idx)
            if r.embd is not None:
                e = np.ascontiguousarray(r.embd, dtype=np.float32)
                em = native.llama_embd(e.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, e.size)
                if not native.llama_batch_ext_set_embd_token(b, idx, em):
                    raise DecodeError(f"embedding of width {e.size} rejected for row {i} (see llama.cpp log)")
            pos[0] = r.pos
            set_pos(b, idx, pos)
            if r.output:
                set_out(b, idx, True)
        # on RPC process + synchronize on the RPC worker: the outputs are on the host when it returns
        self._decoded(self._native(_process_sync, ptr, kind, b, what="a decode") if self._rpc
                      else self._timed(n, native.llama_process, ptr, kind, b), n)

    def decode_next(self, tokens: list[int], pos: list[int], seq: list[int]) -> None:
        """:meth:`decode` of one output row per sequence (``tokens[i]`` at ``pos[i]`` of sequence ``seq[i]``,
        the sequences distinct): a generation round without drafts, written straight into the token batch.
        The same checks as :meth:`decode`; on RPC the rows go through :meth:`decode`."""
        n = len(tokens)
        if self._rpc or n == 0:
            self.decode([Row(t, p, q, True) for t, p, q in zip(tokens, pos, seq)])
            return
        ptr = self.live_ptr()
        self._check_size(n)
        self.check_outputs(n)  # (one output per sequence: never above n_outputs_max_per_seq)
        code, bad = self._tokens.fill_outputs(tokens, pos, seq, self.n_vocab, self.n_seq_max)
        if code:
            raise DecodeError(self._add_error(code, Row(tokens[bad], pos[bad], seq[bad], True)), status=code)
        self._decoded(self._timed(n, self._tokens.decode, ptr), n)

    def _timed(self, n: int, fn, *args) -> int:
        """``fn(*args)``, a native decode of ``n`` rows, with (and timed for) the tuner's thread count."""
        tuner = self.threads
        if tuner is None:
            return fn(*args)
        tuner.before(n)
        t0 = time.perf_counter()
        rc = fn(*args)
        tuner.after(n, time.perf_counter() - t0)
        return rc

    def tune_threads(self, counts: "Sequence[int] | None" = None) -> ThreadTuner | None:
        """Attach a :class:`~llamaspec._llama.threads.ThreadTuner` (``counts``: the candidates; default: the
        configured count, its half and 1); None where there is nothing to choose (one thread, RPC)."""
        n = self.params.n_threads_batch or self.params.n_threads or default_threads()
        counts = list(dict.fromkeys(counts if counts is not None else [n, max(1, n // 2), 1]))
        ptr = None if self._rpc or len(counts) < 2 else self.live_ptr()
        self.threads = (ThreadTuner(counts, lambda k: native.llama_set_n_threads(ptr, k, k), free_cores=free_cores)
                        if ptr else None)
        return self.threads

    def _decoded(self, rc: int, n: int) -> None:
        self.n_decodes += 1
        if rc != 0:
            why = _last_native_error("")
            msg = {1: f"no KV cache slot for a batch of {n} tokens (context full: raise n_ctx or shorten the prompt)",
                   2: "decode aborted"}.get(rc, f"llama_process failed with status {rc} for a batch of {n} rows")
            raise DecodeError(msg + (f": {why}" if why else ""), status=rc)

    def decode_tokens(self, tokens: Sequence[int], pos0: int, seq_id: int = 0, *, output_last: bool = True, output_all: bool = False) -> None:
        """Decode a run of tokens of one sequence in chunks of ``n_batch`` (prompt processing)."""
        n = len(tokens)
        for start in range(0, n, self.n_batch):
            self.decode([Row(t, pos0 + i, seq_id, output_all or (output_last and i == n - 1))
                         for i, t in enumerate(tokens[start:start + self.n_batch], start)])

    def _add_error(self, code: int, r: Row) -> str:
        return {-1: f"batch is full (n_batch={self.n_batch})",
                -2: f"invalid token {r.token} (vocabulary has {self.n_vocab} tokens)",
                -3: f"invalid sequence id {r.seq_id} (n_seq_max={self.n_seq_max})"}.get(code, f"llama_batch_ext_add failed with {code}")

    # -- outputs --------------------------------------------------------------------------------
    def logits(self, i: int) -> np.ndarray:
        """Logits of batch row ``i`` of the last decode, as a numpy view (valid until the next decode)."""
        # (np.ctypeslib.as_array costs several times this: it looks its array type up on every call)
        return np.frombuffer(self._row_t.from_address(ctypes.addressof(self.logits_ptr(i).contents)), np.float32)

    def logits_ptr(self, i: int):
        """The native logits of batch row ``i``; :class:`DecodeError` when the row has none (a sampler
        reading such a row would abort the process)."""
        p = native.llama_get_logits_ith(self.live_ptr(), i)
        if not p:
            raise DecodeError(f"no logits for batch row {i} (was its output flag set?)")
        return p

    def wait_for_outputs(self) -> None:
        """Wait until the last decode's work is done (an asynchronous backend returns from ``decode`` before
        it; an RPC decode has already waited)."""
        if not self._rpc:
            native.llama_synchronize(self.live_ptr())

    def synchronize(self) -> None:
        self._native(native.llama_synchronize, self.live_ptr(), what="a synchronize")

    def _native(self, fn, *args, what: str):
        """``fn(*args)``, on the RPC worker when the model is on RPC servers (state save/load reach them)."""
        if self._rpc:
            return rpc.call(fn, *args, what=what, timeout=rpc.DECODE_TIMEOUT_S)
        return fn(*args)

    # -- state ----------------------------------------------------------------------------------
    def state_seq_size(self, seq_id: int, flags: int = STATE_FLAGS_NONE) -> int:
        return int(native.llama_state_seq_get_size_ext(self.live_ptr(), seq_id, flags))

    def state_seq_get(self, seq_id: int, flags: int = STATE_FLAGS_NONE) -> bytes:
        size = self.state_seq_size(seq_id, flags)
        buf = (ctypes.c_uint8 * max(size, 1))()
        got = int(self._native(native.llama_state_seq_get_data_ext, self.live_ptr(), buf, size, seq_id, flags,
                               what="a state save"))
        if got != size:
            raise StateError(f"state save of seq {seq_id} wrote {got} bytes, expected {size}")
        return bytes(memoryview(buf)[:size])

    def state_seq_set(self, seq_id: int, data: bytes, flags: int = STATE_FLAGS_NONE) -> None:
        ptr = self.live_ptr()
        if not data:
            return
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        got = int(self._native(native.llama_state_seq_set_data_ext, ptr, buf, len(data), seq_id, flags,
                               what="a state load"))
        if got != len(data):
            raise StateError(f"state load into seq {seq_id} read {got} of {len(data)} bytes (state does not match this context)")

    # -- lifetime -------------------------------------------------------------------------------
    def live_ptr(self):
        """The native ``llama_context *``; :class:`LlamaSpecError` when the context is closed."""
        ptr = self.ptr
        if not ptr:
            raise LlamaSpecError(f"context on {self.model.path.name} is closed")
        if self._rpc:  # after an RPC failure even reading logits would wait on the dead connection
            rpc.check_alive()
        return ptr

    def close(self) -> None:
        batch = getattr(self, "_batch", None)
        if batch:
            self._batch = None
            native.llama_batch_ext_free(batch)
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            self._mem = None
            if getattr(self, "_rpc", False):
                rpc.call_or_leak(native.llama_free, ptr, what=f"freeing a context on {self.model.path.name}")
            else:
                native.llama_free(ptr)
        if getattr(self, "_holds_model", False):
            self._holds_model = False
            self.model._release()


# ---------------------------------------------------------------------------------------------------
# Output limits (§5.1)
# ---------------------------------------------------------------------------------------------------


def output_limits(n_batch: int, n_parallel: int, n_draft: int) -> tuple[int, int]:
    """``(n_outputs_max, n_outputs_max_per_seq)`` for a target that verifies drafts of ``n_draft``.

    >>> output_limits(512, 4, 3)
    (16, 4)
    >>> output_limits(8, 4, 16)
    (8, 8)
    """
    per_seq = 1 + max(0, n_draft)
    total = n_parallel * per_seq
    return max(1, min(n_batch, total)), max(1, min(n_batch, per_seq))
