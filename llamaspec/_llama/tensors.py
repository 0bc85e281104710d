"""Writing a loaded model's weights: ``model_tensors`` finds a model's tensors by name, ``set_tensor`` copies
bytes into one (``ggml_backend_tensor_set``: any backend, CPU repacked buffers included).

llama.h has no tensor lookup; llama.cpp exports ``llama_internal_get_tensor_map`` (C++: a reference to a
``std::vector<std::pair<std::string, ggml_tensor *>>``). It is read here for libstdc++'s layout only (the
mangled name carries the ``cxx11`` string ABI: a vector is three pointers, a pair is a 32-byte string then
the pointer), and every entry is checked against ``ggml_get_name`` of its tensor: any other layout, or a
library without the symbol, gives ``None`` and the caller does without. Used by
``drafters.vocab_slots`` (a trimmed draft's run-time vocabulary rows).
"""
from __future__ import annotations

import ctypes
import functools
import types
from typing import TYPE_CHECKING, Optional

import llama_cpp.llama_cpp as native

if TYPE_CHECKING:
    import numpy as np

_MAP_SYMBOL = "_Z29llama_internal_get_tensor_mapB5cxx11PK11llama_model"
_PAIR_SIZE, _STR_SIZE = 40, 32


@functools.lru_cache(maxsize=1)
def _functions() -> types.SimpleNamespace:
    """The native functions this module calls, bound on libllama / libggml (each None where none exports it)."""
    from .rpc_ggml import bind, ggml_libraries

    libs = [native._lib, *ggml_libraries()]
    return types.SimpleNamespace(
        tensor_map=bind(libs, _MAP_SYMBOL, ctypes.c_void_p, [ctypes.c_void_p]),
        tensor_set=bind(libs, "ggml_backend_tensor_set", None,
                        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
        nbytes=bind(libs, "ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
        get_name=bind(libs, "ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]))


def model_tensors(model_ptr: int) -> Optional[list[tuple[str, int]]]:
    """``(name, ggml_tensor *)`` of every tensor of a loaded model (a tied output appears twice under the
    embedding's name), or None where this library's tensor map cannot be read safely."""
    f = _functions()
    if any(fn is None for fn in vars(f).values()):
        return None
    vec = f.tensor_map(model_ptr)
    if not vec:
        return None
    begin, end = (ctypes.c_void_p * 3).from_address(vec)[:2]
    if not begin or not end or end < begin or (end - begin) % _PAIR_SIZE:
        return None
    out = []
    for addr in range(begin, end, _PAIR_SIZE):
        sptr, slen = ctypes.c_void_p.from_address(addr).value, ctypes.c_size_t.from_address(addr + 8).value
        tensor = ctypes.c_void_p.from_address(addr + _STR_SIZE).value
        if not sptr or not tensor or slen > 256:
            return None
        name = ctypes.string_at(sptr, slen)
        if f.get_name(tensor) != name:  # the layout is not what this reads
            return None
        out.append((name.decode("utf-8", "replace"), tensor))
    return out


def tensor_nbytes(tensor: int) -> int:
    return int(_functions().nbytes(tensor))


def set_tensor(tensor: int, data: "np.ndarray", offset: int = 0) -> None:
    """Copy the bytes of the C-contiguous array ``data`` into ``tensor`` at byte ``offset`` (the caller keeps
    the model unused meanwhile; a repacked CPU buffer takes only whole tensors)."""
    if not data.flags.c_contiguous:
        raise ValueError("set_tensor needs a C-contiguous array")
    _functions().tensor_set(tensor, data.ctypes.data, offset, data.nbytes)
