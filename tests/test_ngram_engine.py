"""n-gram drafters inside the engine: greedy speculative output equals plain output, 1 and 4 slots."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from llamaspec.cli.main import main
from llamaspec.engine import Engine
from llamaspec.params import SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT

BASE = [5, 6, 7, 8, 9, 10, 11] * 4
PROMPTS = [BASE, BASE[3:] + [20, 21], [30, 31, 32, 33] * 5, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]]
TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]


def small(t: str) -> SpecParams:
    """Short n-grams so that the tiny models' outputs produce matches."""
    p = SpecParams()
    p.add_types(t)
    for x in (p.ngram_simple, p.ngram_map_k, p.ngram_map_k4v):
        x.size_n, x.size_m = 2, 6
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 2, 1, 8
    return p


@pytest.fixture(scope="module")
def plain(tiny_model):
    out = {}
    for kind in ("llama", "mamba"):
        with Engine(tiny_model(kind), n_ctx=256, **EXACT) as e:
            out[kind] = [e.generate(p, n_predict=48).tokens for p in PROMPTS]
    return out


@pytest.mark.parametrize("n_parallel", [1, 4])
@pytest.mark.parametrize("kind", ["llama", "mamba"])
@pytest.mark.parametrize("t", TYPES)
def test_greedy_equals_plain(tiny_model, plain, t, kind, n_parallel):
    with Engine(tiny_model(kind), spec=small(t), n_ctx=256, n_parallel=n_parallel, **EXACT) as e:
        assert e.chain.types == [t]
        rs = e.generate_many(PROMPTS, n_predict=48)
        ds = e.drafter_stats()[0]
    assert [r.tokens for r in rs] == plain[kind]
    assert sum(r.stats.n_drafted for r in rs) > 0
    assert ds["n_gen_tokens"] == sum(r.stats.n_drafted for r in rs)


@pytest.mark.parametrize("t", TYPES)
def test_cancel_mid_generation(tiny_model, plain, t):
    """Found by tests/test_fuzz_engine.py: cancelling a request on an ngram-mod engine raised a TypeError out of
    ``Request.cancel`` (the chain's per-sequence ``reset(seq_id)`` hit ngram-mod's table-wide ``reset()``)."""
    with Engine(tiny_model("llama"), spec=small(t), n_ctx=256, n_parallel=2, **EXACT) as e:
        req = e.submit(PROMPTS[0], RequestOptions(n_predict=48))
        while len(req.tokens) < 4:
            e.step()
        req.cancel()
        e.step()
        assert req.finish_reason == "abort" and all(s.state.value in ("idle", "done") for s in e.slots)
        assert e.generate(PROMPTS[0], n_predict=48).tokens == plain["llama"][0]  # the slot serves the next one


def test_chain_priority_ngram_before_draft_model(tiny_model, plain):
    p = small("draft-simple,ngram-simple,ngram-mod")
    with Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=p, n_ctx=256, **EXACT) as e:
        assert e.chain.types == ["ngram-simple", "ngram-mod", "draft-simple"]
        r = e.generate(PROMPTS[0], n_predict=48)
    assert r.tokens == plain["llama"][0]


def test_cli_ngram_flags(tiny_model):
    args = ["generate", "tok_5 tok_6 tok_7 tok_5 tok_6 tok_7 tok_5 tok_6", "-m", str(tiny_model("llama")), "-n", "16",
            "--temp", "0", "-q", "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
            "--spec-ngram-simple-size-m", "4"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    plain = CliRunner().invoke(main, args[:8] + ["-q", "--spec-type", "none"])  # plain: the default is auto
    assert r.stdout == plain.stdout


@pytest.mark.parametrize(
    "flags,msg",
    [
        (["--spec-type", "ngram-foo"], "unknown speculative type"),
        (["--spec-ngram-mod-n-min", "2000", "--spec-type", "ngram-mod"], "between 0 and 1024"),
        (["--spec-ngram-simple-size-n", "0", "--spec-type", "ngram-simple"], "between 1 and 1024"),
        (["--spec-ngram-map-k-min-hits", "0", "--spec-type", "ngram-map-k"], "at least 1"),
        (["--spec-draft-n-max", "-1", "-md", "x.gguf"], "must be >= 0"),
        (["--spec-type", "draft-simple"], "needs a draft model"),
        (["--spec-synth-len", "2", "--spec-synth-rates", "0.5", "--spec-type", "ngram-mod"], "mutually exclusive"),
        (["--spec-synth-len", "abc", "--spec-type", "ngram-mod"], "spec-synth-len"),
        (["--spec-synth-len", "0x1p99999", "--spec-type", "ngram-mod"], "inf is out of range"),
        (["-lcs", "/no/such/cache.bin", "--spec-type", "ngram-cache"], "not found"),
    ],
)
def test_cli_bad_spec_flags(tiny_model, flags, msg):
    r = CliRunner().invoke(main, ["generate", "x", "-m", str(tiny_model("llama")), "-n", "4"] + flags)
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_cli_synth_out_of_range(tiny_model):
    r = CliRunner().invoke(main, ["generate", "x", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")),
                                  "--spec-synth-len", "9", "--spec-draft-n-max", "3", "-n", "4"])
    assert r.exit_code == 2 and "spec-synth-len" in r.output, r.output


def test_cli_incompatible_draft(tiny_model):
    r = CliRunner().invoke(main, ["generate", "x", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-incompat")),
                                  "-n", "4"])
    assert r.exit_code == 2 and "vocab" in r.output and "Traceback" not in r.output


def test_cli_ngram_cache_build_and_stats(tiny_model, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("tok_1 tok_2 tok_3 " * 50)
    out = tmp_path / "c.bin"
    r = CliRunner().invoke(main, ["ngram-cache", "build", str(corpus), "-o", str(out), "-m", str(tiny_model("llama"))])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 0
    r = CliRunner().invoke(main, ["ngram-cache", "stats", str(out), "--json"])
    assert r.exit_code == 0 and '"n_keys"' in r.stdout
    r = CliRunner().invoke(main, ["generate", "tok_1 tok_2", "-m", str(tiny_model("llama")), "--spec-type", "ngram-cache",
                                  "-lcs", str(out), "-n", "8", "--temp", "0", "-q"])
    assert r.exit_code == 0, r.output
