"""ggml's backend registry, bound by name with ctypes on the library llama_cpp loaded (llama-cpp-python binds
none of it): what :mod:`llamaspec._llama.rpc` needs of ggml.

Part of :mod:`llamaspec._llama.rpc` (use that module).
"""
from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from llama_cpp import llama_cpp as native

from ..errors import RpcError, UsageError

BUILD_HINT = ("build llama.cpp with RPC (scripts/build_llama_cpp.sh --rpc) and point llama-cpp-python at it: "
              "export LLAMA_CPP_LIB_PATH=$PWD/native/lib")

#: one lock for the process-wide RPC set-up: the ggml binding, the worker and abort hook, server
#: registrations and the connection counts
setup_lock = threading.RLock()


def supported() -> bool:
    """Whether the loaded llama.cpp library has the RPC backend (``llama_supports_rpc``)."""
    return bool(native.llama_supports_rpc())


def library_dir() -> Path:
    """The directory of the libllama that llama_cpp loaded (libggml*.so sit next to it)."""
    return Path(native._lib._name).resolve().parent


def ggml_libraries() -> list[ctypes.CDLL]:
    """libggml and libggml-base next to libllama (already loaded by it: the same handles)."""
    libs = []
    for stem in ("libggml", "libggml-base"):
        for suffix in (".so", ".dylib", ".dll"):
            p = library_dir() / f"{stem}{suffix}"
            if p.exists():
                libs.append(ctypes.CDLL(str(p)))
                break
    return libs


def bind(libs, name: str, res, args):
    """The first of ``libs`` that exports ``name``, bound with ``res`` / ``args`` (None: none does)."""
    for lib in libs:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = res, args
            return fn
    return None


class _Ggml:
    """ggml functions llama-cpp-python does not bind, looked up in libggml / libggml-base next to libllama."""

    _SIGS = {
        "ggml_backend_reg_by_name": (ctypes.c_void_p, [ctypes.c_char_p]),
        "ggml_backend_reg_get_proc_address": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
        "ggml_backend_reg_dev_count": (ctypes.c_size_t, [ctypes.c_void_p]),
        "ggml_backend_reg_dev_get": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
        "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
        "ggml_backend_dev_description": (ctypes.c_char_p, [ctypes.c_void_p]),
        "ggml_backend_dev_memory": (None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                           ctypes.POINTER(ctypes.c_size_t)]),
        "ggml_backend_dev_count": (ctypes.c_size_t, []),
        "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
        "ggml_backend_dev_type": (ctypes.c_int, [ctypes.c_void_p]),
        "ggml_set_abort_callback": (ctypes.c_void_p, [ctypes.c_void_p]),
    }

    def __init__(self) -> None:
        libs = ggml_libraries()
        missing = []
        for name, (res, args) in self._SIGS.items():
            fn = bind(libs, name, res, args)
            if fn is None:
                missing.append(name)
            setattr(self, name, fn)
        if missing:
            raise RpcError(f"the ggml library in {library_dir()} lacks {', '.join(missing)}: cannot use RPC with it; {BUILD_HINT}")


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    """The bound ggml functions; :class:`UsageError` (one line, how to build with RPC) without RPC."""
    global _ggml
    with setup_lock:
        if _ggml is None:
            if not supported():
                raise UsageError(f"this llama.cpp library ({library_dir()}) was built without RPC: {BUILD_HINT}")
            _ggml = _Ggml()
        return _ggml

