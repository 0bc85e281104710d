"""Derived models: a GGUF made from another one, dequantized to F32/F16 or cut to its first K layers.

The source's header is read with ``gguf_io.open_gguf`` (see there why not ``gguf.GGUFReader``); its
metadata records are copied byte for byte, with the few that change packed here (``_string``,
``_kv_u32``, ``_kv_array``, ``_tensor_info``), and its tensor data is streamed a slice of rows at a
time, dequantized with ``gguf.quants.dequantize``, into the cache's atomic, hashing output.
``gguf.GGUFWriter`` is not used: it writes each tensor whole, from memory, into a file it opens
itself, and a dequantized tensor is large (gemma3-270m's F32 token embedding: 262144 x 640 x 4 B =
671 MB).
"""
from __future__ import annotations

import functools
import os
import re
import struct
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import FetchError
from .cache import CHUNK, HashingWriter, ProgressFn
from .gguf_io import T_ARRAY, T_STRING, KV, Layout, NewTensor, TensorInfo, kv_u32, open_gguf, string, write_gguf
from .registry import DeriveSpec

#: bump when the bytes a derivation writes change, so old cached derived files are redone
DERIVE_FORMAT_VERSION = 1

_LLAMA_FTYPE = {"F32": 0, "F16": 1}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16
# ggml types (gguf.GGMLQuantizationType)
_F32, _F16 = 0, 1
_KEEP_AS_IS = {_F32, 24, 25, 26, 27, 28}  # F32, I8, I16, I32, I64, F64


def _kv_array(kv: KV, buf: Any, n: int) -> bytes:
    """The scalar array ``kv`` cut to its first ``n`` items (their bytes as in the file)."""
    item = (kv.end - kv.items) // kv.count
    return string(kv.key) + struct.pack("<IIQ", T_ARRAY, kv.subtype, n) + bytes(buf[kv.items:kv.items + n * item])


def _plan_truncate(lay: Layout, buf: Any, srcp: Path, arch: str, n_layer: int) -> tuple[list[TensorInfo], dict[str, bytes]]:
    """The tensors to keep and the metadata records to replace for the first ``n_layer`` layers."""
    n_orig = lay.get(f"{arch}.block_count")
    if not isinstance(n_orig, int):
        raise FetchError(f"cannot truncate {srcp}: no {arch}.block_count in its metadata")
    if n_layer >= n_orig:
        raise FetchError(f"cannot truncate {srcp} to {n_layer} layers: it has only {n_orig}")
    nextn = lay.get(f"{arch}.nextn_predict_layers")
    if isinstance(nextn, int) and nextn > 0:
        raise FetchError(f"cannot truncate {srcp}: it has {nextn} next-token-prediction (MTP) layers at the end")
    blk = re.compile(r"^blk\.(\d+)\.")
    keep = [t for t in lay.tensors if not (m := blk.match(t.name)) or int(m.group(1)) < n_layer]
    replace = {f"{arch}.block_count": kv_u32(f"{arch}.block_count", n_layer)}
    for kv in lay.kvs:  # per-layer arrays
        if kv.key.startswith(arch + ".") and kv.vtype == T_ARRAY and kv.subtype != T_STRING and kv.count == n_orig:
            replace[kv.key] = _kv_array(kv, buf, n_layer)
    return keep, replace


def _out_type(t: TensorInfo, out_type: str) -> int:
    """The type of ``t`` dequantized to ``out_type``: F32 and integer tensors stay as they are, 1-D
    tensors become F32, the rest ``out_type``."""
    if t.ggml_type in _KEEP_AS_IS:
        return t.ggml_type
    return _F32 if out_type == "F32" or len([d for d in t.ne if d > 1]) <= 1 else _F16


def derive_gguf(
    src: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    spec: DeriveSpec,
    *,
    progress: Optional[ProgressFn] = None,
    stage: str = "derive",
) -> str:
    """Write ``dest`` made from the GGUF ``src`` by ``spec``; return the sha256 of what was written.

    dequantize: every quantized (and F16/BF16) tensor becomes ``spec.type`` (F32 or F16), 1-D tensors
    are F32; metadata is copied (``general.file_type`` updated). truncate_layers: keeps ``blk.i`` for
    i < n_layer, sets ``<arch>.block_count`` and cuts per-layer metadata arrays. Tensor data is
    streamed a slice of rows at a time, so memory stays small. Raises FetchError on failure, with
    no file left behind.
    """
    srcp = Path(src)
    with open_gguf(srcp) as (lay, buf):
        if lay.endian != "<":
            raise FetchError(f"cannot derive from {srcp}: big-endian GGUF files are not supported")
        unknown = [t.name for t in lay.tensors if t.nbytes is None]
        if unknown:
            raise FetchError(f"cannot derive from {srcp}: tensor types this `gguf` package does not know ({unknown[0]}, ...); upgrade gguf")
        arch = lay.get("general.architecture")
        if not isinstance(arch, str):
            raise FetchError(f"cannot derive from {srcp}: it has no general.architecture")
        drop: set[str] = set()
        if spec.op == "truncate_layers":
            assert spec.n_layer is not None
            keep, replace = _plan_truncate(lay, buf, srcp, arch, spec.n_layer)
            out_types = {t.name: t.ggml_type for t in keep}
        else:
            keep = lay.tensors
            out_types = {t.name: _out_type(t, spec.type or "F32") for t in keep}
            replace = {"general.file_type": kv_u32("general.file_type", _LLAMA_FTYPE[spec.type or "F32"])}
            drop.add("general.quantization_version")
        # metadata: the source's records, with replacements; then the keys the source does not have
        kv_blobs = [replace.pop(kv.key, None) or bytes(buf[kv.start:kv.end]) for kv in lay.kvs if kv.key not in drop]
        kv_blobs.extend(replace.values())
        return write_gguf(Path(dest), lay, kv_blobs, [(t, t.ne, out_types[t.name]) for t in keep],
                          functools.partial(_copy_tensor, buf, lay.data_start), f"deriving {Path(dest).name}",
                          progress, stage)


def _copy_tensor(buf: Any, data_start: int, nt: NewTensor, out: HashingWriter, tick: Callable[[], None]) -> None:
    """Write tensor ``nt`` (its data in ``buf`` from ``data_start``) to ``out`` as its new type, a slice of rows
    at a time."""
    import numpy as np
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    t, _, out_type = nt
    assert t.nbytes is not None
    raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=data_start + t.offset)
    if out_type == t.ggml_type:
        for i in range(0, t.nbytes, 16 * CHUNK):
            out.write(raw[i:i + 16 * CHUNK].tobytes())
        tick()
        return
    ne0 = t.ne[0] if t.ne else 1
    n_rows = t.n_elements // ne0 if ne0 else 0
    block, size = GGML_QUANT_SIZES[t.ggml_type]
    rows = raw.reshape(n_rows, ne0 // block * size)
    qtype = GGMLQuantizationType(t.ggml_type)
    step = max(1, (4 << 20) // max(1, ne0))  # ~4M values per slice
    odt = np.float32 if out_type == _F32 else np.float16
    for r0 in range(0, n_rows, step):
        try:
            vals = dequantize(np.ascontiguousarray(rows[r0:r0 + step]), qtype)
        except NotImplementedError as e:
            raise FetchError(f"cannot dequantize {qtype.name} tensors: {e}") from e
        out.write(np.ascontiguousarray(vals, dtype=odt).tobytes())
        tick()
