"""Reading GGUF files: ``check_gguf_file`` (is it a complete GGUF file?), ``gguf_summary`` and
``open_gguf`` (the layout of the header, for ``derive``), without loading the tensor data.

The header is walked here, not with ``gguf.GGUFReader``, for two measured reasons:

* speed: GGUFReader builds numpy views for every item of every metadata array (the vocabulary). On
  the models of models.toml (2 shared cores) it took 19.0 s on gemma3-270m F32 (262k tokens) and
  5.2 s on SmolLM2-135M Q4_1 (49k), where this walk takes 0.2-0.3 s and 0.06-0.14 s; dequantizing
  gemma3-270m Q4_K_M to F32 took 43.8 s reading through GGUFReader, 8-13 s with this walk (same
  bytes out). The check runs on every model given as a path.
* diagnostics: on a file cut short GGUFReader raises whatever numpy meets first (``ValueError:
  cannot reshape array of size 8142 into shape (128,64)``, ``IndexError: index 0 is out of bounds``)
  and knows no lengths; here it is one line, ``X is truncated: expected at least N bytes, found M``.

Tensor sizes, type names and dequantization come from the ``gguf`` package.
"""
from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import struct
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from ..errors import FetchError, ModelFormatError

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# metadata value types (gguf.GGUFValueType) and the struct format of the scalar ones
T_UINT32, T_STRING, T_ARRAY = 4, 8, 9
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclasses.dataclass
class KV:
    key: str
    vtype: int
    start: int  #: offset of the record (the key's length field)
    end: int  #: offset just past the value
    value: Any = None  #: scalars and strings (arrays are not decoded)
    subtype: Optional[int] = None  #: arrays: the item type
    count: int = 0  #: arrays: the number of items
    items: int = 0  #: arrays of scalars: offset of the first item


@dataclasses.dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]  #: ggml order (ne[0] is the row length)
    ggml_type: int
    offset: int  #: relative to the data section
    nbytes: Optional[int]  #: None for a type this gguf package does not know

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


@dataclasses.dataclass
class Layout:
    version: int
    endian: str  #: "<" or ">"
    kvs: list[KV]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int
    required_size: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        for kv in self.kvs:
            if kv.key == key:
                return kv.value
        return default


class _Truncated(Exception):
    def __init__(self, need: int):
        self.need = need


