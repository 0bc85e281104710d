"""Loaded GGUF models (their vocabularies: :mod:`.vocab`, :class:`Vocab` also importable from here).

Lifetime rules (a native model must outlive every context and grammar sampler made from it):

* :class:`Vocab` holds its :class:`Model` weakly (and ``Memory`` its ``Context``), so the only strong
  edge between the wrappers is ``Context -> Model``: there is no cycle, and refcounting alone frees what
  is dropped without ``close()``, the context first. A vocabulary whose model is closed or gone raises
  :class:`LlamaSpecError` instead of handing a dangling pointer to C.
* A :class:`Context` (and a grammar sampler) *acquires* its model. ``Model.close()`` while users are still
  open only marks the model closed; the native ``llama_model_free`` runs when the last user closes. So
  the order in which finalizers run (the garbage collector picks one for objects held by a cycle) can
  never free a model under a live context.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
from pathlib import Path
from typing import Sequence

from llama_cpp import llama_cpp as native

from ..errors import LlamaSpecError, ModelFormatError, UsageError
from . import rpc
from .cpu_features import use_extra_buffers
from .log import _forget_native_errors, _last_native_error, backend_init
from .vocab import Vocab, text_of

TOKEN_NULL = -1

log = logging.getLogger("llamaspec")


# ---------------------------------------------------------------------------------------------------
# GPU offload (llama_model_params: n_gpu_layers, main_gpu, split_mode, tensor_split)
# ---------------------------------------------------------------------------------------------------

#: ``-sm`` names, as llama.cpp's ``common/arg.cpp`` spells them (``tensor`` is experimental there)
SPLIT_MODES: dict[str, int] = {
    "none": native.LLAMA_SPLIT_MODE_NONE,
    "layer": native.LLAMA_SPLIT_MODE_LAYER,
    "row": native.LLAMA_SPLIT_MODE_ROW,
    "tensor": native.LLAMA_SPLIT_MODE_TENSOR,
}
#: ``llama_model_default_params().n_gpu_layers`` (-1 in this llama.cpp: a negative value means all layers)
N_GPU_LAYERS_DEFAULT: int = int(native.llama_model_default_params().n_gpu_layers)


def max_devices() -> int:
    """``llama_max_devices()``: the length of llama.cpp's ``tensor_split`` array."""
    return int(native.llama_max_devices())


def supports_gpu_offload() -> bool:
    """Whether the loaded llama.cpp library was built with a GPU backend (CUDA, Metal, Vulkan, ...)."""
    return bool(native.llama_supports_gpu_offload())


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_offload(*, n_gpu_layers=None, main_gpu=None, split_mode=None, tensor_split=None,
                  draft: bool = False) -> tuple[float, ...] | None:
    """Validate GPU-offload settings (None = llama.cpp's default); :class:`UsageError` with one line naming
    the argument and its flag. Returns ``tensor_split`` as a tuple of floats (or None).

    >>> check_offload(n_gpu_layers=99, split_mode="row", tensor_split=[3, 1])
    (3.0, 1.0)
    >>> check_offload(n_gpu_layers=-2)
    Traceback (most recent call last):
    llamaspec.errors.UsageError: n_gpu_layers (-ngl) must be >= 0, or -1 for llama.cpp's default (all layers), got -2
    >>> check_offload(split_mode="rows")
    Traceback (most recent call last):
    llamaspec.errors.UsageError: unknown split mode 'rows' (-sm): valid are none, layer, row, tensor
    """
    name, flag = ("n_gpu_layers_draft", "-ngld") if draft else ("n_gpu_layers", "-ngl")
    if n_gpu_layers is not None:
        if not _is_int(n_gpu_layers):
            raise UsageError(f"{name} ({flag}) must be an integer, got {n_gpu_layers!r}")
        if n_gpu_layers < 0 and n_gpu_layers != N_GPU_LAYERS_DEFAULT:
            raise UsageError(f"{name} ({flag}) must be >= 0, or {N_GPU_LAYERS_DEFAULT} for llama.cpp's default "
                             f"(all layers), got {n_gpu_layers}")
    if main_gpu is not None:
        if not _is_int(main_gpu):
            raise UsageError(f"main_gpu (-mg) must be an integer, got {main_gpu!r}")
        if not 0 <= main_gpu < max_devices():
            raise UsageError(f"main_gpu (-mg) must be a GPU index from 0 to {max_devices() - 1}, got {main_gpu}")
    if split_mode is not None and split_mode not in SPLIT_MODES:
        raise UsageError(f"unknown split mode {split_mode!r} (-sm): valid are {', '.join(SPLIT_MODES)}")
    if split_mode == "tensor" and not supports_gpu_offload():
        raise UsageError("split mode tensor (-sm) splits tensors across GPUs, and this llama.cpp build has no GPU "
                         "backend: use another split mode, or a GPU build (docs/cli.md, GPU offload)")
    if tensor_split is None:
        return None
    if isinstance(tensor_split, (str, bytes)) or not hasattr(tensor_split, "__iter__"):
        raise UsageError(f"tensor_split (-ts) must be a list of proportions, one per GPU (e.g. [3, 1]), got {tensor_split!r}")
    vals = list(tensor_split)
    if not vals:
        raise UsageError("tensor_split (-ts) is empty: give one proportion per GPU (e.g. 3,1), or leave it unset")
    if len(vals) > max_devices():
        raise UsageError(f"tensor_split (-ts) has {len(vals)} entries, but llama.cpp supports at most "
                         f"{max_devices()} devices (llama_max_devices)")
    for v in vals:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"tensor_split (-ts) entries must be finite numbers >= 0, got {v!r}")
    return tuple(float(v) for v in vals)


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


