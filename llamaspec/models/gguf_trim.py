"""The GGUF file of a trimmed draft vocabulary: reading a source's tokenizer arrays, the keys a trimmed file
adds, and the writer (:func:`trim_vocab_gguf`). Which tokens to keep is :mod:`.trim_policy`'s; the cached
copy, :mod:`.trim`'s (use that module)."""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..errors import FetchError
from .cache import CHUNK, HashingWriter, ProgressFn
from .gguf_io import T_ARRAY, T_STRING, KV, NewTensor, kv_u32, open_gguf, string, write_gguf

SOURCE_IDS_KEY = "llamaspec.vocab.source_ids"
SOURCE_N_KEY = "llamaspec.vocab.source_n_vocab"
#: the source file (path, size, mtime_ns) whose rows run-time slots copy (``drafters.vocab_slots``)
SOURCE_PATH_KEY = "llamaspec.vocab.source_path"
SOURCE_SIZE_KEY = "llamaspec.vocab.source_size"
SLOT_TEXT = b"<llamaspec_slot_%d>"

#: GGUF value types (int32, float32 arrays)
T_INT32, T_FLOAT32 = 5, 6
#: token types (llama_token_type)
TOK_NORMAL, TOK_UNKNOWN, TOK_CONTROL, TOK_USER, TOK_UNUSED, TOK_BYTE = 1, 2, 3, 4, 5, 6
#: the tensors with one row per token that trimming cuts
VOCAB_TENSORS = ("token_embd.weight", "output.weight")


# --------------------------------------------------------------------------------------------------
# reading the tokenizer arrays
# --------------------------------------------------------------------------------------------------


def _array_start(kv: KV) -> int:
    return kv.start + 8 + len(kv.key.encode("utf-8")) + 4 + 4 + 8


def read_strings(buf: Any, kv: KV) -> list[bytes]:
    pos = _array_start(kv)
    out: list[bytes] = []
    for _ in range(kv.count):
        (n,) = struct.unpack_from("<Q", buf, pos)
        out.append(bytes(buf[pos + 8:pos + 8 + n]))
        pos += 8 + n
    return out


def read_numbers(buf: Any, kv: KV, dtype: Any) -> np.ndarray:
    return np.frombuffer(buf, dtype=dtype, count=kv.count, offset=kv.items).copy()


def source_ids(path: str | os.PathLike[str]) -> Optional[np.ndarray]:
    """The original ids of a trimmed model's tokens (ascending), or None for an ordinary model."""
    with open_gguf(path) as (lay, buf):
        for kv in lay.kvs:
            if kv.key == SOURCE_IDS_KEY and kv.vtype == T_ARRAY and kv.subtype == T_INT32:
                return read_numbers(buf, kv, np.int32).astype(np.int64)
    return None


def is_trimmed(path: str | os.PathLike[str]) -> bool:
    with open_gguf(path) as (lay, _):
        return lay.get(SOURCE_N_KEY) is not None


# --------------------------------------------------------------------------------------------------
# writing the trimmed file
# --------------------------------------------------------------------------------------------------


def _kv_strings(key: str, items: list[bytes]) -> bytes:
    return string(key) + struct.pack("<IIQ", T_ARRAY, T_STRING, len(items)) + b"".join(string(s) for s in items)


def _kv_numbers(key: str, subtype: int, values: np.ndarray) -> bytes:
    dt = {T_INT32: "<i4", T_FLOAT32: "<f4"}[subtype]
    return string(key) + struct.pack("<IIQ", T_ARRAY, subtype, len(values)) + np.asarray(values, dtype=dt).tobytes()


