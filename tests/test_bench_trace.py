"""The trace benchmark (issue 25, ``python -m benchmarks.research --trace``: benchmarks/trace*.py): its worked examples, and
a smoke run on the tiny model, end to end over HTTP (llamaspec serve with and without speculation, and llama-server
--spec-default / ngram-mod when it is built)."""
from __future__ import annotations

import doctest
import importlib
import json

import pytest

from llamaspec.errors import UsageError


@pytest.mark.parametrize("name", ["benchmarks.trace", "benchmarks.trace_report", "benchmarks.trace_sessions"])
def test_doctests(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0 and res.attempted > 0


def test_variants_and_targets():
    from benchmarks.trace import NGRAM_MOD_DOC, VARIANTS, parse_variants
    from benchmarks.trace_report import summarise

    # llama.cpp's docs/speculative.md sample: --spec-ngram-mod-n-match 24 --spec-ngram-mod-n-min 48 --spec-ngram-mod-n-max 64
    assert NGRAM_MOD_DOC == (24, 48, 64)
    assert VARIANTS["native-ngram-mod"].args == ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "24",
                                                 "--spec-ngram-mod-n-min", "48", "--spec-ngram-mod-n-max", "64")
    with pytest.raises(UsageError):
        parse_variants("native-ngram-mod:1:2")
    runs = [dict(trace="edit-loop", variant=v, engine=v.split("-")[0].replace("ls", "llamaspec"), tokens_per_s=t,
                 draft_n=0, draft_n_accepted=0, outputs=["x"], repeat=rep)
            for rep in range(2) for v, t in (("ls-plain", 20.0), ("ls-defaults", 50.0 + rep), ("native-plain", 21.0),
                                             ("native-spec-default", 35.0), ("native-ngram-mod", 40.0))]
    row = summarise(runs, ["edit-loop"])[0]
    assert row["best_native"] == "native-ngram-mod" and row["tokens_per_s"]["ls-defaults"]["median"] == 50.5
    assert row["vs_plain"]["ls-defaults"] == pytest.approx(2.525) and row["vs_best_native"]["ls-defaults"] == pytest.approx(1.262)
    assert row["target"]["met"] is False  # x1.26 < x1.3 of llama-server's best
    assert row["llamaspec_outputs_equal"] is True


def test_trace_bench_smoke(tiny_model, tmp_path):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    from click.testing import CliRunner

    from llamaspec.bench.native import SERVER, find_tool
    from benchmarks.research import command

    variants = "ls-plain,ls-defaults" + (",native-plain,native-ngram-mod" if find_tool(SERVER) is not None else "")
    out_json, out_md = tmp_path / "t.json", tmp_path / "t.md"
    r = CliRunner().invoke(command(), ["--trace", "-m", str(tiny_model("llama")), "--trace-variants", variants,
                                  "--traces", "chat-regenerate,free", "--turns", "2", "-n", "12", "--repeats", "1",
                                  "--trace-restart", "server", "-c", "1024", "--trace-scale", "0.1", "--exact", "-t", "1",
                                  "--json", str(out_json), "--markdown", str(out_md)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(out_json.read_text())
    assert {x["variant"] for x in rep["runs"]} == set(variants.split(","))
    assert all(x["predicted_n"] > 0 and x["tokens_per_s"] > 0 for x in rep["runs"])
    assert rep["estimate"]["estimate_s"] > 0 and rep["estimate"]["probe_variant"] == "ls-plain"
    rows = {x["trace"]: x for x in rep["summary"]}
    assert set(rows) == {"chat-regenerate", "free"} and rows["free"]["plain"] == "ls-plain"
    assert rows["free"]["target"]["vs_plain_min"] == 0.97 and "ls-defaults" in rows["free"]["vs_plain"]
    # the same greedy session on fresh servers, exact settings: drafting does not change the output
    assert rows["chat-regenerate"]["llamaspec_outputs_equal"] is True
    md = out_md.read_text()
    assert "## Against the targets" in md and "| free | free |" in md
