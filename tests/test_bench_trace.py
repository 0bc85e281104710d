"""Smoke test of the trace benchmark (issue 25, llamaspec/bench/trace.py) on the tiny model: llamaspec serve with
and without the shared pool (and llama-server --spec-default when it is built), end to end over HTTP."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from llamaspec.bench.native import SERVER, find_tool  # noqa: E402
from llamaspec.bench.trace import main  # noqa: E402


def test_trace_bench_smoke(tiny_model, tmp_path, capsys):
    servers = "pool,nopool" + (",native-default" if find_tool(SERVER) is not None else "")
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    assert main(["-m", str(tiny_model("llama")), "--servers", servers, "--traces", "chat-regenerate,n4",
                 "--turns", "2", "-n", "12", "--repeats", "1", "--restart", "server", "-c", "1024", "--scale", "0.1",
                 "--exact", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    rep = json.loads(out_json.read_text())
    assert {r["server"] for r in rep["runs"]} == set(servers.split(","))
    assert all(r["predicted_n"] > 0 and r["tokens_per_s"] > 0 for r in rep["runs"])
    rows = {r["trace"]: r for r in rep["summary"]}
    assert set(rows) == {"chat-regenerate", "n4"} and "nopool" in rows["chat-regenerate"]["pool_vs"]
    # the same greedy session on fresh servers: drafting from the pool does not change the output
    assert rows["chat-regenerate"]["greedy_outputs_equal"] is True
    assert "| chat-regenerate |" in out_md.read_text()
