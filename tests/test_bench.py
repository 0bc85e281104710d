"""``llamaspec bench``: pure parts (aggregation, speedup model, schedule, parsing, rendering) and the
``--quick`` smoke run on the tiny models (native tools are used when built, skipped otherwise)."""
from __future__ import annotations

import doctest
import importlib
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from llamaspec.bench import report as R
from llamaspec.bench.modes import parse_mode, parse_modes
from llamaspec.bench.native import parse_metrics, parse_spec_simple, per_pos_from_metrics, spec_args
from llamaspec.bench.prompts import CATEGORIES, load_prompts, quick_subset
from llamaspec.bench.runners import lookup_stats
from llamaspec.bench.stats import (RunResult, aggregate, efficiency, expected_length, first_divergence, per_group_tps,
                                   per_token_acceptance, predicted_speedup, schedule, summarize)
from llamaspec.errors import UsageError
from llamaspec.params import SpecParams
from llamaspec.probe import expected_speedup

BENCH_MODULES = ["llamaspec.bench.stats", "llamaspec.bench.modes", "llamaspec.bench.native", "llamaspec.bench.prompts",
                 "llamaspec.bench.report", "llamaspec.bench.runners", "llamaspec.bench.server_mode", "llamaspec.bench.analysis"]


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_doctests(name):
    res = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0


# -------------------------------------------------------------------------------------------------
# aggregation and the speedup model
# -------------------------------------------------------------------------------------------------


def test_summarize_median_min_max():
    assert summarize([5.0, 1.0, 4.0, 2.0]) == {"median": 3.0, "min": 1.0, "max": 5.0, "n": 4}
    assert summarize([]) == {"median": None, "min": None, "max": None, "n": 0}


