"""Staging (non-C, ``llama-ext.h``) symbols of libllama, bound by exported name (§12.2).

llama-cpp-python has no bindings for them; each is looked up lazily (plain C name first, then the
Itanium / MSVC mangled C++ names) and feature-detected: ``staging.available(name)`` says whether the
loaded library exports it, and calling a missing one raises :class:`LlamaSpecError`.
"""
from __future__ import annotations

import ctypes

from llama_cpp import llama_cpp as native

from ..errors import LlamaSpecError
from .model import Model

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
        lib = native._lib
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
    ptr = model.live_ptr()
    n = int(staging.llama_model_target_layer_ids_n(ptr))
    if n == 0:
        return []
    p = staging.llama_model_target_layer_ids(ptr)
    return [int(p[i]) for i in range(n)] if p else []
