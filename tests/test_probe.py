"""Capability probe (spec §6.1) on tiny models of every memory level, and on the real models."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llamaspec.cli.main import main
from llamaspec import _llama as L
from llamaspec.level import Level
from llamaspec.probe import can_seq_rm, probe, probe_levels

from helpers import real_model

EXPECTED = {
    # kind: (level, level_with_rs)
    "llama": ("PART", "PART"),
    "gemma3": ("PART", "PART"),
    "mamba": ("FULL", "FULL"),
    "lfm2": ("FULL", "RS"),
    "qwen35": ("FULL", "RS"),
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_levels(tiny_model, kind):
    with L.Model(tiny_model(kind)) as m:
        lv = probe_levels(m, n_rs_seq=4)
    assert (lv.level.name, lv.level_with_rs.name) == EXPECTED[kind]
    assert lv.n_rs_seq == (4 if EXPECTED[kind][1] == "RS" else 0)  # clamped to 0 where unsupported


def test_probe_wipes_memory_and_is_repeatable(tiny_model):
    with L.Model(tiny_model("llama")) as m, L.Context(m, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        assert can_seq_rm(ctx) is Level.PART
        assert ctx.memory.pos_max(0) == -1
        assert can_seq_rm(ctx) is Level.PART


def test_rs_needs_no_probe_decode(tiny_model):
    with L.Model(tiny_model("lfm2")) as m, L.Context(m, n_ctx=64, n_rs_seq=2) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        assert can_seq_rm(ctx) is Level.RS
        assert ctx.memory.pos_max(0) == 2  # RS branch does not touch memory


def test_full_report(tiny_model):
    with L.Model(tiny_model("llama")) as t, L.Model(tiny_model("llama-draft")) as d:
        rep = probe(t, d, checkpoint_tokens=64).to_dict()
    assert rep["schema_version"] == 1
    assert rep["target"]["level"] == "PART" and rep["draft"]["level"] == "PART"
    assert rep["vocab"]["compatible"] is True
    assert [r["rule"] for r in rep["vocab"]["rules"]] == ["type", "bos", "eos", "size", "text"]
    assert set(rep["target"]["verify_cost_ms"]) == {"1", "2", "4", "8", "16"}
    assert rep["target"]["checkpoint"]["partial_bytes"] > 0
    assert rep["cost_ratio"] > 0
    assert {r["drafter"] for r in rep["recommendations"]} == {"ngram", "draft-model"}


def test_incompatible_vocab_reported(tiny_model):
    with L.Model(tiny_model("llama")) as t, L.Model(tiny_model("llama-incompat")) as d:
        rep = probe(t, d, measure=False).to_dict()
    assert rep["vocab"]["compatible"] is False
    assert any(not r["ok"] for r in rep["vocab"]["rules"])


def test_cli_json(tiny_model):
    r = CliRunner().invoke(main, ["probe", str(tiny_model("lfm2")), "--json", "--no-bench"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    t = d["target"]
    assert (t["level"], t["level_with_rs"], t["arch"], t["n_rs_seq"]) == ("FULL", "RS", "lfm2", 8)
    assert "draft" not in d


def test_cli_table(tiny_model):
    r = CliRunner().invoke(main, ["probe", str(tiny_model("mamba")), "-md", str(tiny_model("mamba-draft")),
                                  "--checkpoint-tokens", "32"])
    assert r.exit_code == 0, r.output
    assert "FULL" in r.stdout and "Vocabulary compatibility" in r.stdout


@pytest.mark.real
@pytest.mark.parametrize("name", ["gemma3-270m-q4km", "smollm2-135m-q4_1"])
def test_real_models_are_part(name):
    with L.Model(real_model(name)) as m:
        lv = probe_levels(m)
    assert lv.level is Level.PART and lv.level_with_rs is Level.PART
