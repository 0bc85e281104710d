"""The ``llama-ext.h`` functions the same-trunk draft heads need (MTP, EAGLE-3, DFlash/DSpark), §12.2.

``llama-ext.h`` is llama.cpp's staging header: its functions have C++ linkage, so a shared build exports them
under mangled names. Each one is bound on llama-cpp-python's library handle by the first name that exists:
the plain C name, the Itanium (Linux / macOS) name, the MSVC name. llama-cpp-python's own
``llama_cpp.llama_cpp_ext`` binds five of them (the nextn / ctx_other ones); those are reused when that module
imports. Everything is feature-detected: :func:`missing` lists what the loaded library lacks, :func:`require`
checks a drafter's needs up front, and calling a missing function raises :class:`UsageError` naming it.

Wrappers (take a :class:`Context` / :class:`Model`; return numpy *copies*):

* :func:`set_embeddings_nextn`, :func:`get_embeddings_nextn`, :func:`get_embeddings_nextn_ith` - the nextn
  hidden state (input of the MTP head; width ``model.n_embd_out``). ``masked=False`` keeps one row per batch
  row (index = raw batch row), ``masked=True`` one row per output row (index as for logits).
* :func:`set_embeddings_layer_inp`, :func:`get_embeddings_layer_inp` - the input of trunk layer ``lid``
  (EAGLE-3 / DFlash features), ``n_embd`` floats for every row of the last batch, in batch order.
* :func:`set_nextn_layer_offset` - which appended nextn block an MTP context runs (chained heads).
* :func:`get_ctx_other`, :func:`ctx_other_is` - the context linked through ``ctx_other`` (NULL -> None).
* :func:`model_target_layer_ids`, :func:`dflash_selector_top_k` - draft-model metadata.

The native functions abort the process on some bad arguments (``set_embeddings_layer_inp`` with ``lid >
n_layer``, ``get_embeddings_layer_inp`` of a layer that was never extracted); the wrappers check those first.

Batches with embeddings go through :meth:`Context.decode` (``Row(token or None, pos, seq, output,
embd=row)``, ``kind=PROCESS_ENCODE`` for an encoder such as EAGLE-3's), which uses ``llama_batch_ext_add`` /
``add_token`` / ``set_embd_token`` and ``llama_process``; an MTP context is a :class:`Context` created with
``ctx_type=CONTEXT_TYPE_MTP`` on a :class:`Model` loaded with ``load_mtp=True``, and ``Context(...,
ctx_other=target_ctx)`` links a draft to its target.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as native

from ..errors import DecodeError, UsageError

_c_ctx = ctypes.c_void_p
_c_model = ctypes.c_void_p
_f_ptr = ctypes.POINTER(ctypes.c_float)

#: name -> (symbol names to try in order: the C name, the Itanium name, the MSVC name; argtypes, restype)
SPECS: dict[str, tuple[tuple[str, ...], list, Any]] = {row[0]: (row[:3], row[3], row[4]) for row in [
    ("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb",
     "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z", [_c_ctx, ctypes.c_bool, ctypes.c_bool], None),
    ("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context",
     "?llama_get_embeddings_nextn@@YAPEAMPEAUllama_context@@@Z", [_c_ctx], _f_ptr),
    ("llama_get_embeddings_nextn_ith", "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
     "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z", [_c_ctx, ctypes.c_int32], _f_ptr),
    ("llama_set_nextn_layer_offset", "_Z28llama_set_nextn_layer_offsetP13llama_contexti",
     "?llama_set_nextn_layer_offset@@YAXPEAUllama_context@@H@Z", [_c_ctx, ctypes.c_int32], None),
    ("llama_get_ctx_other", "_Z19llama_get_ctx_otherP13llama_context",
     "?llama_get_ctx_other@@YAPEAUllama_context@@PEAU1@@Z", [_c_ctx], ctypes.c_void_p),
    ("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
     "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z", [_c_ctx, ctypes.c_uint32, ctypes.c_bool], None),
    ("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
     "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z", [_c_ctx, ctypes.c_uint32], _f_ptr),
    ("llama_model_target_layer_ids", "_Z28llama_model_target_layer_idsPK11llama_model",
     "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z", [_c_model], ctypes.POINTER(ctypes.c_int32)),
    ("llama_model_target_layer_ids_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
     "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z", [_c_model], ctypes.c_uint32),
    ("llama_model_dflash_selector_top_k", "_Z33llama_model_dflash_selector_top_kPK11llama_model",
     "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z", [_c_model], ctypes.c_int32),
]}

#: what each drafter needs (for :func:`require` / ``llamaspec probe``)
NEEDS: dict[str, tuple[str, ...]] = {
    "draft-mtp": ("llama_set_embeddings_nextn", "llama_get_embeddings_nextn_ith", "llama_set_nextn_layer_offset",
                  "llama_get_ctx_other"),
    "draft-eagle3": ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_set_embeddings_nextn",
                     "llama_get_embeddings_nextn", "llama_get_ctx_other", "llama_model_target_layer_ids",
                     "llama_model_target_layer_ids_n"),
    "draft-dflash": ("llama_set_embeddings_layer_inp", "llama_get_embeddings_layer_inp", "llama_get_embeddings_nextn",
                     "llama_model_target_layer_ids", "llama_model_target_layer_ids_n",
                     "llama_model_dflash_selector_top_k"),
}
NEEDS["draft-dspark"] = NEEDS["draft-dflash"]

#: name -> (the bound function, the symbol it was bound by), or (None, None) where the library lacks it
_bound: dict[str, tuple[Any, str | None]] = {}


@functools.lru_cache(maxsize=1)
def _llama_cpp_ext():
    """llama-cpp-python's own ext module, if it imports (None otherwise)."""
    try:
        from llama_cpp import llama_cpp_ext as mod  # optional module, may fail to import
    except Exception:  # AttributeError when the library lacks one of its symbols; ImportError on old versions
        return None
    return mod