@functools.lru_cache(maxsize=1)
def _warn_no_gpu_once() -> None:
    log.warning("this llama.cpp build has no GPU offload: the GPU layers setting (-ngl) is ignored, the model "
                "runs on the CPU (see docs/cli.md, GPU offload)")


class Model(_Owned):
    """A loaded GGUF model. Use as a context manager or call :meth:`close`."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        n_gpu_layers: int | None = None,
        use_mmap: bool = True,
        vocab_only: bool = False,
        load_mtp: bool = False,
        main_gpu: int | None = None,
        split_mode: str | None = None,
        tensor_split: Sequence[float] | None = None,
        rpc_servers: "Sequence[str] | str | None" = None,
    ):
        """Load ``path``. ``rpc_servers`` (``host:port`` list, see :mod:`.rpc`): the model's offloaded layers
        go to the devices of these llama.cpp RPC servers (then to local GPUs), split by ``tensor_split`` in
        that order; without it the model uses llama.cpp's local device choice. GPU offload (None = llama.cpp's default, see :func:`check_offload`):
        ``n_gpu_layers`` layers in VRAM (-1 = all, llama.cpp's default; ignored by a CPU-only build),
        ``split_mode`` (none, layer, row, tensor) and ``tensor_split`` (proportions per GPU) across several
        GPUs, ``main_gpu`` the GPU used with split mode none. The values are kept as attributes."""
        self.ptr = None
        self._users = 0  # open contexts / grammar samplers that use the native model
        self._pending_free = None  # the native pointer, once closed while users remain
        self._lifetime_lock = threading.RLock()  # RLock: a finalizer may run while this thread holds it
        self.rpc_servers: tuple[str, ...] = ()
        #: llama_context_params fields the engine's target context of this model gets (``rope_freq_base``,
        #: ``rope_freq_scale``: llama_cpp.Llama's arguments; 0 = the model's own)
        self.context_params: dict = {}
        backend_init()
        self.path = Path(path)
        _check_gguf_magic(self.path)
        ts = check_offload(n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, split_mode=split_mode, tensor_split=tensor_split)
        servers = rpc.parse_servers(rpc_servers) if rpc_servers else ()  # None / [] = local
        #: the RPC devices the model was loaded on (empty: local)
        self.rpc_devices: tuple[rpc.Device, ...] = tuple(rpc.devices(servers)) if servers and not vocab_only else ()
        params = native.llama_model_default_params()
        if n_gpu_layers is not None:
            params.n_gpu_layers = n_gpu_layers
        if main_gpu is not None:
            params.main_gpu = main_gpu
        if split_mode is not None:
            params.split_mode = SPLIT_MODES[split_mode]
        # (llama.cpp reads the tensor_split and devices arrays while it loads: locals, alive until __init__ returns)
        if ts is not None:
            ts_buf = (ctypes.c_float * max_devices())(*ts)
            params.tensor_split = ts_buf
        #: what llama.cpp was asked for (attributes, for reports and tests)
        self.n_gpu_layers: int = int(params.n_gpu_layers)
        self.main_gpu: int = int(params.main_gpu)
        self.split_mode: str = next((k for k, v in SPLIT_MODES.items() if v == params.split_mode), str(params.split_mode))
        self.tensor_split: tuple[float, ...] | None = ts
        if self.rpc_devices and n_gpu_layers == 0:
            log.warning("RPC servers given with -ngl 0: no layer of %s is offloaded, the servers hold nothing", self.path.name)
        if (n_gpu_layers or 0) > 0 and not vocab_only and not supports_gpu_offload():
            _warn_no_gpu_once()
        if not use_mmap:  # this llama.cpp has load_mode (no use_mmap field: assigning one is silently ignored)
            params.load_mode = native.LLAMA_LOAD_MODE_NONE
        params.vocab_only = vocab_only
        params.use_extra_bufts = use_extra_buffers()
        if hasattr(params, "load_mtp"):
            params.load_mtp = load_mtp
        #: loaded with its MTP (nextn) blocks: an MTP context on a model without them aborts llama.cpp
        self.load_mtp: bool = bool(load_mtp)
        if self.rpc_devices:
            dev_buf = rpc.device_array(list(self.rpc_devices) + rpc.local_gpu_devices())
            params.devices = ctypes.cast(dev_buf, ctypes.c_void_p).value
        _forget_native_errors()
        # over the network on the RPC worker (a server that dies must not abort us)
        ptr = (rpc.call(native.llama_model_load_from_file, str(self.path).encode("utf-8"), params,
                        what=f"loading {self.path.name}") if self.rpc_devices
               else native.llama_model_load_from_file(str(self.path).encode("utf-8"), params))
        if not ptr:
            why = _last_native_error("llama.cpp could not load it")
            raise ModelFormatError(f"failed to load model {self.path}: {why}")
        self.ptr = ptr
        if self.rpc_devices:
            self.rpc_servers = servers
            rpc.acquire(servers)
        self.vocab = Vocab(self)
        self.arch: str = self.meta("general.architecture") or "unknown"
        self.name: str = self.meta("general.name") or self.path.stem
        self.vocab_only = vocab_only
        self.use_mmap = use_mmap
        # a vocab-only model has no hyper-parameters: llama.cpp aborts when asked for them
        #: ``n_layer``, ``n_embd``, ``n_embd_out``, ``n_layer_nextn``, ``n_ctx_train``, ``n_swa``, ``n_params`` (ints) and
        #: ``is_recurrent``, ``is_hybrid``, ``has_encoder`` (bools): ``llama_model_<name>``, 0 / False when vocab-only
        for k in ("n_layer", "n_embd", "n_embd_out", "n_layer_nextn", "n_ctx_train", "n_swa", "n_params",
                  "is_recurrent", "is_hybrid", "has_encoder"):
            v = 0 if vocab_only else int(getattr(native, f"llama_model_{k}")(ptr))
            setattr(self, k, bool(v) if k.startswith(("is_", "has_")) else v)

    def live_ptr(self):
        """The native ``llama_model *``; :class:`LlamaSpecError` when the model is closed."""
        ptr = self.ptr
        if not ptr:
            raise LlamaSpecError(f"model {self.path.name} is closed")
        return ptr

    # -- metadata -------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """Metadata value as a string (``llama_model_meta_val_str``), or None when the key is absent."""
        ptr = self.live_ptr()
        return text_of(lambda b, k: native.llama_model_meta_val_str(ptr, key.encode("utf-8"), b, k))

    @property
    def is_swa(self) -> bool:
        return self.n_swa > 0

    def chat_template(self) -> str | None:
        """The model's default chat template (``tokenizer.chat_template``), or None; see :mod:`llamaspec.chat`."""
        t = native.llama_model_chat_template(self.live_ptr(), None)
        return t.decode("utf-8", errors="replace") if t else None

    # -- lifetime -------------------------------------------------------------------------------
    def _acquire(self) -> None:
        """Register a user (context, grammar sampler) that needs the native model until it releases it.

        Also allowed after ``close()`` while other users keep the native model (cloning a grammar sampler).
        """
        with self._lifetime_lock:
            if not (self.ptr or self._pending_free):
                self.live_ptr()  # raises
            self._users += 1

    def _release(self) -> None:
        ptr = None
        with self._lifetime_lock:
            self._users -= 1
            if self._users == 0:
                ptr, self._pending_free = self._pending_free, None
        if ptr:
            self._free(ptr)

    def _free(self, ptr) -> None:
        if self.rpc_servers:  # freeing sends to the servers: guarded; left allocated when one failed
            rpc.call_or_leak(native.llama_model_free, ptr, what=f"freeing {self.path.name}")
            rpc.release(self.rpc_servers)
        else:
            native.llama_model_free(ptr)

    def close(self) -> None:
        """Close the model; the native free waits for the contexts and samplers still using it."""
        lock = getattr(self, "_lifetime_lock", None)
        if lock is None:  # __init__ did not get far
            return
        with lock:
            ptr, self.ptr = self.ptr, None
            if ptr and self._users:
                self._pending_free, ptr = ptr, None
        if ptr:
            self._free(ptr)

    def __repr__(self) -> str:
        return f"Model({self.path.name!r}, arch={self.arch}, n_layer={self.n_layer}, n_embd={self.n_embd})"


# ---------------------------------------------------------------------------------------------------
# Built-in chat templates (the Jinja fallback lives in llamaspec.chat)
# ---------------------------------------------------------------------------------------------------


def render_builtin_chat_template(template: str, messages: list[dict[str, str]], *, add_assistant: bool = True) -> str | None:
    """Render ``messages`` with llama.cpp's built-in template matcher (``llama_chat_apply_template``);
    None when llama.cpp does not recognise ``template``."""
    tmpl = template.encode("utf-8")
    n = len(messages)
    arr = (native.llama_chat_message * n)()
    keep = []  # the encoded strings must outlive the call
    for i, m in enumerate(messages):
        role, content = m["role"].encode("utf-8"), m["content"].encode("utf-8")
        keep += [role, content]
        arr[i].role = role
        arr[i].content = content
    return text_of(lambda b, k: native.llama_chat_apply_template(tmpl, arr, n, add_assistant, b, k),
                   4096 + sum(len(m["content"]) for m in messages) * 2)
