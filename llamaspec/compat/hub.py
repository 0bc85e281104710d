"""``Llama.from_pretrained``: one GGUF of a Hugging Face repository, found by a glob and downloaded with
``huggingface_hub`` (an optional dependency: ``pip install huggingface-hub``, or llamaspec's ``hub`` extra).
``HF_ENDPOINT`` points it at a mirror, as everywhere in ``huggingface_hub``.

Behaviour follows llama-cpp-python's ``from_pretrained``: the repository's files are listed, ``filename`` (a
glob) must match exactly one of them (else ``ValueError`` listing the files), ``additional_files`` (globs:
the other shards of a split GGUF) are fetched beside it, and the local path of the main file is returned.
"""
from __future__ import annotations

import fnmatch
import json
import os
from pathlib import PurePosixPath
from typing import Any, Sequence

__all__ = ["download"]


def _hub():
    try:
        import huggingface_hub
        from huggingface_hub.utils import validate_repo_id
    except ImportError as e:
        raise ImportError("Llama.from_pretrained needs the huggingface-hub package: "
                          "pip install huggingface-hub (or llamaspec[hub])") from e
    return huggingface_hub, validate_repo_id


def _one(files: Sequence[str], pattern: str, repo_id: str) -> str:
    found = [f for f in files if fnmatch.fnmatch(f, pattern)]
    if not found:
        raise ValueError(f"No file found in {repo_id} that match {pattern}\n\nAvailable Files:\n{json.dumps(list(files))}")
    if len(found) > 1:
        raise ValueError(f"Multiple files found in {repo_id} matching {pattern}\n\nAvailable Files:\n"
                         f"{json.dumps(list(files))}")
    return found[0]


def _fetch(hub: Any, repo_id: str, rel: str, local_dir, cache_dir) -> str:
    parent = str(PurePosixPath(rel).parent)
    return hub.hf_hub_download(repo_id=repo_id, filename=PurePosixPath(rel).name,
                               subfolder=None if parent in ("", ".") else parent,
                               local_dir=local_dir, cache_dir=cache_dir)


def download(repo_id: str, filename: "str | None", *, additional_files: "Sequence[str] | None" = None,
             local_dir: "str | os.PathLike | None" = None, cache_dir: "str | os.PathLike | None" = None) -> str:
    """Local path of the one file of ``repo_id`` matching ``filename`` (downloaded if needed)."""
    hub, validate_repo_id = _hub()
    validate_repo_id(repo_id)
    if not filename:
        raise ValueError("from_pretrained needs filename (a file name or glob, e.g. '*Q4_K_M.gguf')")
    files = sorted(hub.HfApi().list_repo_files(repo_id))
    main = _one(files, filename, repo_id)
    path = _fetch(hub, repo_id, main, local_dir, cache_dir)
    for pattern in additional_files or ():
        _fetch(hub, repo_id, _one(files, pattern, repo_id), local_dir, cache_dir)
    return path