def trim_vocab_gguf(src: str | os.PathLike[str], dest: str | os.PathLike[str], keep_ids: np.ndarray,
                    *, n_slots: int = 0, progress: Optional[ProgressFn] = None, stage: str = "trim") -> str:
    """Write ``dest``: the GGUF ``src`` with only the tokens ``keep_ids`` (ascending original ids), then
    ``n_slots`` free rows (copies of the first kept row, type unused, source id -1) that a drafter fills at
    run time; return the sha256 of what was written. Raises FetchError (no file left behind) on a layout
    it cannot trim."""
    srcp, destp = Path(src), Path(dest)
    keep_ids = np.asarray(keep_ids, dtype=np.int64)
    with open_gguf(srcp) as (lay, buf):
        if lay.endian != "<":
            raise FetchError(f"cannot trim {srcp}: big-endian GGUF files are not supported")
        kvs = {kv.key: kv for kv in lay.kvs}
        if SOURCE_N_KEY in kvs:
            raise FetchError(f"cannot trim {srcp}: its vocabulary is already trimmed")
        n_vocab = kvs["tokenizer.ggml.tokens"].count
        if keep_ids.size == 0 or np.any(np.diff(keep_ids) <= 0) or keep_ids[0] < 0 or keep_ids[-1] >= n_vocab:
            raise FetchError(f"cannot trim {srcp}: the kept ids must be ascending, distinct and below {n_vocab}")
        new_id = np.full(n_vocab, -1, np.int64)
        new_id[keep_ids] = np.arange(keep_ids.size)
        n_new = int(keep_ids.size) + n_slots
        rows_from = np.concatenate([keep_ids, np.full(n_slots, keep_ids[0], np.int64)])  # source row of each new row
        texts = read_strings(buf, kvs["tokenizer.ggml.tokens"])
        kept_text = {texts[i] for i in keep_ids}
        replace: dict[str, bytes] = {}
        for key, kv in kvs.items():
            if key == "tokenizer.ggml.tokens":
                replace[key] = _kv_strings(key, [texts[i] for i in keep_ids] + [SLOT_TEXT % i for i in range(n_slots)])
            elif key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type") and kv.vtype == T_ARRAY:
                if kv.count != n_vocab or kv.subtype not in (T_INT32, T_FLOAT32):
                    raise FetchError(f"cannot trim {srcp}: {key} has {kv.count} items of type {kv.subtype}")
                dt = np.int32 if kv.subtype == T_INT32 else np.float32
                fill = TOK_UNUSED if kv.subtype == T_INT32 else -1e9
                vals = np.concatenate([read_numbers(buf, kv, dt)[keep_ids], np.full(n_slots, fill, dt)])
                replace[key] = _kv_numbers(key, kv.subtype, vals)
            elif key == "tokenizer.ggml.merges" and kv.vtype == T_ARRAY and kv.subtype == T_STRING:
                merges = []
                for m in read_strings(buf, kv):  # a merge stays when both halves and the result stay
                    a, _, b = m.partition(b" ")
                    if a in kept_text and b in kept_text and a + b in kept_text:
                        merges.append(m)
                replace[key] = _kv_strings(key, merges)
            elif key.startswith("tokenizer.ggml.") and key.endswith("_token_id") and isinstance(kv.value, int):
                if 0 <= kv.value < n_vocab and new_id[kv.value] < 0:
                    raise FetchError(f"cannot trim {srcp}: {key} = {kv.value} is not among the kept tokens")
                if 0 <= kv.value < n_vocab:
                    replace[key] = kv_u32(key, int(new_id[kv.value]))
            elif key.endswith(".vocab_size") and isinstance(kv.value, int):
                replace[key] = kv_u32(key, n_new)
        st = srcp.stat()
        extra = [_kv_numbers(SOURCE_IDS_KEY, T_INT32, np.concatenate([keep_ids, np.full(n_slots, -1, np.int64)])),
                 kv_u32(SOURCE_N_KEY, n_vocab),
                 string(SOURCE_PATH_KEY) + struct.pack("<I", T_STRING) + string(str(srcp.resolve())),
                 string(SOURCE_SIZE_KEY) + struct.pack("<IQ", 10, st.st_size)]
        kv_blobs = [replace.get(kv.key) or bytes(buf[kv.start:kv.end]) for kv in lay.kvs] + extra

        # tensors: the vocabulary tensors lose their dropped rows; another per-token matrix outside the
        # blocks is a layout this does not know
        plan: list[NewTensor] = []
        for t in lay.tensors:
            if t.nbytes is None:
                raise FetchError(f"cannot trim {srcp}: tensor {t.name} has a type this `gguf` package does not know; upgrade gguf")
            if t.name in VOCAB_TENSORS and len(t.ne) == 2 and t.ne[1] == n_vocab:
                plan.append((t, (t.ne[0], n_new), t.ggml_type))
            elif not t.name.startswith("blk.") and len(t.ne) == 2 and t.ne[1] == n_vocab and t.ne[0] != n_vocab:
                raise FetchError(f"cannot trim {srcp}: tensor {t.name} {t.ne} has a vocabulary dimension this does not know")
            else:
                plan.append((t, t.ne, t.ggml_type))

        def write_data(nt: NewTensor, out: HashingWriter, tick: Callable[[], None]) -> None:
            t, ne = nt[0], nt[1]
            raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=lay.data_start + t.offset)
            if ne == t.ne:
                for i in range(0, t.nbytes, 16 * CHUNK):
                    out.write(raw[i:i + 16 * CHUNK].tobytes())
            else:  # the kept rows of a vocabulary tensor
                rows = raw.reshape(n_vocab, t.nbytes // n_vocab)
                step = max(1, (16 * CHUNK) // rows.shape[1])
                for i in range(0, n_new, step):
                    out.write(rows[rows_from[i:i + step]].tobytes())
            tick()

        return write_gguf(destp, lay, kv_blobs, plan, write_data, f"trimming {srcp.name}", progress, stage)
