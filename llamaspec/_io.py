"""Small file helpers shared by the library (no llama.cpp here).

Every file the project writes goes through ``atomic_output`` (streaming) or ``write_atomic`` (all at
once): a reader never sees a half-written file and an interrupted write leaves the old one intact.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Yield a binary file open on a temporary file next to ``path`` (``.NAME.XXXX.tmp``; its ``.name`` is
    that file's path); when the block ends without an exception, the file is flushed, synced and renamed
    over ``path``; otherwise it is removed."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fh = tempfile.NamedTemporaryFile("wb", prefix=f".{p.name}.", suffix=".tmp", dir=p.parent, delete=False)
    tmp = fh.name
    try:
        with fh:
            yield fh  # type: ignore[misc]
            fh.flush()
            with contextlib.suppress(OSError):
                os.fsync(fh.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str) -> None:
    """Write ``data`` (str as UTF-8) to ``path`` through ``atomic_output``."""
    with atomic_output(path) as fh:
        fh.write(data.encode("utf-8") if isinstance(data, str) else data)
