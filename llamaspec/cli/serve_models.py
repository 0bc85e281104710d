"""Where ``llamaspec serve`` gets its models from llama-server's flags: ``-hf REPO[:QUANT]`` / ``-hff FILE``,
``-hfd`` for the draft, ``-mu URL``, and ``--offline`` (only what is already in the cache).

The files go to llamaspec's model cache (``--cache-dir``, ``$LLAMASPEC_CACHE``) through the same fetcher as
models.toml's ``hf`` and ``url`` entries (urllib, atomic writes, a progress bar).
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from llamaspec.errors import UsageError

__all__ = ["hf_model", "url_model", "resolve_offline", "hf_entry_name", "url_entry_name", "DEFAULT_QUANT"]

#: llama-server's default quantization for ``-hf REPO`` without ``:QUANT``
DEFAULT_QUANT = "Q4_K_M"


def _registry_with(entry):
    from llamaspec.models import Registry, load_registry

    reg = load_registry()
    return Registry(models={**reg.models, entry.name: entry}, pairs=reg.pairs, default_model=reg.default_model,
                    default_pair=reg.default_pair, sources=reg.sources)


def _resolve(entry, cache_dir: str | None, offline: bool) -> str:
    from llamaspec.errors import FetchError
    from llamaspec.models import resolve_model

    from ._common import progress_bar

    try:
        with progress_bar() as progress:
            return str(resolve_model(entry.name, registry=_registry_with(entry), cache_dir=cache_dir,
                                     progress=progress, fetch=not offline))
    except FetchError as e:
        if offline:
            raise UsageError(f"--offline: {entry.filename} is not in the model cache; run once without --offline "
                             "to download it, or give -m PATH") from None
        raise e


def _hf_files(repo: str, token: str | None) -> list[str]:
    base = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    req = urllib.request.Request(f"{base}/api/models/{repo}", headers={"User-Agent": "llamaspec"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            info = json.load(resp)
    except urllib.error.HTTPError as e:
        raise UsageError(f"-hf {repo}: Hugging Face answered HTTP {e.code} {e.reason} (check the repository name, "
                         "or give a token with -hft)") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as e:
        raise UsageError(f"-hf {repo}: cannot list the repository ({getattr(e, 'reason', e)}); check your network "
                         "or download the GGUF and give -m PATH") from None
    return [s.get("rfilename", "") for s in info.get("siblings", []) if isinstance(s, dict)]


def _pick_gguf(repo: str, quant: str, files: list[str]) -> str:
    ggufs = [f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()]
    if not ggufs:
        raise UsageError(f"-hf {repo}: the repository has no GGUF file")
    q = quant.lower()
    match = [f for f in ggufs if q in Path(f).name.lower()]
    if not match:
        raise UsageError(f"-hf {repo}:{quant}: no GGUF file with {quant} in its name (there are: "
                         f"{', '.join(Path(f).name for f in ggufs[:6])}); add :QUANT or -hff FILE")
    return sorted(match, key=lambda f: ("-of-" in f, len(f)))[0]  # a whole file before split parts


def hf_model(spec: str, file: str | None, *, token: str | None, cache_dir: str | None, offline: bool,
             flag: str = "-hf") -> str:
    """``-hf USER/MODEL[:QUANT]`` (with ``-hff FILE``) -> a local GGUF path, downloaded into the cache once."""
    from llamaspec.models import ModelEntry

    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UsageError(f"{flag}: expected USER/MODEL[:QUANT], got {spec!r}")
    if file is None:
        if offline:
            raise UsageError(f"{flag} {spec} with --offline: give the file too (-hff FILE), so the cache is found "
                             "without asking Hugging Face")
        file = _pick_gguf(repo, quant or DEFAULT_QUANT, _hf_files(repo, token or os.environ.get("HF_TOKEN")))
    name = hf_entry_name(repo, file)
    return _resolve(ModelEntry(name=name, kind="hf", hf=f"{repo}/{file}"), cache_dir, offline)


def url_model(url: str, *, cache_dir: str | None, offline: bool) -> str:
    """``-mu URL`` -> a local GGUF path, downloaded into the cache once."""
    from llamaspec.models import ModelEntry

    if urllib.parse.urlparse(url).scheme not in ("http", "https"):
        raise UsageError(f"-mu: expected an http(s) URL, got {url!r}")
    return _resolve(ModelEntry(name=url_entry_name(url), kind="url", url=url), cache_dir, offline)


def hf_entry_name(repo: str, file: str) -> str:
    return "hf:" + repo.replace("/", "--") + "--" + Path(file).stem


def url_entry_name(url: str) -> str:
    p = urllib.parse.urlparse(url)
    return "url:" + (p.netloc + p.path).replace("/", "--")


def resolve_offline(name: str | None, cache_dir: str | None) -> str | None:
    """With ``--offline``: a models.toml name -> its cached file (never fetched); paths and None unchanged."""
    if name is None:
        return None
    from llamaspec.errors import FetchError
    from llamaspec.models import resolve_model

    try:
        return str(resolve_model(name, cache_dir=cache_dir, fetch=False))
    except FetchError:
        raise UsageError(f"--offline: model {name} is not in the cache yet; run once without --offline to fetch "
                         "it, or give -m PATH") from None