def _bind(name: str):
    if name not in _bound:
        spec = SPECS.get(name)
        if spec is None:
            raise KeyError(f"{name} is not an llama-ext function llamaspec knows")
        names, argtypes, restype = spec
        _bound[name] = (None, None)
        for sym in names:
            f = getattr(native._lib, sym, None)
            if f is None:
                continue
            reuse = getattr(_llama_cpp_ext(), name, None)
            if reuse is not None:
                f = reuse  # the same library handle and names, bound by llama-cpp-python
            else:
                f.argtypes, f.restype = argtypes, restype
            _bound[name] = (f, sym)
            break
    return _bound[name][0]


def available(name: str) -> bool:
    """Whether the loaded libllama exports ``name`` (under any of its names)."""
    return _bind(name) is not None


def missing(names=None) -> list[str]:
    """The functions of ``names`` (default: all of §12.2's ext table) the loaded libllama does not export."""
    return [n for n in (SPECS if names is None else names) if not available(n)]


def symbols() -> dict[str, str | None]:
    """name -> the exported symbol it was bound by (None = missing)."""
    return {n: (_bound[n][1] if available(n) else None) for n in SPECS}


def require(what: str, names=None) -> None:
    """Raise :class:`UsageError` when the library lacks one of ``names`` (default: ``NEEDS[what]``)."""
    gone = missing(NEEDS.get(what, ()) if names is None else names)
    if gone:
        raise UsageError(
            f"{what} needs {', '.join(gone)}, which this llama.cpp build does not export "
            "(install a llama-cpp-python built from a tree that has llama-ext.h)"
        )


def fn(name: str):
    """The bound native function ``name``; :class:`UsageError` when the library lacks it."""
    f = _bind(name)
    if f is None:
        raise UsageError(
            f"{name} is not exported by the loaded libllama: this llama.cpp build lacks it "
            "(the drafter that needs it cannot run with this build)"
        )
    return f


def _copy_rows(p, n_rows: int, width: int) -> np.ndarray:
    return np.ctypeslib.as_array(p, shape=(n_rows * width,)).reshape(n_rows, width).copy()


# -- nextn (MTP) -------------------------------------------------------------------------------------


def set_embeddings_nextn(ctx, value: bool = True, masked: bool = False) -> None:
    """Make ``ctx`` extract the nextn hidden state of every row (``masked=False``) or every output row."""
    fn("llama_set_embeddings_nextn")(ctx.live_ptr(), bool(value), bool(masked))
    ctx._ext_nextn = (bool(value), bool(masked))


def get_embeddings_nextn_ith(ctx, i: int, width: int | None = None) -> np.ndarray:
    """A copy of nextn row ``i`` of the last decode (``width`` defaults to the model's ``n_embd_out``).

    :class:`DecodeError` when there is no such row (llama.cpp logs the reason and returns NULL)."""
    w = int(width) if width is not None else int(ctx.model.n_embd_out)
    if not getattr(ctx, "_ext_nextn", (False,))[0]:
        raise UsageError("nextn embeddings were not enabled on this context (call set_embeddings_nextn first)")
    p = fn("llama_get_embeddings_nextn_ith")(ctx.live_ptr(), int(i))
    if not p:
        raise DecodeError(f"no nextn embedding for row {i} of the last decode (see the llama.cpp log)")
    return np.ctypeslib.as_array(p, shape=(w,)).copy()


def get_embeddings_nextn(ctx, n_rows: int, width: int | None = None) -> np.ndarray:
    """A copy of the first ``n_rows`` nextn rows of the last decode, shape ``(n_rows, width)``."""
    w = int(width) if width is not None else int(ctx.model.n_embd_out)
    p = fn("llama_get_embeddings_nextn")(ctx.live_ptr())
    if not p:
        raise DecodeError("no nextn embeddings (enable them with set_embeddings_nextn before decoding)")
    return _copy_rows(p, int(n_rows), w)


