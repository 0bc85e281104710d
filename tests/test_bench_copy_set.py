"""The copy-heavy set against llama-cpp-python's prompt lookup (issue 25, ``python -m benchmarks.research --copy-set``:
benchmarks/copy_set.py): the set's split, the per-prompt summary, and a smoke run on the tiny model."""
from __future__ import annotations

import doctest
import json

import pytest

from benchmarks import copy_set as C
from llamaspec.errors import UsageError


def test_doctests():
    res = doctest.testmod(C, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0 and res.attempted > 0


def test_the_set_and_its_fixed_split():
    items = C.load_copy_set()
    assert len(items) >= 12 and len({x.id for x in items}) == len(items)
    kinds = {x.category for x in items}
    assert len(kinds) >= 6
    for k in kinds:  # every kind in both halves, once
        assert sorted(x.half for x in items if x.category == k) == ["held-out", "tune"]
    assert all(x.prompt.startswith("User: ") and x.prompt.endswith("\nAssistant:") for x in items)
    with pytest.raises(UsageError):
        C.load_copy_set(half="test")


def _run(engine, mode, pid, rep, tps, drafted=None, accepted=None):
    return {"engine": engine, "mode": mode, "prompt_id": pid, "repeat": rep, "decode_tokens_per_second": tps,
            "n_drafted": drafted, "n_accepted": accepted, "error": None}


def test_summary_takes_the_best_lookup_setting_per_prompt():
    items = [C.CopyPrompt("a", "k1", "tune", "u", "p"), C.CopyPrompt("b", "k1", "held-out", "u", "p")]
    runs = []
    for rep in range(2):
        for pid, l10, l2, ls in (("a", 40.0, 30.0, 60.0), ("b", 20.0, 25.0, 24.0 + rep)):
            runs += [_run("llama-cpp-python", "plain", pid, rep, 20.0), _run("llama-cpp-python", "lookup:10", pid, rep, l10),
                     _run("llama-cpp-python", "lookup:2", pid, rep, l2), _run("llamaspec", "plain", pid, rep, 20.5),
                     _run("llamaspec", "default", pid, rep, ls, 30, 20)]
    div = {"engine": "llamaspec", "mode": "default", "prompt_id": "b", "near_tie": True}
    s = C.summarise_copy({"runs": runs, "equality": {"divergences": [div]}}, items)
    a, b = s["rows"]
    assert a["best_lookup"] == "llama-cpp-python/lookup:10" and a["ls_vs_best_lookup"] == 1.5
    assert b["best_lookup"] == "llama-cpp-python/lookup:2" and b["ls_vs_best_lookup"] == pytest.approx(24.5 / 25)
    assert b["outputs"]["llamaspec/default"] == "near-tie" and a["outputs"]["llamaspec/default"] == "equal"
    assert s["halves"]["tune"]["met"] is True and s["halves"]["held-out"]["met"] is False
    assert s["halves"]["all"]["min_prompt"] == "b" and s["real_divergences"] == []


def test_copy_set_smoke(tiny_model, tmp_path):
    from click.testing import CliRunner

    from benchmarks.research import command

    js, md = tmp_path / "c.json", tmp_path / "c.md"
    r = CliRunner().invoke(command(), ["--copy-set", "-m", str(tiny_model("llama")), "--copy-format", "plain",
                                  "--limit", "2", "-n", "8", "--repeats", "1", "-t", "1", "--no-progress",
                                  "--json", str(js), "--markdown", str(md)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rep = json.loads(js.read_text())
    cs = rep["copy_set"]
    assert [x["prompt"] for x in cs["rows"]] == ["alt-schedule", "list-shopping-bought"]
    cfgs = set(cs["rows"][0]["tokens_per_s"])
    assert cfgs == {"llamaspec/plain", "llamaspec/default", "llama-cpp-python/plain", "llama-cpp-python/lookup:10",
                    "llama-cpp-python/lookup:2"}
    assert cs["format"] == "plain" and cs["estimate"]["estimate_s"] > 0
    assert rep["equality"]["n_compared"] == 8 and not cs["real_divergences"]
    assert "## Against the targets" in md.read_text()