def _parse(name: str, buf: Any, file_size: int) -> Layout:
    if file_size < 4 or bytes(buf[:4]) != _MAGIC:
        head = bytes(buf[:8])
        shown = repr(head) if head else "nothing: the file is empty"
        raise ModelFormatError(f"{name} is not a GGUF file (starts with {shown})")
    if file_size < 24:
        raise ModelFormatError(f"{name} is truncated: expected at least 24 bytes, found {file_size}")
    (version,) = struct.unpack_from("<I", buf, 4)
    e = "<"
    if version & 0xFFFF == 0 and version != 0:
        e = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ModelFormatError(f"{name}: GGUF version {version} is not supported (llama.cpp reads versions 2 and 3)")
    n_tensors, n_kv = struct.unpack_from(e + "QQ", buf, 8)
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ModelFormatError(f"{name} has a corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
    pos = 24

    def take(n: int) -> int:  # skip n bytes; the offset where they start
        nonlocal pos
        if pos + n > file_size:
            raise _Truncated(pos + n)
        pos += n
        return pos - n

    def scalar(t: int) -> Any:
        fmt = e + _SCALAR_FMT[t]
        return struct.unpack_from(fmt, buf, take(struct.calcsize(fmt)))[0]

    def string() -> str:
        n = scalar(10)
        if n > 1 << 32:
            raise ModelFormatError(f"{name} has a corrupt GGUF string length at offset {pos - 8}")
        at = take(n)
        return bytes(buf[at:at + n]).decode("utf-8", errors="replace")

    from gguf.constants import GGML_QUANT_SIZES

    kvs: list[KV] = []
    tensors: list[TensorInfo] = []
    try:
        for _ in range(n_kv):
            start = pos
            kv = KV(string(), scalar(T_UINT32), start, 0)
            if kv.vtype == T_ARRAY:
                kv.subtype, kv.count = scalar(T_UINT32), scalar(10)
                if kv.subtype in _SCALAR_FMT:
                    kv.items = take(struct.calcsize(_SCALAR_FMT[kv.subtype]) * kv.count)
                elif kv.subtype == T_STRING:
                    for _ in range(kv.count):
                        take(scalar(10))
                else:
                    raise ModelFormatError(f"{name} has an unsupported GGUF array type {kv.subtype} for {kv.key}")
            elif kv.vtype == T_STRING:
                kv.value = string()
            elif kv.vtype in _SCALAR_FMT:
                kv.value = scalar(kv.vtype)
            else:
                raise ModelFormatError(f"{name} has an unknown GGUF metadata type {kv.vtype} at offset {pos - 4}")
            kv.end = pos
            kvs.append(kv)
        for _ in range(n_tensors):
            tname = string()
            nd = scalar(T_UINT32)
            if nd > 8:
                raise ModelFormatError(f"{name}: tensor {tname} has {nd} dimensions (corrupt header)")
            t = TensorInfo(tname, tuple(scalar(10) for _ in range(nd)), scalar(T_UINT32), scalar(10), None)
            if t.ggml_type in GGML_QUANT_SIZES:
                block, size = GGML_QUANT_SIZES[t.ggml_type]
                t.nbytes = t.n_elements * size // block
            tensors.append(t)
    except _Truncated as cut:
        raise ModelFormatError(
            f"{name} is truncated: expected at least {cut.need} bytes, found {file_size} (the header is cut off)"
        ) from None
    alignment = next((kv.value for kv in kvs if kv.key == "general.alignment" and kv.vtype == T_UINT32), 0)
    alignment = alignment or _DEFAULT_ALIGNMENT
    data_start = (pos + alignment - 1) // alignment * alignment
    required = max((data_start + t.offset + t.nbytes for t in tensors if t.nbytes is not None), default=data_start)
    return Layout(version, e, kvs, tensors, alignment, data_start, required, file_size)


@contextlib.contextmanager
def open_gguf(path: str | os.PathLike[str]) -> Iterator[tuple[Layout, Any]]:
    """The layout of a complete GGUF file and the file mapped read-only (for the tensor data);
    ModelFormatError (one line) when it is missing, not GGUF, or truncated."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file")
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, not a GGUF file")
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open(p, "rb"))
            size = os.fstat(f.fileno()).st_size
            buf: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as e:
            raise ModelFormatError(f"could not read {p}: {e.strerror or e}") from None
        if size:
            stack.callback(_close_map, buf)
        layout = _parse(str(p), buf, size)
        if size < layout.required_size:
            raise ModelFormatError(f"{p} is truncated: expected at least {layout.required_size} bytes, found {size}")
        yield layout, buf


def _close_map(buf: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a numpy view still alive (e.g. in a traceback): the GC closes it
        buf.close()


def check_gguf_file(path: str | os.PathLike[str]) -> None:
    """Raise ModelFormatError unless ``path`` is a complete GGUF file.

    Checks the magic, the version, that the metadata and tensor infos parse, and that the file is
    long enough to hold every tensor's data.
    """
    with open_gguf(path):
        pass


def string(s: str | bytes) -> bytes:
    """A GGUF string: its length (u64), then its UTF-8 bytes."""
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, value: int) -> bytes:
    """A GGUF metadata record ``key = value`` (u32)."""
    return string(key) + struct.pack("<II", T_UINT32, value)


#: what :func:`write_gguf` writes per tensor: the source tensor, its shape and its ggml type in the new file
NewTensor = tuple[TensorInfo, tuple[int, ...], int]


def write_gguf(dest: Path, lay: Layout, kv_blobs: list[bytes], tensors: list[NewTensor],
               write_data: Callable[[NewTensor, Any, Callable[[], None]], None], what: str,
               progress: Optional[Callable[[str, int, Optional[int]], None]], stage: str) -> str:
    """Write the GGUF v3 file ``dest`` (atomically, through ``cache.cache_output``): the metadata records
    ``kv_blobs`` (encoded), the infos of ``tensors``, then each tensor's data, aligned as in ``lay``, which
    ``write_data(tensor, out, tick)`` writes (``tick()`` reports progress). Returns the sha256 of the file;
    FetchError ``internal error {what}: ...`` when the result is not what was planned."""
    from gguf.constants import GGML_QUANT_SIZES

    from .cache import cache_output

    align = lay.alignment
    ti_blobs, total = [], 0
    for t, ne, ggml_type in tensors:
        ti_blobs.append(string(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, ggml_type, total))
        block, size = GGML_QUANT_SIZES[ggml_type]
        n_el = 1
        for d in ne:
            n_el *= d
        total += (n_el * size // block + align - 1) // align * align
    with cache_output(dest) as out:
        out.write(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv_blobs)))
        for b in kv_blobs + ti_blobs:
            out.write(b)

        def pad() -> None:
            r = out.tell() % align
            if r:
                out.write(b"\0" * (align - r))

        pad()
        data_start = out.tell()

        def tick() -> None:
            if progress:
                progress(stage, out.tell() - data_start, total)

        tick()
        for nt in tensors:
            pad()
            write_data(nt, out, tick)
        pad()
        if out.tell() - data_start != total:
            raise FetchError(f"internal error {what}: wrote {out.tell() - data_start} data bytes, expected {total}")
        check_written(out, f"internal error {what}: the result does not parse")
        return out.sha256()


def check_written(out: Any, failure: str) -> None:
    """Flush ``out`` (a ``cache.HashingWriter``) and check the file it wrote: FetchError ``failure: why``
    unless it is a complete GGUF file."""
    out.flush()
    try:
        check_gguf_file(out.path)
    except ModelFormatError as e:
        raise FetchError(f"{failure}: {e}") from e


def type_name(t: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type{t}"


def gguf_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A few facts about a GGUF file (architecture, name, block count, tensor types) without loading it."""
    with open_gguf(path) as (lay, _):
        arch = lay.get("general.architecture")
        types: dict[str, int] = {}
        for t in lay.tensors:
            types[type_name(t.ggml_type)] = types.get(type_name(t.ggml_type), 0) + 1
        return {
            "path": str(path), "size": lay.file_size, "version": lay.version, "architecture": arch,
            "name": lay.get("general.name"), "file_type": lay.get("general.file_type"),
            "block_count": lay.get(f"{arch}.block_count") if arch else None,
            "n_tensors": len(lay.tensors), "tensor_types": types,
        }
