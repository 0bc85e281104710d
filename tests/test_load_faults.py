"""A short run of ``scripts/load_faults.py``: a real ``llamaspec serve`` process (tiny models, 4 slots,
draft-simple) under 8 clients for 10 s of the normal and hostile mix, with injected native failures (decodes,
draft mirroring, drafting, admissions); no failure (no 5xx but the injected ones, no hang, reset, wrong greedy
answer or unexpected outcome), /health answering, slots idle and a clean SIGTERM exit at the end. The
long run (64 clients, 10 minutes) is the script's default."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_load_and_faults_short_run(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import load_faults
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    from support.load_run import summary

    out = tmp_path / "report.json"
    # memory flatness is for the long run: a 10 s run is mostly warm-up
    rc = load_faults.main(["-c", "8", "-t", "10", "--seed", "0", "--pool", "6", "--rss-limit", "500",
                           "--inject", "decode=0.005,mirror=0.005,drafter=0.01,admit=0.02",
                           "--json", str(out), "--log", str(tmp_path / "server.log")])
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["ok"], summary(rep) + "\n" + (tmp_path / "server.log").read_text()[-3000:]
    kinds = rep["by_kind"]
    assert {"complete", "chat", "oai-complete", "disconnect-stream", "bad-json", "wrong-type"} <= set(kinds), kinds
    assert rep["greedy"]["checked"] > 0 and rep["normal"]["n"] > 0 and rep["health"]["polls"] > 10
    assert rep["slots_idle_at_end"] and rep["exit_code"] == 0