@pytest.mark.parametrize("a", [0.0, 0.1, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("k", [1, 3, 4.5, 16])
def test_per_token_acceptance_inverts_expected_length(a, k):
    assert per_token_acceptance(expected_length(a, k), k) == pytest.approx(a, abs=1e-9)


def test_per_token_acceptance_edges():
    assert per_token_acceptance(1.0, 3) == 0.0
    assert per_token_acceptance(4.0, 3) == 1.0
    assert per_token_acceptance(9.0, 3) == 1.0
    assert per_token_acceptance(2.0, 0) == 0.0


@pytest.mark.parametrize("a,k,c,v", [(0.8, 3, 0.3, 1.2), (0.5, 1, 0.0, 1.0), (0.9, 8, 0.1, 2.5), (1.0, 4, 0.2, 1.5)])
def test_predicted_speedup_is_the_formula(a, k, c, v):
    assert predicted_speedup(a, k, c, v) == pytest.approx(expected_speedup(a, k, c, v))
    # explicit formula
    want = (k + 1) / (k * c + v) if a >= 1 else (1 - a ** (k + 1)) / ((1 - a) * (k * c + v))
    assert predicted_speedup(a, k, c, v) == pytest.approx(want)


def test_predicted_speedup_blends_undrafted_rounds():
    # 10 drafted steps giving E tokens at cost (k c + v), 30 plain steps giving 1 token at cost 1
    a, k, c, v = 0.8, 3, 0.0, 1.5
    e = expected_length(a, k)
    got = predicted_speedup(a, k, c, v, n_spec_steps=10, n_plain_steps=30)
    assert got == pytest.approx((10 * e + 30) / (10 * (k * c + v) + 30))
    assert 1.0 < got < predicted_speedup(a, k, c, v)


def test_efficiency():
    assert efficiency(1.5, 2.0) == 0.75
    assert efficiency(None, 2.0) is None
    assert efficiency(1.5, None) is None
    assert efficiency(1.5, 0.0) is None


def test_first_divergence():
    assert first_divergence([], []) is None
    assert first_divergence([1, 2], [1, 2]) is None
    assert first_divergence([1, 2], [2, 2]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_schedule_interleaves_and_alternates():
    order = schedule(3, 2, 2)
    assert order == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 1), (1, 0, 0), (1, 1, 1), (1, 1, 0),
        (2, 0, 0), (2, 0, 1), (2, 1, 0), (2, 1, 1),
    ]
    # every (repeat, prompt, config) exactly once
    assert len(set(schedule(4, 3, 5))) == 4 * 3 * 5


def _run(engine, mode, prompt, repeat, n, t, **kw):
    return RunResult(engine=engine, mode=mode, prompt_id=prompt, category="cat-" + prompt, repeat=repeat,
                     n_predicted=n, t_decode_s=t, t_prompt_s=0.01, **kw)


def test_aggregate_throughput_speedup_ratio_efficiency():
    res = []
    # plain: 2 prompts x 3 repeats; per-repeat throughput = (9+9) / (t1+t2)
    for rep, (t1, t2) in enumerate([(1.0, 1.0), (0.9, 0.9), (1.2, 1.2)]):
        res.append(_run("llamaspec", "plain", "a", rep, 10, t1))
        res.append(_run("llamaspec", "plain", "b", rep, 10, t2))
        res.append(_run("native", "plain", "a", rep, 10, t1 * 0.9))
        res.append(_run("native", "plain", "b", rep, 10, t2 * 0.9))
        # draft mode: 3 steps of a 3-token draft per prompt, 2 accepted each: 9 tokens after the first
        for p in "ab":
            res.append(_run("llamaspec", "draft-simple", p, rep, 10, t1 / 2, n_drafted=9, n_accepted=6, n_verif_steps=3,
                            accepted_per_pos=[3, 3, 0]))
            res.append(_run("native", "draft-simple", p, rep, 10, t1 / 2.5, n_drafted=9, n_accepted=6, n_verif_steps=3,
                            accepted_per_pos=[3, 3, 0]))
    res.append(RunResult(engine="llamaspec", mode="plain", prompt_id="a", category="x", repeat=0, error="boom"))
    curve = {"1": 10.0, "2": 12.0, "4": 16.0, "8": 24.0}
    rows = {(r["engine"], r["mode"]): r for r in aggregate(res, cost_ratio=0.25, verify_curve=curve)}
    lp = rows[("llamaspec", "plain")]
    assert lp["decode_tps"]["median"] == pytest.approx(9.0)
    assert lp["decode_tps"]["min"] == pytest.approx(18 / 2.4)
    assert lp["decode_tps"]["max"] == pytest.approx(10.0)
    assert lp["n_errors"] == 1 and lp["n_runs"] == 6
    assert lp["speedup"] == pytest.approx(1.0)
    assert lp["ratio_llamaspec_native"] == pytest.approx(0.9)
    ld = rows[("llamaspec", "draft-simple")]
    assert ld["speedup"] == pytest.approx(2.0)
    spec = ld["spec"]
    assert spec["acceptance_rate"] == pytest.approx(6 / 9) and spec["mean_accepted_length"] == 3.0
    assert spec["accepted_per_pos"] == [1.0, 1.0, 0.0] and spec["n_plain_steps"] == 0
    a = ld["per_token_acceptance"]
    assert 1 + a + a * a + a ** 3 == pytest.approx(3.0)
    # k = 3, v = cost(4 rows) / cost(1) = 1.6, c = 0.25: predicted = 3 / (0.75 + 1.6)
    assert ld["predicted_speedup"] == pytest.approx(3 / 2.35)
    assert ld["efficiency"] == pytest.approx(2.0 / (3 / 2.35))
    nd = rows[("native", "draft-simple")]
    assert ld["ratio_llamaspec_native"] == pytest.approx(ld["decode_tps"]["median"] / nd["decode_tps"]["median"])
    assert nd["ratio_llamaspec_native"] is None


def test_aggregate_ngram_uses_zero_draft_cost_and_counts_plain_rounds():
    res = [_run("llamaspec", "plain", "a", 0, 21, 2.0),
           # 20 tokens after the first: 4 drafted steps accepting 2 each (12 tokens) + 8 plain rounds
           _run("llamaspec", "ngram-mod", "a", 0, 21, 1.5, n_drafted=16, n_accepted=8, n_verif_steps=4,
                accepted_per_pos=[4, 4, 0, 0])]
    row = [r for r in aggregate(res, cost_ratio=0.5, verify_curve={"1": 1.0, "8": 1.0}) if r["mode"] == "ngram-mod"][0]
    assert row["spec"]["n_plain_steps"] == 8
    assert row["cost_ratio"] == 0.0
    e = expected_length(row["per_token_acceptance"], 4)
    assert e == pytest.approx(3.0)
    assert row["predicted_speedup"] == pytest.approx((4 * 3 + 8) / (4 * 1.0 + 8))


def test_aggregate_default_modes_use_the_trimmed_draft_cost():
    """``default:TYPES`` drafts with the trimmed draft: its measured cost ratio, not the whole draft's."""
    res = [_run("llamaspec", "plain", "a", 0, 10, 1.0)]
    for mode in ("draft-simple", "default:draft-simple"):
        res.append(_run("llamaspec", mode, "a", 0, 10, 0.5, n_drafted=9, n_accepted=6, n_verif_steps=3,
                        accepted_per_pos=[3, 3, 0]))
    curve = {"1": 10.0, "4": 16.0}
    rows = {r["mode"]: r for r in aggregate(res, cost_ratio=0.5, cost_ratio_trimmed=0.2, verify_curve=curve)}
    assert rows["draft-simple"]["cost_ratio"] == 0.5 and rows["default:draft-simple"]["cost_ratio"] == 0.2
    assert rows["default:draft-simple"]["predicted_speedup"] == pytest.approx(3 / (3 * 0.2 + 1.6))
    rows = {r["mode"]: r for r in aggregate(res, cost_ratio=0.5, verify_curve=curve)}  # not measured: the whole draft's
    assert rows["default:draft-simple"]["cost_ratio"] == 0.5


def test_per_group_tps():
    res = [_run("e", "m", "a", 0, 11, 1.0), _run("e", "m", "a", 1, 11, 2.0), _run("e", "m", "a", 2, 11, 0.5)]
    assert per_group_tps(res, lambda r: (r.engine, r.category)) == {("e", "cat-a"): 10.0}


# -------------------------------------------------------------------------------------------------
# modes, prompts, native parsing
# -------------------------------------------------------------------------------------------------


def test_parse_modes():
    ms = parse_modes("plain,draft-simple, ngram-mod ,synth:2.5,lookup:5,ngram-mod")
    assert [m.name for m in ms] == ["plain", "draft-simple", "ngram-mod", "synth:2.5", "lookup:5"]
    assert [m.kind for m in ms] == ["plain", "spec", "spec", "spec", "lookup"]
    assert ms[3].needs_draft and not ms[3].exact
    p = ms[2].spec_params(SpecParams())
    assert p.types == ["none", "ngram-mod"] and p.synth_len == -1.0
    t = SpecParams()
    t.draft.n_max = 5
    assert ms[3].spec_params(t).draft.n_max == 5 and ms[3].spec_params(t).synth_len == 2.5
    for bad in ("ngram-cache", "foo", "synth:x", "synth:0.5", "lookup:0", "ngram-mod+ngram-mod", ""):
        with pytest.raises(UsageError):
            parse_modes(bad) if bad else parse_mode(bad)


def test_fixed_length_and_default_modes():
    """``draft-simple:N`` fixes the draft n_max for every engine; ``default`` is llamaspec's own settings."""
    fixed, default = parse_modes("draft-simple:8,default")
    assert fixed.name == "draft-simple:8" and fixed.spec_params(SpecParams()).draft.n_max == 8
    a = spec_args(fixed, SpecParams(), "/d.gguf")
    assert a[a.index("--spec-draft-n-max") + 1] == "8" and a[a.index("--spec-type") + 1] == "draft-simple"
    p = default.spec_params(SpecParams())
    assert default.is_default and default.uses_draft and not default.needs_draft
    assert p.is_auto and p.draft_adaptive_on() and p.draft.n_max > 3
    from llamaspec.bench.runners import NativeRunner, RunSettings

    native = NativeRunner("/t.gguf", "/d.gguf", RunSettings(n_ctx=256, n_batch=64, threads=1, flash_attn=False, seed=1, spec=SpecParams()))
    assert "llamaspec's own" in native.supports(default)
    for bad in ("ngram-mod:4", "draft-simple:x", "draft-simple:0"):
        with pytest.raises(UsageError):
            parse_mode(bad)


def test_spec_args_match_llamaspec_settings():
    p = SpecParams()
    p.draft.n_max = 5
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 16, 8, 32
    a = spec_args(parse_mode("ngram-mod+draft-simple"), p, "/d.gguf")
    assert a[a.index("--spec-type") + 1] == "ngram-mod,draft-simple"
    assert a[a.index("-md") + 1] == "/d.gguf" and a[a.index("--spec-draft-n-max") + 1] == "5"
    assert [a[a.index(f) + 1] for f in ("--spec-ngram-mod-n-match", "--spec-ngram-mod-n-min", "--spec-ngram-mod-n-max")] == ["16", "8", "32"]
    s = spec_args(parse_mode("synth:3"), p, "/d.gguf")
    assert s[s.index("--spec-synth-len") + 1] == "3.0"
    m = spec_args(parse_mode("ngram-map-k"), p, None)
    assert m[m.index("--spec-ngram-map-k-size-n") + 1] == "12"


def test_shipped_prompts():
    ps = load_prompts()
    assert 8 <= len(ps) <= 20
    for c in CATEGORIES:
        assert sum(1 for p in ps if p.category == c) >= 2
    assert all(len(p.text) < 2000 for p in ps)  # well under 400 tokens
    q = quick_subset(ps, 3, 50)
    assert len(q) == 3 and len({p.category for p in q}) == 3 and all(len(p.text) <= 50 for p in q)


def test_user_prompt_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "id": "x", "category": "c"}\n\nplain line\\nsecond\n{"prompt": "b"}\n')
    ps = load_prompts(f)
    assert [(p.id, p.category, p.text) for p in ps] == [("x", "c", "a"), ("p2", "custom", "plain line\nsecond"),
                                                        ("p3", "custom", "b")]
    f.write_text('{"id": "x"}\n')
    with pytest.raises(UsageError, match=":1:"):
        load_prompts(f)
    f.write_text('{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n')
    with pytest.raises(UsageError, match="duplicate"):
        load_prompts(f)
    with pytest.raises(UsageError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_metrics_delta_parsing():
    m = parse_metrics("# HELP x y\nllamacpp:spec_decode_num_drafts_total 11\n"
                      'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 3\n'
                      'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 5\nbroken\n')
    assert m["spec_decode_num_drafts_total"] == 11.0
    assert per_pos_from_metrics(m) == [5, 3]
    assert per_pos_from_metrics({}) == []


def test_parse_spec_simple_without_stats_line():
    err = "encoded   10 tokens in    0.010 seconds, speed: 1 t/s\ndecoded   33 tokens in    1.000 seconds\nn_drafted = 12\nn_accept  = 9\n"
    r = parse_spec_simple("\n\n<bos>Hi there\n\n\n\n", err, "<bos>Hi")
    assert (r.n_prompt, r.n_predicted, r.t_decode_s, r.n_drafted, r.n_accepted, r.n_verif_steps) == (10, 33, 1.0, 12, 9, None)
    assert r.text == " there"
    from llamaspec.bench.native import NativeError

    with pytest.raises(NativeError):
        parse_spec_simple("", "nothing", None)


def test_lookup_stats_counts_matching_prefixes():
    seq = [0, 1, 2, 3, 4, 5, 6, 7]
    # prompt = 3 tokens; drafts made after 3, 4 and 6 tokens; the last one runs past the end
    calls = [(3, [3, 9]), (4, [4, 5, 6]), (6, []), (7, [7, 8, 9])]
    assert lookup_stats(calls, seq, len(seq)) == (8, 5, 3, [3, 1, 1])


# -------------------------------------------------------------------------------------------------
# rendering
# -------------------------------------------------------------------------------------------------


def _fake_report() -> dict:
    res = [_run("llamaspec", "plain", "a", 0, 11, 1.0), _run("native", "plain", "a", 0, 11, 0.9),
           _run("llamaspec", "ngram-mod", "a", 0, 11, 0.5, n_drafted=10, n_accepted=5, n_verif_steps=2, accepted_per_pos=[2, 2, 1]),
           _run("native", "ngram-mod", "a", 0, 11, 0.45, n_drafted=10, n_accepted=5, n_verif_steps=2, accepted_per_pos=[2, 2, 1])]
    rows = aggregate(res, cost_ratio=None, verify_curve={"1": 1.0, "8": 2.0})
    return {
        "schema_version": 1, "created": "now", "command": "llamaspec bench --x", "duration_s": 1.0,
        "machine": {"cpu": "cpu", "n_cpus_available": 2, "loadavg_at_start": [0.1, 0.2, 0.3]},
        "settings": {"target": "T|x", "draft": None, "modes": ["plain", "ngram-mod"], "engines": ["llamaspec", "native"],
                     "n_prompts": 1, "prompts": "shipped", "n_predict": 11, "repeats": 1, "n_ctx": 256, "n_batch": 64,
                     "threads": 2, "flash_attn": True, "kv_cache": "f16", "sampling": "greedy", "draft_n_max": 3,
                     "ngram_mod": {"n_match": 24, "n_min": 48, "n_max": 64}, "ngram_simple": {"size_n": 12, "size_m": 48},
                     "schedule": "abc", "near_tie_tol": 0.5},
        "costs": {"verify_curve_ms": {"1": 1.0, "8": 2.0}, "verify_cost_rel": {"1": 1.0, "8": 2.0}},
        "notes": ["native tools missing"], "skipped": [{"engine": "llama-cpp-python", "mode": "ngram-mod", "reason": "no"}],
        "errors": [], "rows": rows,
        "per_category": [{"engine": "llamaspec", "mode": "plain", "category": "cat-a", "decode_tps_median": 10.0}],
        "per_prompt": [],
        "equality": {"reference": "llamaspec/plain", "n_compared": 3,
                     "divergences": [{"engine": "native", "mode": "ngram-mod", "prompt_id": "a", "index": 7, "repeats": [0],
                                      "near_tie": True, "ref_other_gap": 0.01, "ref_piece": "x", "other_piece": "y"}],
                     "stats_parity": [{"mode": "ngram-mod", "prompt_id": "a", "native_engine": "native",
                                       "native_tool": "llama-server", "llamaspec": [10, 5, 2], "native": [10, 5, 2],
                                       "match": True}]},
        "runs": [r.to_dict(with_tokens=False) for r in res],
    }


def test_render_markdown():
    md = R.render_markdown(_fake_report())
    assert md.startswith("# Benchmark: T|x")
    assert "| engine | mode | tool | tok/s | min–max |" in md
    assert "| llamaspec | ngram-mod | " in md
    assert "| native | ngram-mod | " in md
    assert "T\\|x" not in md.splitlines()[0]  # the title is not a table cell
    assert "near-tie" in md and "| native | ngram-mod | a | 7 | near-tie |" in md
    assert "1 of 1 identical" in md
    assert "native tools missing" in md and "skipped llama-cpp-python / ngram-mod" in md
    assert "llamaspec ngram-mod: 20.0 tok/s, 2.00x over plain, 0.90 of native, acceptance 50.0%" in md
    # every table row has the header's number of cells
    for block in md.split("\n\n"):
        lines = [x for x in block.splitlines() if x.startswith("|")]
        if lines:
            n = lines[0].count(" | ")
            assert all(x.count(" | ") - x.count("\\|") == n for x in lines if not x.startswith("|---")), block


def test_rich_table_and_plot(tmp_path):
    from rich.console import Console

    rep = _fake_report()
    con = Console(width=200, record=True)
    con.print(R.rich_table(rep))
    assert "ngram-mod" in con.export_text()
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    R.plot_png(rep, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_matplotlib_is_optional(tmp_path, monkeypatch):
    """Without matplotlib the package and the CLI import and run; asking for a PNG says how to get it."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import llamaspec, llamaspec.bench, llamaspec.bench.report, llamaspec.cli.bench\n"
            "from click.testing import CliRunner\n"
            "from llamaspec.cli.main import main\n"
            "r = CliRunner().invoke(main, ['bench', '--help'])\n"
            "assert r.exit_code == 0, r.output\n"
            "assert not any(m.startswith('matplotlib.') for m in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    out = tmp_path / "p.png"
    with pytest.raises(UsageError, match=r"install llamaspec\[plot\]") as ei:
        R.plot_png(_fake_report(), out)
    assert "\n" not in str(ei.value) and not out.exists()
    r = _invoke(["--quick", "--no-progress", "--plot", str(out)])
    assert r.exit_code == 2 and "install llamaspec[plot]" in r.output and "Traceback" not in r.output
    assert not out.exists()


def test_write_atomic(tmp_path):
    p = tmp_path / "sub" / "f.txt"
    R.write_atomic(p, "one")
    R.write_atomic(p, b"two")
    assert p.read_text() == "two"
    assert [x.name for x in p.parent.iterdir()] == ["f.txt"]


# -------------------------------------------------------------------------------------------------
# the CLI (smoke test: runs in CI)
# -------------------------------------------------------------------------------------------------


def _invoke(args):
    from llamaspec.cli.main import main

    return CliRunner().invoke(main, ["bench", *args], catch_exceptions=False)


def _assert_portable(js, md, home):
    """A report names files under the home directory as ``~/...``, never by this machine's absolute paths (they
    get committed); the tiny models of ``--quick`` are made under the (test's) home here."""
    for f in (js, md):
        assert str(home) + "/" not in f.read_text(), f
    assert "~/tmp/llamaspec-bench-quick-" in js.read_text()


def _home_with_tmp(tmp_path, monkeypatch):
    import tempfile

    home = tmp_path / "home"
    (home / "tmp").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(tempfile, "tempdir", str(home / "tmp"))
    return home


def test_bench_quick_smoke(tmp_path, monkeypatch):
    home = _home_with_tmp(tmp_path, monkeypatch)
    js, md, png = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "b.png"
    r = _invoke(["--quick", "--no-progress", "--json", str(js), "--markdown", str(md), "--plot", str(png)])
    assert r.exit_code == 0, r.output
    rep = json.loads(js.read_text())
    rows = {(x["engine"], x["mode"]): x for x in rep["rows"]}
    assert rep["row_modes"] == ["plain", "draft-simple", "ngram-mod cold", "ngram-simple", "ngram-map-k", "lookup:10"]
    for mode in ("plain", "draft-simple", "ngram-mod cold", "ngram-simple", "ngram-map-k"):
        row = rows[("llamaspec", mode)]
        assert row["n_runs"] == 3 and row["n_errors"] == 0 and row["decode_tps"]["median"] > 0
    assert rows[("llama-cpp-python", "plain")]["n_runs"] == 3
    assert rows[("llama-cpp-python", "lookup:10")]["spec"]["n_verif_steps"] is not None
    ds = rows[("llamaspec", "draft-simple")]
    assert ds["spec"]["n_drafted"] > 0 and ds["predicted_speedup"] is not None and ds["efficiency"] is not None
    assert rep["errors"] == []
    # greedy outputs on the tiny models: every engine equals the reference, or differs only at a near-tie
    assert rep["equality"]["n_compared"] > 0
    assert all(d.get("near_tie") for d in rep["equality"]["divergences"]), rep["equality"]["divergences"]
    native_built = ("native", "plain") in rows
    if native_built:
        assert rows[("llamaspec", "plain")]["ratio_llamaspec_native"] is not None
        assert rows[("native", "ngram-mod cold")]["tool"] == "llama-server"
        # identical token streams through llama-server give identical drafted/accepted/step counts
        server = [p for p in rep["equality"]["stats_parity"] if p["native_tool"] == "llama-server"]
        assert server and all(p["match"] for p in server), server
    else:
        assert any("not built" in n for n in rep["notes"])
    assert md.read_text().startswith("# Benchmark: tiny llama")
    _assert_portable(js, md, home)
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the speedup model per prompt kind: one entry per category for the drafting modes, each with a prediction
    pcm = [x for x in rep["per_category_model"] if x["engine"] == "llamaspec" and x["mode"] == "draft-simple"]
    assert len(pcm) == len({x["category"] for x in rep["per_category"]})
    assert all(x["predicted_speedup"] and x["speedup"] for x in pcm)
    assert "## Speedup against the model by prompt category" in md.read_text()


def test_bench_skips_native_when_not_built(tmp_path):
    js = tmp_path / "b.json"
    r = _invoke(["--quick", "--no-progress", "--engines", "llamaspec,native", "--modes", "plain,ngram-mod",
                 "--native-dir", str(tmp_path / "nothing"), "--no-costs", "--json", str(js)])
    assert r.exit_code == 0, r.output
    rep = json.loads(js.read_text())
    assert {x["engine"] for x in rep["rows"]} == {"llamaspec"}
    assert {x["mode"] for x in rep["rows"]} == {"plain", "ngram-mod cold"}
    assert any("not built" in n for n in rep["notes"])
    assert rep["costs"] is None


def test_bench_usage_errors(tmp_path):
    r = CliRunner().invoke(__import__("llamaspec.cli.main", fromlist=["main"]).main, ["bench", "--quick", "--modes", "ngram-cache"])
    assert r.exit_code == 2 and "ngram-cache" in r.output
    r = CliRunner().invoke(__import__("llamaspec.cli.main", fromlist=["main"]).main, ["bench", "--quick", "--engines", "vllm"])
    assert r.exit_code == 2 and "unknown engine" in r.output
    r = CliRunner().invoke(__import__("llamaspec.cli.main", fromlist=["main"]).main,
                           ["bench", "--quick", "--json", str(tmp_path / "no" / "x.json")])
    assert r.exit_code == 2 and "does not exist" in r.output


def test_bench_from_json_rerenders(tmp_path):
    js, js2, md = tmp_path / "b.json", tmp_path / "c.json", tmp_path / "c.md"
    assert _invoke(["--quick", "--no-progress", "--engines", "llamaspec", "--modes", "plain,ngram-mod", "--repeats", "2",
                    "--no-costs", "--json", str(js)]).exit_code == 0
    rep = json.loads(js.read_text())
    assert rep["row_modes"] == ["plain", "ngram-mod cold", "ngram-mod warm"]
    r = _invoke(["--from-json", str(js), "--json", str(js2), "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    rep2 = json.loads(js2.read_text())
    # the saved runs carry rounded times: the same rows up to rounding
    assert [(x["engine"], x["mode"]) for x in rep2["rows"]] == [(x["engine"], x["mode"]) for x in rep["rows"]]
    for a, b in zip(rep["rows"], rep2["rows"]):
        assert b["decode_tps"]["median"] == pytest.approx(a["decode_tps"]["median"], rel=1e-3)
        assert b["spec"] == a["spec"]
    assert "ngram-mod warm" in md.read_text() and "cold / warm" in md.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    assert _invoke(["--from-json", str(bad)]).exit_code == 2


def test_bench_server_quick(tmp_path, monkeypatch):
    """``--server --quick``: llamaspec serve on the tiny pair with 1 and 2 clients (llama-server when built)."""
    from importlib.util import find_spec

    home = _home_with_tmp(tmp_path, monkeypatch)
    if find_spec("starlette") is None or find_spec("uvicorn") is None:
        pytest.skip('bench --server needs the server extra: pip install "llamaspec[server]"')
    js, md, png = tmp_path / "s.json", tmp_path / "s.md", tmp_path / "s.png"
    plot = ["--plot", str(png)] if find_spec("matplotlib") is not None else []
    r = _invoke(["--quick", "--server", "--clients", "1,2", "-n", "8", "--native-dir", str(tmp_path / "nothing"),
                 "--json", str(js), "--markdown", str(md), *plot])
    assert r.exit_code == 0, r.output
    rep = json.loads(js.read_text())
    assert rep["kind"] == "server" and rep["settings"]["n_parallel"] == 4
    rows = {(x["variant"], x["clients"]): x for x in rep["rows"]}
    # llama-server is not built here: llamaspec's two overhead settings, plain and a fixed draft length
    assert set(rows) == {("ls:plain", 1), ("ls:plain", 2), ("ls:parity:3", 1), ("ls:parity:3", 2)}
    for (key, _), row in rows.items():
        assert row["n_errors"] == 0 and row["tps_median"] > 0
        assert (row["acceptance"] is not None) == (key != "ls:plain")
    # every request generated n_predict tokens or stopped early; on --quick each of 2 clients sends 32 requests
    run2 = [x for x in rep["runs"] if x["clients"] == 2][0]
    assert run2["n_requests"] == run2["n_ok"] == 64 and 0 < run2["predicted_n"] <= 64 * 8
    assert rep["settings"]["requests_per_client"] == 32
    assert any("not built" in n for n in rep["notes"])
    assert md.read_text().startswith("# llamaspec bench --server")
    _assert_portable(js, md, home)
    if plot:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --requests-per-client, else the prompts shared out: 2 clients send 2 * ceil(3 / 2)
    r = _invoke(["--quick", "--server", "--clients", "2", "-n", "4", "--requests-per-client", "3", "--server-variants",
                 "ls:plain", "--json", str(js)])
    assert r.exit_code == 0, r.output
    assert [x["n_requests"] for x in json.loads(js.read_text())["runs"]] == [6]
    r = _invoke(["--quick", "--server", "--clients", "1,x"])
    assert r.exit_code == 2 and "--clients" in r.output
    r = _invoke(["--quick", "--server", "--server-variants", "ls:nope"])
    assert r.exit_code == 2 and "ls:nope" in r.output and "ls:defaults" in r.output
    r = _invoke(["--quick", "--server-variants", "ls:plain"])
    assert r.exit_code == 2 and "--server" in r.output


def test_keep_alive_client_reconnects_and_reports_errors():
    """``bench --server``'s client: one connection for many requests, a new one when the server dropped the
    idle connection (or said ``Connection: close``), and an HTTP error as a LlamaSpecError."""
    import http.server
    import threading

    from llamaspec.bench.native import KeepAlive
    from llamaspec.errors import LlamaSpecError

    seen: list[tuple[int, str]] = []  # (client port, path) per request

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.client_address[1], self.path))
            status, data = (500, b"boom") if self.path == "/fail" else (200, json.dumps({"n": len(seen)}).encode())
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            if self.path == "/close":
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            if self.path == "/drop":  # goes away without saying so: the next request finds the socket closed
                self.close_connection = True

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        c = KeepAlive(srv.server_address[1], timeout=10)
        assert c.post_json("/a", {}, "s") == {"n": 1}
        assert c.post_json("/a", {}, "s") == {"n": 2}
        assert seen[0][0] == seen[1][0]  # the same connection
        c.post_json("/drop", {}, "s")
        assert c.post_json("/a", {}, "s") == {"n": 4}  # retried once on a new connection
        c.post_json("/close", {}, "s")
        assert c.conn is None  # closed as the server asked
        assert c.post_json("/a", {}, "s") == {"n": 6}
        assert len({p for p, _ in seen}) == 3
        with pytest.raises(LlamaSpecError, match="s: HTTP 500"):
            c.post_json("/fail", {}, "s")
        c.close()
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("script", ["best_fixed_ratio.py"])
def test_script_doctests(script):
    """The report scripts' worked examples (best_fixed_ratio: decode against whole-request rates) hold."""
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / script
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = doctest.testmod(mod)
    assert res.attempted > 0 and res.failed == 0