def set_nextn_layer_offset(ctx, offset: int) -> None:
    """Select which appended nextn block (0-based) the MTP graph of ``ctx`` runs."""
    n = int(ctx.model.n_layer_nextn)
    if offset < 0 or (n > 0 and offset >= n):
        raise UsageError(f"nextn layer offset {offset} out of range: the model has {n} nextn layer(s)")
    fn("llama_set_nextn_layer_offset")(ctx.live_ptr(), int(offset))


# -- ctx_other -------------------------------------------------------------------------------------


def get_ctx_other(ctx) -> int | None:
    """The address of the context linked to ``ctx`` through ``ctx_other`` (None when NULL)."""
    v = fn("llama_get_ctx_other")(ctx.live_ptr())
    return (v if v is None or isinstance(v, int) else ctypes.cast(v, ctypes.c_void_p).value) or None


def ctx_other_is(ctx, other) -> bool:
    """Whether ``ctx``'s ``ctx_other`` is ``other`` (MTP: only a gemma4-assistant shares its target's memory)."""
    a = get_ctx_other(ctx)
    return a is not None and a == ctypes.cast(other.live_ptr(), ctypes.c_void_p).value


# -- layer inputs (EAGLE-3 / DFlash features) ---------------------------------------------------------


def set_embeddings_layer_inp(ctx, lid: int, enable: bool = True) -> None:
    """Extract (or stop extracting) the input of layer ``lid`` (``0 <= lid <= n_layer``) on every decode."""
    n_layer = int(ctx.model.n_layer)
    if not 0 <= lid <= n_layer:  # llama.cpp asserts (aborts) here
        raise UsageError(f"layer id {lid} out of range: the target has {n_layer} layers (valid 0..{n_layer})")
    fn("llama_set_embeddings_layer_inp")(ctx.live_ptr(), int(lid), bool(enable))
    on = vars(ctx).setdefault("_ext_layer_inp", {})  # layer -> the decode count when it was enabled
    if enable:
        on[int(lid)] = ctx.n_decodes
    else:
        on.pop(int(lid), None)


def get_embeddings_layer_inp(ctx, lid: int, n_rows: int, width: int | None = None) -> np.ndarray:
    """A copy of layer ``lid``'s input for the first ``n_rows`` rows of the last batch, ``(n_rows, n_embd)``,
    once the layer was enabled before the last decode (llama.cpp aborts otherwise)."""
    since = getattr(ctx, "_ext_layer_inp", {}).get(int(lid))
    if since is None:
        raise UsageError(f"layer {lid} input is not extracted on this context (call set_embeddings_layer_inp first)")
    if ctx.n_decodes <= since:
        raise UsageError(f"layer {lid} input: no decode since extraction was enabled")
    if not 0 < n_rows <= ctx.n_batch:
        raise UsageError(f"n_rows={n_rows} out of range 1..{ctx.n_batch}")
    w = int(width) if width is not None else int(ctx.model.n_embd)
    p = fn("llama_get_embeddings_layer_inp")(ctx.live_ptr(), int(lid))
    if not p:
        raise DecodeError(f"no input of layer {lid} from the last decode")
    return _copy_rows(p, int(n_rows), w)


# -- draft-model metadata ----------------------------------------------------------------------------


def model_target_layer_ids(model) -> list[int]:
    """The target layers an EAGLE-3 / DFlash draft reads (``[]`` when the model has none)."""
    mp = model.live_ptr()
    n = int(fn("llama_model_target_layer_ids_n")(mp))
    p = fn("llama_model_target_layer_ids")(mp) if n else None
    return [int(p[i]) for i in range(n)] if p else []


def dflash_selector_top_k(model) -> int:
    """DFlash2 selector top-k of a dflash draft (0 when it has no selector)."""
    return int(fn("llama_model_dflash_selector_top_k")(model.live_ptr()))


__all__ = [
    "NEEDS",
    "SPECS",
    "available",
    "ctx_other_is",
    "dflash_selector_top_k",
    "fn",
    "get_ctx_other",
    "get_embeddings_layer_inp",
    "get_embeddings_nextn",
    "get_embeddings_nextn_ith",
    "missing",
    "model_target_layer_ids",
    "require",
    "set_embeddings_layer_inp",
    "set_embeddings_nextn",
    "set_nextn_layer_offset",
    "symbols",
    "set_causal_attn",
    "vocab_mask",
]


# -- DFlash / DSpark helpers (added by the EAGLE-3 / DFlash drafters; plain llama.h functions) ----------


def set_causal_attn(ctx, causal: bool) -> None:
    """``llama_set_causal_attn``: DFlash drafts run their block non-causally unless the head says otherwise."""
    native.llama_set_causal_attn(ctx.live_ptr(), bool(causal))


def vocab_mask(model) -> int:
    """``llama_vocab_mask`` of ``model`` (GGUF ``tokenizer.ggml.mask_token_id``; -1 when unset)."""
    return int(native.llama_vocab_mask(model.vocab.ptr))
