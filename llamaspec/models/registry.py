"""The model registry: ``models.toml`` files (repo, packaged, user), their entries and pairs.

``load_registry`` reads and validates the files and merges a user file on top; ``Registry.model`` /
``Registry.pair`` look names up and suggest close matches for unknown ones.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import re
import urllib.parse
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

try:  # Python 3.11+
    import tomllib
except ImportError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ..errors import ModelNotFoundError, UsageError

ENV_MODELS_TOML = "LLAMASPEC_MODELS_TOML"
ENV_USER_MODELS_TOML = "LLAMASPEC_USER_MODELS_TOML"

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


class RegistryError(UsageError):
    """models.toml is malformed (bad TOML, missing or conflicting keys, dangling references)."""


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
    package = Path(__file__).resolve().parents[1]  # llamaspec/
    top = package.parent / "models.toml"
    if top.is_file():
        return top
    packaged = package / "data" / "models.toml"
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


def _entry_head(table: str, name: str, body: Any, origin: Path) -> tuple[str, str]:
    """Where a ``[models.NAME]`` / ``[pairs.NAME]`` entry is (for messages), and its description."""
    where = f"{origin}: [{table}.{name}]"
    if not _NAME_RE.match(name):
        raise RegistryError(f"{where}: bad {table[:-1]} name (use letters, digits, '.', '_', '-')")
    if not isinstance(body, dict):
        raise RegistryError(f"{where} must be a table")
    desc = body.get("description", "")
    if not isinstance(desc, str):
        raise RegistryError(f"{where}: `description` must be a string")
    return where, desc


def _parse_model(name: str, body: Any, origin: Path) -> ModelEntry:
    where, desc = _entry_head("models", name, body, origin)
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
    where, desc = _entry_head("pairs", name, body, origin)
    for key in ("target", "draft"):
        if not isinstance(body.get(key), str) or not body[key]:
            raise RegistryError(f"{where} needs `{key} = \"MODEL\"`")
    info = {k: v for k, v in body.items() if k not in ("target", "draft", "description")}
    return PairEntry(name=name, target=body["target"], draft=body["draft"], description=desc, info=info)
