"""The ctypes boundary: the only module that imports ``llama_cpp``.

Thin, owning wrappers over llama-cpp-python's low-level bindings. Every wrapper frees its native object
in ``close()`` (also called by ``__exit__`` and, as a last resort, ``__del__``), and every llama.cpp
return code is checked and turned into a typed :mod:`llamaspec.errors` exception.

Why the checks matter (spec §5.2): a decode whose output rows exceed the context's ``n_outputs_max``
makes llama.cpp call ``GGML_ASSERT`` and abort the whole Python process. :meth:`Context.decode` counts
output rows first and raises :class:`OutputLimitError` instead.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from .errors import (
    ContextError,
    DecodeError,
    LlamaSpecError,
    ModelFormatError,
    OutputLimitError,
    SamplerError,
    StateError,
    UsageError,
)

# llama_cpp/__init__ imports the high-level Llama class, which installs its own log callback that
# prints to stderr; ours replaces it in ``backend_init``.
import llama_cpp as _lcp  # noqa: E402
from llama_cpp import llama_cpp as C  # noqa: E402

log = logging.getLogger("llamaspec")
_native_log = logging.getLogger("llamaspec.llama_cpp")

LLAMA_CPP_PYTHON_VERSION: str = getattr(_lcp, "__version__", "unknown")

TOKEN_NULL = -1
DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: "pick a random seed"

PROCESS_ENCODE = C.LLAMA_PROCESS_TYPE_ENCODE
PROCESS_DECODE = C.LLAMA_PROCESS_TYPE_DECODE
STATE_FLAGS_NONE = C.LLAMA_STATE_SEQ_FLAGS_NONE
STATE_FLAGS_PARTIAL_ONLY = C.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
CONTEXT_TYPE_DEFAULT = getattr(C, "LLAMA_CONTEXT_TYPE_DEFAULT", 0)
CONTEXT_TYPE_MTP = getattr(C, "LLAMA_CONTEXT_TYPE_MTP", 1)

# ---------------------------------------------------------------------------------------------------
# backend + logging
# ---------------------------------------------------------------------------------------------------

# ggml_log_level: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5 (continues the previous line)
_GGML_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


class _LogRouter:
    """Routes llama.cpp's log lines into ``logging`` and remembers the last error lines.

    llama.cpp logs in fragments (level CONT = 5 continues the previous line); fragments are joined until a
    newline. The last few WARNING/ERROR lines are kept so that a failed load can say *why* it failed.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._level = logging.INFO
        self.recent_errors: list[str] = []
        self._lock = threading.Lock()

        @C.llama_log_callback
        def _cb(level: int, text: bytes, user_data) -> None:  # pragma: no cover - called from C
            try:
                self.feed(int(level), text.decode("utf-8", errors="replace") if text else "")
            except Exception:  # never raise into C
                pass

        self.callback = _cb

    def feed(self, level: int, text: str) -> None:
        with self._lock:
            if level != 5:
                self._level = _GGML_LEVELS.get(level, logging.DEBUG)
            self._buf += text
            while "\n" in self._buf:
                line, self._buf = self._buf.split("\n", 1)
                self._emit(line)

    def _emit(self, line: str) -> None:
        if not line.strip():
            return
        if self._level >= logging.WARNING:
            self.recent_errors.append(line.strip())
            del self.recent_errors[:-8]
        if _native_log.isEnabledFor(self._level):
            _native_log.log(self._level, "%s", line)

    def take_errors(self) -> list[str]:
        with self._lock:
            out, self.recent_errors = self.recent_errors, []
            return out


_router = _LogRouter()
_backend_ready = False
_backend_lock = threading.Lock()


def backend_init() -> None:
    """Initialise the llama.cpp backend once and route its logs into ``logging`` (idempotent)."""
    global _backend_ready
    with _backend_lock:
        if _backend_ready:
            return
        C.llama_log_set(_router.callback, ctypes.c_void_p(0))
        C.llama_backend_init()
        _backend_ready = True


