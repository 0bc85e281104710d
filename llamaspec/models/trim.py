"""Draft models with a trimmed vocabulary (beyond llama.cpp; FR-Spec's idea, arXiv 2502.14856).

A small draft model with a large vocabulary spends most of each drafting step on its output layer:
gemma-3-270m's Q8_0 ``token_embd`` (tied output, 262144 x 640) is 72% of the Q4_K_M file, and every
drafted token reads all of it. A draft only has to propose likely tokens, so a copy of the draft whose
vocabulary keeps the ``K`` most frequent tokens drafts the same text for a fraction of the cost; what it
can never propose costs acceptance only where the target would have chosen such a token, and the
target still verifies every token, so greedy output stays the target's.

``trim_vocab_gguf`` writes that copy: the kept rows of ``token_embd`` / ``output``, the kept entries of
the tokenizer arrays, the special ids renumbered, and ``llamaspec.vocab.source_ids`` (the original id of
each kept token, ascending) so the drafter maps ids both ways (``DraftSimple``). Which tokens are kept
(``choose_keep``): the special, byte and user-defined tokens, then the tokens of a fixed English prose +
Python corpus taken from the running interpreter's standard library (``pydoc_data.topics`` and a list of
modules) by frequency, then the rest by the tokenizer's own order (score, else id). The corpus is never a
benchmark prompt.

``trimmed_draft`` is the entry point: it decides whether trimming pays (``trim_pays``), derives the file
once into the model cache and returns its path.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ..errors import FetchError
from .cache import CHUNK, ProgressFn, cache_dir, cache_output, locked
from .gguf_io import T_ARRAY, T_STRING, T_UINT32, KV, Layout, TensorInfo, check_written, open_gguf, write_header

log = logging.getLogger("llamaspec")

SOURCE_IDS_KEY = "llamaspec.vocab.source_ids"
SOURCE_N_KEY = "llamaspec.vocab.source_n_vocab"
#: the source file (path, size, mtime_ns) whose rows run-time slots copy (``drafters.vocab_slots``)
SOURCE_PATH_KEY = "llamaspec.vocab.source_path"
SOURCE_SIZE_KEY = "llamaspec.vocab.source_size"
#: rows at the end of a trimmed vocabulary kept free for tokens met at run time (source id -1)
DEFAULT_SLOTS = 2048
SLOT_TEXT = b"<llamaspec_slot_%d>"
#: bump when the bytes written or the choice of tokens change
TRIM_FORMAT_VERSION = 3
#: characters per piece of the corpus handed to the tokenizer (pieces end at line breaks)
CORPUS_PIECE = 8192
#: the default number of kept tokens
DEFAULT_KEEP = 32768
#: trim only when the draft's vocabulary is at least this many times K and its vocabulary rows
#: (token_embd + output) are at least this share of its weights
MIN_VOCAB_FACTOR = 2
MIN_VOCAB_SHARE = 0.25

# GGUF value types and token types (llama_token_type)
_T_INT32, _T_FLOAT32 = 5, 6
_TOK_NORMAL, _TOK_UNKNOWN, _TOK_CONTROL, _TOK_USER, _TOK_UNUSED, _TOK_BYTE = 1, 2, 3, 4, 5, 6
_VOCAB_TENSORS = ("token_embd.weight", "output.weight")
_UNUSED = re.compile(rb"^<unused\d+>$|^\[unused\d+\]$")
#: standard-library modules whose source is the frequency corpus (code and English docstrings)
_CORPUS_MODULES = ("argparse", "textwrap", "json/__init__", "json/decoder", "json/encoder", "csv", "logging/__init__",
                   "http/server", "email/message", "collections/__init__", "functools", "pathlib", "subprocess",
                   "dataclasses", "string", "calendar", "statistics", "difflib", "heapq", "shutil")


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
            if kv.key == SOURCE_IDS_KEY and kv.vtype == T_ARRAY and kv.subtype == _T_INT32:
                return read_numbers(buf, kv, np.int32).astype(np.int64)
    return None


# --------------------------------------------------------------------------------------------------
# whether to trim, and what to keep
# --------------------------------------------------------------------------------------------------


def vocab_share(lay: Layout) -> tuple[int, float]:
    """(n_vocab, share of the weight bytes in the vocabulary tensors) of a GGUF layout."""
    kvs = {kv.key: kv for kv in lay.kvs}
    tok = kvs.get("tokenizer.ggml.tokens")
    n_vocab = tok.count if tok is not None else 0
    total = sum(t.nbytes or 0 for t in lay.tensors)
    vocab = sum(t.nbytes or 0 for t in lay.tensors if t.name in _VOCAB_TENSORS)
    return n_vocab, (vocab / total if total else 0.0)


#: draft heads (EAGLE-3, DFlash) and MTP drafts read the target's hidden states; they are never trimmed
_NOT_STANDALONE = ("eagle3", "dflash")


def trim_pays(path: str | os.PathLike[str], keep: int = DEFAULT_KEEP, *, asked: bool = False) -> tuple[bool, str]:
    """Whether trimming the draft at ``path`` to ``keep`` tokens pays (``asked``: whether it can), and why."""
    with open_gguf(path) as (lay, _):
        if lay.get(SOURCE_N_KEY) is not None:
            return False, "its vocabulary is already trimmed"
        arch = lay.get("general.architecture")
        if arch in _NOT_STANDALONE or any(kv.key.endswith(".nextn_predict_layers") and kv.value for kv in lay.kvs):
            return False, f"it is a draft head ({arch}), not a standalone draft model"
        n_vocab, share = vocab_share(lay)
        if not any(t.name == "token_embd.weight" and len(t.ne) == 2 and t.ne[1] == n_vocab for t in lay.tensors):
            return False, "it has no token_embd tensor with one row per token"
    if n_vocab <= keep:
        return False, f"its vocabulary has {n_vocab} tokens, not more than {keep}"
    if asked:
        return True, f"keeping {keep} of its {n_vocab} tokens (vocabulary rows are {share:.0%} of its weights)"
    if n_vocab < MIN_VOCAB_FACTOR * keep:
        return False, f"vocabulary of {n_vocab} tokens is less than {MIN_VOCAB_FACTOR}x {keep}"
    if share < MIN_VOCAB_SHARE:
        return False, f"vocabulary rows are {share:.0%} of the weights (< {MIN_VOCAB_SHARE:.0%})"
    return True, f"vocabulary rows are {share:.0%} of the weights; keeping {keep} of {n_vocab} tokens"


def corpus_text() -> str:
    """The frequency corpus: ``pydoc_data.topics`` (the Python reference, English prose) and the source
    of ``_CORPUS_MODULES``, from the running interpreter's standard library (missing files are skipped)."""
    lib = Path(os.__file__).parent
    parts: list[str] = []
    try:
        from pydoc_data.topics import topics

        parts.extend(topics[k] for k in sorted(topics))
    except Exception:  # pragma: no cover - stripped-down Pythons
        pass
    for mod in _CORPUS_MODULES:
        try:
            parts.append((lib / f"{mod}.py").read_text(encoding="utf-8"))
        except OSError:
            continue
    return "\n".join(parts)