def _last_native_error(default: str = "") -> str:
    """The most telling recent llama.cpp warning/error line ("error loading model: ..." beats "failed")."""
    import re

    errs = _router.take_errors()
    if not errs:
        return default
    text = "\n".join(errs)
    # llama.cpp sometimes logs fragments without a newline: cut each message at the next "func_name:" prefix
    m = re.search(r"error loading model: (.*?)(?=\w+: |\n|$)", text)
    if m:
        return m.group(1).strip()
    for line in reversed(errs):
        if "error" in line or "failed" in line:
            return line.strip()
    return errs[-1]


def system_info() -> str:
    backend_init()
    return C.llama_print_system_info().decode("utf-8", errors="replace")


class _Owned:
    """Owning wrapper: ``close()`` frees the native object; context manager; ``__del__`` as a last resort."""

    def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------------
# Vocab
# ---------------------------------------------------------------------------------------------------


class Vocab:
    """Tokenizer and token metadata. Owned by its :class:`Model` (valid while the model is open)."""

    def __init__(self, model: "Model"):
        self._model = model
        self.ptr = C.llama_model_get_vocab(model.ptr)
        self.n_tokens: int = int(C.llama_vocab_n_tokens(self.ptr))
        self.type: int = int(C.llama_vocab_type(self.ptr))
        self.bos: int = int(C.llama_vocab_bos(self.ptr))
        self.eos: int = int(C.llama_vocab_eos(self.ptr))
        self.eot: int = int(C.llama_vocab_eot(self.ptr))
        self.add_bos: bool = bool(C.llama_vocab_get_add_bos(self.ptr))
        self.add_eos: bool = bool(C.llama_vocab_get_add_eos(self.ptr))
        self._piece_buf = ctypes.create_string_buffer(256)
        self._eog_cache: dict[int, bool] = {}

    @property
    def suppress_tokens(self) -> list[int]:
        """Model-specific tokens a sampler must never pick (``tokenizer.ggml.suppress_tokens``)."""
        n = ctypes.c_int32(0)
        p = C.llama_vocab_get_suppress_tokens(self.ptr, ctypes.byref(n))
        return [int(p[i]) for i in range(n.value)] if p and n.value > 0 else []

    def is_eog(self, token: int) -> bool:
        r = self._eog_cache.get(token)
        if r is None:
            r = bool(C.llama_vocab_is_eog(self.ptr, token))
            self._eog_cache[token] = r
        return r

    def is_control(self, token: int) -> bool:
        return bool(C.llama_vocab_is_control(self.ptr, token))

    def get_text(self, token: int) -> bytes:
        """Raw vocabulary text of a token (what spec §11 compares byte for byte)."""
        t = C.llama_vocab_get_text(self.ptr, token)
        return t if t is not None else b""

    def tokenize(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n_max = len(data) + 8
        buf = (C.llama_token * n_max)()
        n = C.llama_tokenize(self.ptr, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:
            n_max = -n
            buf = (C.llama_token * n_max)()
            n = C.llama_tokenize(self.ptr, data, len(data), buf, n_max, add_special, parse_special)
            if n < 0:
                raise LlamaSpecError(f"tokenization failed (llama_tokenize returned {n})")
        return list(buf[:n])

    def token_to_piece(self, token: int, *, special: bool = False) -> bytes:
        buf = self._piece_buf
        n = C.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], *, remove_special: bool = False, unparse_special: bool = False) -> str:
        if not tokens:
            return ""
        arr = (C.llama_token * len(tokens))(*tokens)
        cap = max(64, 8 * len(tokens))
        out = ctypes.create_string_buffer(cap)
        n = C.llama_detokenize(self.ptr, arr, len(tokens), out, cap, remove_special, unparse_special)
        if n < 0:
            cap = -n
            out = ctypes.create_string_buffer(cap)
            n = C.llama_detokenize(self.ptr, arr, len(tokens), out, cap, remove_special, unparse_special)
        return out.raw[:n].decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------------


def _check_gguf_magic(path: Path) -> None:
    if not path.exists():
        raise ModelFormatError(f"model file not found: {path} (check the path, or use a name from `llamaspec models list`)")
    if path.is_dir():
        raise ModelFormatError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != b"GGUF":
        raise ModelFormatError(
            f"{path} is not a GGUF file (it starts with {head!r}, a GGUF file starts with b'GGUF'); "
            "convert it with llama.cpp's convert_hf_to_gguf.py or pick another file"
        )


class Model(_Owned):
    """A loaded GGUF model. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_gpu_layers: int = 0,
        use_mmap: bool = True,
        vocab_only: bool = False,
        load_mtp: bool = False,
    ):
        backend_init()
        self.path = Path(path)
        _check_gguf_magic(self.path)
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.use_mmap = use_mmap
        params.vocab_only = vocab_only
        if hasattr(params, "load_mtp"):
            params.load_mtp = load_mtp
        _router.take_errors()
        ptr = C.llama_model_load_from_file(str(self.path).encode("utf-8"), params)
        if not ptr:
            why = _last_native_error("llama.cpp could not load it")
            raise ModelFormatError(f"failed to load model {self.path}: {why}")
        self.ptr = ptr
        self.vocab = Vocab(self)
        self.arch: str = self.meta("general.architecture") or "unknown"
        self.name: str = self.meta("general.name") or self.path.stem
        self.vocab_only = vocab_only
        # a vocab-only model has no hyper-parameters: llama.cpp aborts when asked for them
        hp = (lambda f: int(f(ptr))) if not vocab_only else (lambda f: 0)
        self.n_layer: int = hp(C.llama_model_n_layer)
        self.n_embd: int = hp(C.llama_model_n_embd)
        self.n_embd_inp: int = hp(C.llama_model_n_embd_inp)
        self.n_embd_out: int = hp(C.llama_model_n_embd_out)
        self.n_layer_nextn: int = hp(C.llama_model_n_layer_nextn)
        self.n_ctx_train: int = hp(C.llama_model_n_ctx_train)
        self.n_head: int = hp(C.llama_model_n_head)
        self.n_swa: int = hp(C.llama_model_n_swa)
        self.n_params: int = hp(C.llama_model_n_params)
        self.size_bytes: int = hp(C.llama_model_size)
        self.is_recurrent: bool = bool(hp(C.llama_model_is_recurrent))
        self.is_hybrid: bool = bool(hp(C.llama_model_is_hybrid))
        self.has_encoder: bool = bool(hp(C.llama_model_has_encoder))
        buf = ctypes.create_string_buffer(256)
        C.llama_model_desc(ptr, buf, len(buf))
        self.desc: str = buf.value.decode("utf-8", errors="replace")

    # -- metadata -------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """Metadata value as a string (``llama_model_meta_val_str``), or None when the key is absent."""
        buf = ctypes.create_string_buffer(1024)
        n = C.llama_model_meta_val_str(self.ptr, key.encode("utf-8"), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            C.llama_model_meta_val_str(self.ptr, key.encode("utf-8"), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def meta_all(self) -> dict[str, str]:
        out: dict[str, str] = {}
        n = int(C.llama_model_meta_count(self.ptr))
        kbuf = ctypes.create_string_buffer(256)
        vbuf = ctypes.create_string_buffer(1024)
        for i in range(n):
            if C.llama_model_meta_key_by_index(self.ptr, i, kbuf, len(kbuf)) < 0:
                continue
            C.llama_model_meta_val_str_by_index(self.ptr, i, vbuf, len(vbuf))
            out[kbuf.value.decode("utf-8", "replace")] = vbuf.value.decode("utf-8", "replace")
        return out

    @property
    def is_swa(self) -> bool:
        return self.n_swa > 0

    def chat_template(self) -> str | None:
        t = C.llama_model_chat_template(self.ptr, None)
        return t.decode("utf-8", errors="replace") if t else None

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_assistant: bool = True) -> str:
        """Render ``messages`` with the model's chat template.

        llama.cpp's built-in template matcher is tried first; templates it does not know are rendered
        with Jinja2 (what llama-cpp-python's ``Llama`` does).
        """
        tmpl = C.llama_model_chat_template(self.ptr, None)
        if tmpl is None:
            raise UsageError(
                f"model {self.path.name} has no chat template (tokenizer.chat_template); drop --chat and "
                "format the prompt yourself"
            )
        n = len(messages)
        arr = (C.llama_chat_message * n)()
        keep = []
        for i, m in enumerate(messages):
            r, c = m["role"].encode("utf-8"), m["content"].encode("utf-8")
            keep += [r, c]
            arr[i].role = r
            arr[i].content = c
        cap = 4096 + sum(len(m["content"]) for m in messages) * 2
        buf = ctypes.create_string_buffer(cap)
        res = C.llama_chat_apply_template(tmpl, arr, n, add_assistant, buf, cap)
        if res > cap:
            buf = ctypes.create_string_buffer(res + 1)
            res = C.llama_chat_apply_template(tmpl, arr, n, add_assistant, buf, res + 1)
        if res >= 0:
            return buf.raw[:res].decode("utf-8", errors="replace")
        try:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            v = self.vocab
            fmt = Jinja2ChatFormatter(
                template=tmpl.decode("utf-8"),
                eos_token=v.token_to_piece(v.eos, special=True).decode("utf-8", "replace") if v.eos >= 0 else "",
                bos_token=v.token_to_piece(v.bos, special=True).decode("utf-8", "replace") if v.bos >= 0 else "",
                add_generation_prompt=add_assistant,
            )
            return fmt(messages=messages).prompt
        except Exception as e:  # noqa: BLE001
            raise UsageError(f"could not apply the chat template of {self.path.name}: {e}") from e

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            C.llama_model_free(ptr)


    def __repr__(self) -> str:
        return f"Model({self.path.name!r}, arch={self.arch}, n_layer={self.n_layer}, n_embd={self.n_embd})"


# ---------------------------------------------------------------------------------------------------
# Batch rows and Context
# ---------------------------------------------------------------------------------------------------


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


GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


class Context(_Owned):
    """A llama.cpp context with decode through ``llama_batch_ext`` + ``llama_process``.

    ``decode(rows)`` validates the batch (capacity, output-row limit of spec §5.2, sequence ids) before
    handing it to llama.cpp, so that no call can hit a native abort.
    """

    def __init__(self, model: Model, params: ContextParams | None = None, *, ctx_other: "Context | None" = None, **kw):
        backend_init()
        p = params or ContextParams()
        for k, v in kw.items():
            if not hasattr(p, k):
                raise UsageError(f"unknown context parameter {k!r}")
            setattr(p, k, v)
        if p.n_ctx < 1 or p.n_batch < 1 or p.n_seq_max < 1:
            raise UsageError(f"invalid context size: n_ctx={p.n_ctx}, n_batch={p.n_batch}, n_seq_max={p.n_seq_max}")
        self.model = model
        self.params = p
        cp = C.llama_context_default_params()
        cp.n_ctx = p.n_ctx
        cp.n_batch = p.n_batch
        cp.n_ubatch = min(p.n_ubatch, p.n_batch)
        cp.n_seq_max = p.n_seq_max
        cp.n_rs_seq = p.n_rs_seq
        cp.n_outputs_max = p.n_outputs_max
        cp.n_outputs_max_per_seq = p.n_outputs_max_per_seq
        nt = p.n_threads or default_threads()
        cp.n_threads = nt
        cp.n_threads_batch = p.n_threads_batch or nt
        cp.ctx_type = p.ctx_type
        if p.flash_attn is not None:
            cp.flash_attn_type = 1 if p.flash_attn else 0
        if p.kv_f32:
            cp.type_k = GGML_TYPE_F32
            cp.type_v = GGML_TYPE_F32
        cp.swa_full = p.swa_full
        if p.kv_unified is not None:
            cp.kv_unified = p.kv_unified
        cp.embeddings = p.embeddings
        cp.no_perf = p.no_perf
        for k, v in p.extra.items():
            setattr(cp, k, v)
        if ctx_other is not None:
            cp.ctx_other = ctx_other.ptr
        self._ctx_other = ctx_other
        # n_seq_max rows are reserved on every decode: a context whose n_outputs_max is below that
        # aborts inside llama_init_from_model already (spec §5.2), so refuse it here
        eff_out = p.n_batch if (p.n_outputs_max == 0 or model.has_encoder) else p.n_outputs_max
        if p.n_seq_max > eff_out:
            raise ContextError(
                f"n_seq_max={p.n_seq_max} exceeds n_outputs_max={eff_out}: llama.cpp would abort (spec §5.2); "
                "raise n_outputs_max (see output_limits())"
            )
        _router.take_errors()
        ptr = C.llama_init_from_model(model.ptr, cp)
        if not ptr:
            why = _last_native_error("llama.cpp returned no context")
            raise ContextError(f"could not create a context for {model.path.name} (n_ctx={p.n_ctx}, n_batch={p.n_batch}, n_seq_max={p.n_seq_max}): {why}")
        self.ptr = ptr
        self.n_ctx: int = int(C.llama_n_ctx(ptr))
        self.n_ctx_seq: int = int(C.llama_n_ctx_seq(ptr))
        self.n_batch: int = int(C.llama_n_batch(ptr))
        self.n_ubatch: int = int(C.llama_n_ubatch(ptr))
        self.n_seq_max: int = int(C.llama_n_seq_max(ptr))
        self.n_rs_seq: int = int(C.llama_n_rs_seq(ptr))
        self.n_vocab: int = model.vocab.n_tokens
        # effective output limits, computed exactly as llama-context.cpp does (spec §5.2)
        if p.n_outputs_max == 0 or model.has_encoder:
            self.n_outputs_max = self.n_batch
        else:
            self.n_outputs_max = p.n_outputs_max
        self.n_outputs_max_per_seq = (
            self.n_outputs_max if p.n_outputs_max_per_seq == 0 else min(p.n_outputs_max_per_seq, self.n_outputs_max)
        )
        self._batch = C.llama_batch_ext_init(ptr)
        if not self._batch:
            self.close()
            raise ContextError("llama_batch_ext_init failed")
        self._pos = (C.llama_pos * 4)()
        self._mem = C.llama_get_memory(ptr)
        self.memory = Memory(self) if self._mem else None
        self.n_decodes = 0

    # -- decode ---------------------------------------------------------------------------------
    def check_outputs(self, n_outputs: int) -> None:
        """Raise :class:`OutputLimitError` when a batch with ``n_outputs`` output rows would abort."""
        need = max(n_outputs, self.n_seq_max)
        if need > self.n_outputs_max:
            raise OutputLimitError(
                f"batch asks for {n_outputs} output rows (reserving {need}), but this context allows "
                f"n_outputs_max={self.n_outputs_max}; llama.cpp would abort the process. Size the context "
                "with output_limits() (spec §5.1)"
            )

    def decode(self, rows: Sequence[Row], *, kind: int = PROCESS_DECODE) -> None:
        """Decode ``rows`` in one ``llama_process`` call. Output row i of the batch is addressed by its
        batch index (``logits(i)``)."""
        n = len(rows)
        if n == 0:
            return
        if n > self.n_batch:
            raise OutputLimitError(f"batch of {n} rows exceeds n_batch={self.n_batch}; split it (decode_chunked)")
        n_out = 0
        for r in rows:
            if r.output:
                n_out += 1
        self.check_outputs(n_out)
        if self.n_outputs_max_per_seq < n_out:
            per: dict[int, int] = {}
            for r in rows:
                if r.output:
                    per[r.seq_id] = per.get(r.seq_id, 0) + 1
            worst = max(per.values())
            if worst > self.n_outputs_max_per_seq and self.params.extra.get("samplers"):
                raise OutputLimitError(
                    f"a sequence asks for {worst} output rows, n_outputs_max_per_seq={self.n_outputs_max_per_seq}"
                )
        b = self._batch
        C.llama_batch_ext_clear(b)
        pos = self._pos
        add_token = C.llama_batch_ext_add_token
        set_pos = C.llama_batch_ext_set_pos
        set_out = C.llama_batch_ext_set_output_logits
        for i, r in enumerate(rows):
            if r.token is not None:
                idx = add_token(b, r.seq_id, r.token)
            else:
                idx = C.llama_batch_ext_add(b, r.seq_id)
            if idx < 0:
                raise DecodeError(self._add_error(idx, r), status=idx)
            if r.embd is not None:
                e = np.ascontiguousarray(r.embd, dtype=np.float32)
                em = C.llama_embd(e.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), 1, e.size)
                if not C.llama_batch_ext_set_embd_token(b, idx, em):
                    raise DecodeError(f"embedding of width {e.size} rejected for row {i} (see llama.cpp log)")
            pos[0] = r.pos
            set_pos(b, idx, pos)
            if r.output:
                set_out(b, idx, True)
        rc = C.llama_process(self.ptr, kind, b)
        self.n_decodes += 1
        if rc != 0:
            why = _last_native_error("")
            raise DecodeError(self._rc_message(rc, n) + (f": {why}" if why else ""), status=rc)

    def decode_tokens(self, tokens: Sequence[int], pos0: int, seq_id: int = 0, *, output_last: bool = True, output_all: bool = False) -> None:
        """Decode a run of tokens of one sequence in chunks of ``n_batch`` (prompt processing)."""
        n = len(tokens)
        for start in range(0, n, self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            last = start + len(chunk) == n
            rows = [
                Row(t, pos0 + start + j, seq_id, output_all or (output_last and last and j == len(chunk) - 1))
                for j, t in enumerate(chunk)
            ]
            self.decode(rows)

    def _add_error(self, code: int, r: Row) -> str:
        if code == -1:
            return f"batch is full (n_batch={self.n_batch})"
        if code == -2:
            return f"invalid token {r.token} (vocabulary has {self.n_vocab} tokens)"
        if code == -3:
            return f"invalid sequence id {r.seq_id} (n_seq_max={self.n_seq_max})"
        return f"llama_batch_ext_add failed with {code}"

    @staticmethod
    def _rc_message(rc: int, n: int) -> str:
        if rc == 1:
            return f"no KV cache slot for a batch of {n} tokens (context full: raise n_ctx or shorten the prompt)"
        if rc == 2:
            return "decode aborted"
        return f"llama_process failed with status {rc} for a batch of {n} rows"

    # -- outputs --------------------------------------------------------------------------------
    def logits(self, i: int) -> np.ndarray:
        """Logits of batch row ``i`` of the last decode, as a numpy view (valid until the next decode)."""
        p = C.llama_get_logits_ith(self.ptr, i)
        if not p:
            raise DecodeError(f"no logits for batch row {i} (was its output flag set?)")
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,))

    def synchronize(self) -> None:
        C.llama_synchronize(self.ptr)

    def set_threads(self, n_threads: int, n_threads_batch: int | None = None) -> None:
        C.llama_set_n_threads(self.ptr, n_threads, n_threads_batch or n_threads)

    # -- state ----------------------------------------------------------------------------------
    def state_seq_size(self, seq_id: int, flags: int = STATE_FLAGS_NONE) -> int:
        return int(C.llama_state_seq_get_size_ext(self.ptr, seq_id, flags))

    def state_seq_get(self, seq_id: int, flags: int = STATE_FLAGS_NONE) -> bytes:
        size = self.state_seq_size(seq_id, flags)
        buf = (ctypes.c_uint8 * max(size, 1))()
        got = int(C.llama_state_seq_get_data_ext(self.ptr, buf, size, seq_id, flags))
        if got != size:
            raise StateError(f"state save of seq {seq_id} wrote {got} bytes, expected {size}")
        return bytes(memoryview(buf)[:size])

    def state_seq_set(self, seq_id: int, data: bytes, flags: int = STATE_FLAGS_NONE) -> None:
        if not data:
            return
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        got = int(C.llama_state_seq_set_data_ext(self.ptr, buf, len(data), seq_id, flags))
        if got != len(data):
            raise StateError(f"state load into seq {seq_id} read {got} of {len(data)} bytes (state does not match this context)")

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        b = getattr(self, "_batch", None)
        if b:
            self._batch = None
            C.llama_batch_ext_free(b)
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            C.llama_free(ptr)



class Memory:
    """Sequence operations on a context's memory (KV cache / recurrent state)."""

    def __init__(self, ctx: Context):
        self._ctx = ctx

    @property
    def ptr(self):
        return self._ctx._mem

    def seq_rm(self, seq_id: int, p0: int, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of ``seq_id``; returns llama.cpp's bool (never ignore it)."""
        return bool(C.llama_memory_seq_rm(self.ptr, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        C.llama_memory_seq_cp(self.ptr, src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        C.llama_memory_seq_keep(self.ptr, seq_id)

    def pos_min(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_min(self.ptr, seq_id))

    def pos_max(self, seq_id: int) -> int:
        return int(C.llama_memory_seq_pos_max(self.ptr, seq_id))

    def clear(self, data: bool = True) -> None:
        C.llama_memory_clear(self.ptr, data)


# ---------------------------------------------------------------------------------------------------
# Output limits (spec §5.1)
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


# ---------------------------------------------------------------------------------------------------
# Samplers
# ---------------------------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """Target sampling settings (llama.cpp names). ``temp <= 0`` means greedy."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = DEFAULT_SEED
    grammar: str | None = None
    grammar_root: str = "root"

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def validate(self) -> None:
        if self.top_k < 0:
            raise UsageError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise UsageError(f"top-p must be in [0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise UsageError(f"min-p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise UsageError(f"repeat-penalty must be > 0 (1.0 disables it), got {self.repeat_penalty}")
        if not 0 <= self.seed <= 0xFFFFFFFF:
            raise UsageError(f"seed must be in [0, 4294967295], got {self.seed}")
        if self.temp != self.temp:  # NaN
            raise UsageError("temperature must be a number")


class Sampler(_Owned):
    """An owning llama.cpp sampler chain built from :class:`SamplingParams`.

    Chain order follows llama.cpp's common sampler: [grammar] -> penalties -> top-k -> top-p -> min-p ->
    temperature -> dist (or greedy when ``temp <= 0``). ``sample`` accepts the sampled token into the chain
    (``llama_sampler_sample`` does so itself).
    """

    def __init__(self, ptr, params: SamplingParams | None = None):
        self.ptr = ptr
        self.params = params

    @classmethod
    def from_params(cls, vocab: Vocab, params: SamplingParams) -> "Sampler":  # noqa: C901
        params.validate()
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        add = lambda s: C.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.grammar:
            g = C.llama_sampler_init_grammar(vocab.ptr, params.grammar.encode("utf-8"), params.grammar_root.encode("utf-8"))
            if not g:
                C.llama_sampler_free(chain)
                why = _last_native_error("see the llama.cpp log")
                raise SamplerError(f"grammar does not parse: {why}")
            add(g)
        if params.repeat_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            add(C.llama_sampler_init_penalties(vocab.n_tokens, params.repeat_last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty))
        if params.greedy:
            add(C.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(C.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(C.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(C.llama_sampler_init_min_p(params.min_p, 1))
            add(C.llama_sampler_init_temp(params.temp))
            add(C.llama_sampler_init_dist(params.seed))
        return cls(chain, params)

    @classmethod
    def top_k_dist(cls, k: int, seed: int = DEFAULT_SEED, temp: float | None = None) -> "Sampler":
        """``top_k(k) [-> temp] -> dist(seed)``: the draft sampler of spec §4."""
        chain = C.llama_sampler_chain_init(C.llama_sampler_chain_default_params())
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_top_k(k))
        if temp is not None:
            C.llama_sampler_chain_add(chain, C.llama_sampler_init_temp(temp))
        C.llama_sampler_chain_add(chain, C.llama_sampler_init_dist(seed))
        return cls(chain)

    def sample(self, ctx: Context, idx: int) -> int:
        """Sample from batch row ``idx`` of ``ctx``'s last decode and accept the token into the chain."""
        return int(C.llama_sampler_sample(self.ptr, ctx.ptr, idx))

    _TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def sample_no_accept(self, ctx: Context, idx: int) -> int:
        """Sample from batch row ``idx`` **without** accepting the token into the chain (the random state of
        ``dist`` still advances). For replay and synthetic acceptance, where the accepted token is another."""
        logits = ctx.logits(idx)
        n = logits.shape[0]
        buf = getattr(self, "_cand", None)
        if buf is None or buf.shape[0] != n:
            buf = np.zeros(n, dtype=self._TOKEN_DATA)
            buf["id"] = np.arange(n, dtype=np.int32)
            self._cand = buf
        else:
            buf["id"] = np.arange(n, dtype=np.int32)
        buf["logit"] = logits
        buf["p"] = 0.0
        arr = C.llama_token_data_array(
            data=buf.ctypes.data_as(C.llama_token_data_p), size=n, selected=-1, sorted=False
        )
        C.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise SamplerError("the sampler chain selected no token")
        data = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_int32)), shape=(arr.size * 3,))
        return int(data[arr.selected * 3])

    def accept(self, token: int) -> None:
        C.llama_sampler_accept(self.ptr, token)

    def reset(self) -> None:
        C.llama_sampler_reset(self.ptr)

    def clone(self) -> "Sampler":
        """Deep copy, including the random state of ``dist``."""
        return Sampler(C.llama_sampler_clone(self.ptr), self.params)

    def copy_from(self, other: "Sampler") -> None:
        """Copy ``other``'s state into this sampler (``llama_sampler_copy``), e.g. to restore a clone."""
        C.llama_sampler_copy(other.ptr, self.ptr)

    def close(self) -> None:
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            C.llama_sampler_free(ptr)



# ---------------------------------------------------------------------------------------------------
# Staging (non-C, llama-ext.h) symbols, bound by exported name (spec §12.2), feature-detected
# ---------------------------------------------------------------------------------------------------

_STAGING_SPECS = {
    # name: (candidate symbol names, argtypes, restype)
    "llama_set_embeddings_nextn": (
        ("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb"),
        [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "llama_get_embeddings_nextn": (
        ("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context"),
        [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float)),
    "llama_get_embeddings_nextn_ith": (
        ("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti"),
        [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "llama_set_nextn_layer_offset": (
        ("llama_set_nextn_layer_offset", "_Z28llama_set_nextn_layer_offsetP13llama_contexti"),
        [ctypes.c_void_p, ctypes.c_int32], None),
    "llama_get_ctx_other": (
        ("llama_get_ctx_other", "_Z19llama_get_ctx_otherP13llama_context"),
        [ctypes.c_void_p], ctypes.c_void_p),
    "llama_set_embeddings_layer_inp": (
        ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
         "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z"),
        [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": (
        ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
         "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z"),
        [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
    "llama_model_target_layer_ids": (
        ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
         "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z"),
        [ctypes.c_void_p], ctypes.POINTER(ctypes.c_int32)),
    "llama_model_target_layer_ids_n": (
        ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
         "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z"),
        [ctypes.c_void_p], ctypes.c_uint32),
    "llama_model_dflash_selector_top_k": (
        ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model",
         "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z"),
        [ctypes.c_void_p], ctypes.c_int32),
    "llama_model_get_tok_embd": (
        ("llama_model_get_tok_embd", "_Z24llama_model_get_tok_embdPK11llama_modelPf"),
        [ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)], ctypes.c_uint32),
}


class _Staging:
    """Lazily bound staging functions; ``available(name)`` tells whether the loaded library exports it."""

    def __init__(self) -> None:
        self._funcs: dict[str, object] = {}
        self._missing: set[str] = set()

    def _bind(self, name: str):
        if name in self._funcs:
            return self._funcs[name]
        if name in self._missing:
            return None
        spec = _STAGING_SPECS.get(name)
        if spec is None:
            raise AttributeError(name)
        names, argtypes, restype = spec
        lib = C._lib
        for sym in names:
            try:
                fn = getattr(lib, sym)
            except AttributeError:
                continue
            fn.argtypes = argtypes
            fn.restype = restype
            self._funcs[name] = fn
            return fn
        self._missing.add(name)
        return None

    def available(self, name: str) -> bool:
        return self._bind(name) is not None

    def names(self) -> dict[str, bool]:
        return {n: self.available(n) for n in _STAGING_SPECS}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._bind(name)
        if fn is None:
            raise LlamaSpecError(f"{name} is not exported by the loaded libllama (needed for this drafter)")
        return fn


staging = _Staging()


def model_target_layer_ids(model: Model) -> list[int]:
    """``llama_model_target_layer_ids`` (EAGLE-3 / DFlash drafts): the target layers they read."""
    n = int(staging.llama_model_target_layer_ids_n(model.ptr))
    if n == 0:
        return []
    p = staging.llama_model_target_layer_ids(model.ptr)
    return [int(p[i]) for i in range(n)] if p else []


def iter_chunks(seq: Sequence, size: int) -> Iterable[Sequence]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