def choose_keep(path: str | os.PathLike[str], keep: int, corpus_ids: Optional[np.ndarray] = None) -> np.ndarray:
    """The ids to keep (ascending, ``min(keep, n_vocab)`` of them): special, byte and user-defined tokens
    (not ``<unusedN>``), single-character tokens where there are few of them (a byte-level alphabet),
    then by frequency in ``corpus_ids``, then by the tokenizer's order (score, else id)."""
    with open_gguf(path) as (lay, buf):
        kvs = {kv.key: kv for kv in lay.kvs}
        tok_kv = kvs.get("tokenizer.ggml.tokens")
        if tok_kv is None:
            raise FetchError(f"cannot trim {path}: it has no tokenizer.ggml.tokens")
        texts = read_strings(buf, tok_kv)
        n = len(texts)
        tt_kv, sc_kv = kvs.get("tokenizer.ggml.token_type"), kvs.get("tokenizer.ggml.scores")
        types = read_numbers(buf, tt_kv, np.int32) if tt_kv is not None else np.full(n, _TOK_NORMAL, np.int32)
        scores = read_numbers(buf, sc_kv, np.float32) if sc_kv is not None else None
        specials = [int(kv.value) for k, kv in kvs.items()
                    if k.startswith("tokenizer.ggml.") and k.endswith("_token_id") and isinstance(kv.value, int)]
    forced = np.zeros(n, bool)
    forced[[s for s in specials if 0 <= s < n]] = True
    unused = np.array([_UNUSED.match(t) is not None for t in texts])
    forced |= np.isin(types, (_TOK_UNKNOWN, _TOK_CONTROL, _TOK_USER, _TOK_BYTE)) & ~unused
    single = np.array([len(t.decode("utf-8", "replace")) == 1 for t in texts]) & (types == _TOK_NORMAL)
    if single.sum() <= 1024:
        forced |= single
    order: list[int] = list(np.flatnonzero(forced))
    if len(order) > keep:
        raise FetchError(f"cannot trim {path} to {keep} tokens: {len(order)} special, byte and user-defined tokens must stay; "
                         "use a larger --spec-draft-vocab")
    taken = forced.copy()
    if corpus_ids is not None and corpus_ids.size:
        ids = corpus_ids[(corpus_ids >= 0) & (corpus_ids < n)]
        counts = np.bincount(ids, minlength=n)
        seen = np.flatnonzero(counts > 0)
        seen = seen[np.lexsort((seen, -counts[seen]))]  # most frequent first, ties by id
        seen = seen[~taken[seen] & ~unused[seen]]
        add = seen[:keep - len(order)]
        taken[add] = True
        order.extend(add.tolist())
    if len(order) < keep:
        rest = np.flatnonzero(~taken & ~unused & (types != _TOK_UNUSED))
        if scores is not None:
            rest = rest[np.lexsort((rest, -scores[rest]))]
        order.extend(rest[:keep - len(order)].tolist())
    return np.array(sorted(order), dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# writing the trimmed file
# --------------------------------------------------------------------------------------------------


def _string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv_strings(key: str, items: list[bytes]) -> bytes:
    return _string(key) + struct.pack("<IIQ", T_ARRAY, T_STRING, len(items)) + b"".join(_string(s) for s in items)


def _kv_numbers(key: str, subtype: int, values: np.ndarray) -> bytes:
    dt = {_T_INT32: "<i4", _T_FLOAT32: "<f4"}[subtype]
    return _string(key) + struct.pack("<IIQ", T_ARRAY, subtype, len(values)) + np.asarray(values, dtype=dt).tobytes()


def trim_vocab_gguf(src: str | os.PathLike[str], dest: str | os.PathLike[str], keep_ids: np.ndarray,
                    *, n_slots: int = 0, progress: Optional[ProgressFn] = None, stage: str = "trim") -> str:
    """Write ``dest``: the GGUF ``src`` with only the tokens ``keep_ids`` (ascending original ids), then
    ``n_slots`` free rows (copies of the first kept row, type unused, source id -1) that a drafter fills at
    run time; return the sha256 of what was written. Raises FetchError (no file left behind) on a layout
    it cannot trim."""
    from gguf.constants import GGML_QUANT_SIZES

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
                if kv.count != n_vocab or kv.subtype not in (_T_INT32, _T_FLOAT32):
                    raise FetchError(f"cannot trim {srcp}: {key} has {kv.count} items of type {kv.subtype}")
                dt = np.int32 if kv.subtype == _T_INT32 else np.float32
                fill = _TOK_UNUSED if kv.subtype == _T_INT32 else -1e9
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
                    replace[key] = _string(key) + struct.pack("<II", T_UINT32, int(new_id[kv.value]))
            elif key.endswith(".vocab_size") and isinstance(kv.value, int):
                replace[key] = _string(key) + struct.pack("<II", T_UINT32, n_new)
        st = srcp.stat()
        extra = [_kv_numbers(SOURCE_IDS_KEY, _T_INT32, np.concatenate([keep_ids, np.full(n_slots, -1, np.int64)])),
                 _string(SOURCE_N_KEY) + struct.pack("<II", T_UINT32, n_vocab),
                 _string(SOURCE_PATH_KEY) + struct.pack("<I", T_STRING) + _string(str(srcp.resolve())),
                 _string(SOURCE_SIZE_KEY) + struct.pack("<IQ", 10, st.st_size)]
        kv_blobs = [replace.get(kv.key) or bytes(buf[kv.start:kv.end]) for kv in lay.kvs] + extra

        # tensors: the vocabulary tensors lose their dropped rows; another per-token matrix outside the
        # blocks is a layout this does not know
        plan: list[tuple[TensorInfo, tuple[int, ...], Optional[int]]] = []  # (src tensor, new ne, row bytes)
        for t in lay.tensors:
            if t.nbytes is None:
                raise FetchError(f"cannot trim {srcp}: tensor {t.name} has a type this `gguf` package does not know; upgrade gguf")
            if t.name in _VOCAB_TENSORS and len(t.ne) == 2 and t.ne[1] == n_vocab:
                plan.append((t, (t.ne[0], n_new), t.nbytes // n_vocab))
            elif not t.name.startswith("blk.") and len(t.ne) == 2 and t.ne[1] == n_vocab and t.ne[0] != n_vocab:
                raise FetchError(f"cannot trim {srcp}: tensor {t.name} {t.ne} has a vocabulary dimension this does not know")
            else:
                plan.append((t, t.ne, None))
        align = lay.alignment
        ti_blobs, rel = [], 0
        for t, ne, _row in plan:
            ti_blobs.append(_string(t.name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, t.ggml_type, rel))
            block, size = GGML_QUANT_SIZES[t.ggml_type]
            n_el = int(np.prod(ne, dtype=np.int64))
            rel += (n_el * size // block + align - 1) // align * align
        total = rel
        with cache_output(destp) as out:
            pad = write_header(out, len(plan), kv_blobs, ti_blobs, align)
            data_start = out.tell()
            for t, _ne, row in plan:
                pad()
                raw = np.frombuffer(buf, dtype=np.uint8, count=t.nbytes, offset=lay.data_start + t.offset)
                if row is None:
                    for i in range(0, t.nbytes, 16 * CHUNK):
                        out.write(raw[i:i + 16 * CHUNK].tobytes())
                else:
                    rows = raw.reshape(n_vocab, row)
                    step = max(1, (16 * CHUNK) // row)
                    for i in range(0, n_new, step):
                        out.write(rows[rows_from[i:i + step]].tobytes())
                if progress:
                    progress(stage, out.tell() - data_start, total)
            pad()
            if out.tell() - data_start != total:
                raise FetchError(f"internal error trimming {srcp.name}: wrote {out.tell() - data_start} data bytes, expected {total}")
            check_written(out, f"internal error trimming {srcp.name}: the result does not parse")
            return out.sha256()


# --------------------------------------------------------------------------------------------------
# the cached trimmed draft
# --------------------------------------------------------------------------------------------------


def _corpus_ids(path: Path) -> np.ndarray:
    from .. import _llama as llama

    m = llama.Model(path, vocab_only=True)
    try:
        # in pieces that end at a line break: a SentencePiece vocabulary has no pre-tokenizer, and one 1.3 MB
        # text costs llama.cpp's tokenizer 8 s against 1.3 s in pieces (the same counts up to the seams)
        out: list[int] = []
        for piece in _line_pieces(corpus_text(), CORPUS_PIECE):
            out.extend(m.vocab.tokenize(piece, add_special=False))
        return np.array(out, dtype=np.int64)
    finally:
        m.close()


def _line_pieces(text: str, size: int):
    """``text`` in consecutive pieces of about ``size`` characters, each ending after a line break (or at
    the end).

    >>> list(_line_pieces("ab\ncd\nef", 1)), "".join(_line_pieces("x" * 10, 3))
    (['ab\n', 'cd\n', 'ef'], 'xxxxxxxxxx')
    """
    i, n = 0, len(text)
    while i < n:
        j = text.find("\n", min(i + size, n - 1))
        j = n if j < 0 else j + 1
        yield text[i:j]
        i = j


def _cache_key(srcp: Path, keep: int) -> str:
    st = srcp.stat()
    key = json.dumps([str(srcp), st.st_size, st.st_mtime_ns, keep, TRIM_FORMAT_VERSION,
                      hashlib.sha256(corpus_text().encode("utf-8")).hexdigest()])
    return f"{srcp.stem}.v{keep}.{hashlib.sha256(key.encode('utf-8')).hexdigest()[:16]}.gguf"


def cached_trimmed(path: str | os.PathLike[str], keep: int, cache: str | os.PathLike[str] | None = None) -> Optional[Path]:
    """The cached trimmed copy of ``path`` for ``keep``, or None when it was not derived yet."""
    dest = cache_dir(cache) / "trimmed" / _cache_key(Path(path).resolve(), keep)
    return dest if dest.exists() else None


def trimmed_draft(path: str | os.PathLike[str], keep: int = DEFAULT_KEEP, *, cache: str | os.PathLike[str] | None = None,
                  progress: Optional[ProgressFn] = None) -> Path:
    """The cached copy of the draft at ``path`` trimmed to ``keep`` rows (``keep // 8``, at most
    ``DEFAULT_SLOTS``, of them free for run-time tokens), derived on first use (seconds). The cache key is
    the source's path, size and mtime, ``keep``, the corpus and the format."""
    srcp = Path(path).resolve()
    d = cache_dir(cache) / "trimmed"
    dest = d / _cache_key(srcp, keep)
    if dest.exists():
        return dest
    d.mkdir(parents=True, exist_ok=True)
    with locked(d / f".{dest.name}.lock"):
        if dest.exists():
            return dest
        n_slots = min(DEFAULT_SLOTS, keep // 8)
        ids = choose_keep(srcp, keep - n_slots, _corpus_ids(srcp))
        trim_vocab_gguf(srcp, dest, ids, n_slots=n_slots, progress=progress, stage=f"trim {srcp.name} to {keep} tokens")
        log.info("trimmed draft %s to %d of its tokens and %d run-time slots: %s", srcp.name, ids.size, n_slots, dest)
    return dest


def is_trimmed(path: str | os.PathLike[str]) -> bool:
    with open_gguf(path) as (lay, _):
        return lay.get(SOURCE_N_KEY) is not None


def draft_path(path: str | os.PathLike[str], keep: int, asked: bool, progress: Optional[ProgressFn] = None,
               cache: str | os.PathLike[str] | None = None) -> tuple[Path, bool]:
    """(the draft to load for ``path``, whether it is a trimmed file): its trimmed copy when ``keep`` > 0
    and trimming pays (or was ``asked`` for and can be done), else ``path`` itself. Logged."""
    p = Path(path)
    if keep <= 0:
        return p, is_trimmed(p)
    ok, why = trim_pays(p, keep, asked=asked)
    if not ok:
        (log.warning if asked else log.debug)("draft %s keeps its whole vocabulary: %s", p.name, why)
        return p, is_trimmed(p)
    log.info("draft %s: trimmed vocabulary, %s", p.name, why)
    try:
        return trimmed_draft(p, keep, progress=progress, cache=cache), True
    except (OSError, FetchError) as e:  # a cache that cannot be written: trimming is only a speed-up
        msg = f"could not write the trimmed copy of draft {p.name} into the model cache ({e})"
        if asked:
            raise FetchError(msg + "; free space or set LLAMASPEC_CACHE to a writable folder, or pass "
                             "--spec-draft-vocab 0") from None
        log.warning("%s; drafting with its whole vocabulary", msg)
        return p, is_trimmed(p)


if __name__ == "__main__":  # pragma: no cover - python -m llamaspec.models.trim DRAFT [K]
    logging.basicConfig(level=logging.INFO)
    p = trimmed_draft(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_KEEP)
    print(p)
