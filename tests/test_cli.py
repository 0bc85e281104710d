"""CLI: exit codes, one-line errors, stdout carries only generated text."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from llamaspec.cli.main import main

from helpers import real_model


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_generate_stdout_is_only_text(tiny_model, tmp_path):
    stats = tmp_path / "s.json"
    r = run("generate", "tok_5 tok_9", "-m", str(tiny_model("llama")), "-n", "12", "--temp", "0",
            "--stats-json", str(stats))
    assert r.exit_code == 0, r.output
    assert r.stdout and "generated" not in r.stdout  # stats went to stderr
    assert "generated" in r.stderr
    d = json.loads(stats.read_text())
    assert d["n_predicted"] == 12 and d["finish_reasons"] == ["length"]


def test_generate_is_deterministic_and_pipes(tiny_model):
    a = run("generate", "tok_5", "-m", str(tiny_model("llama")), "-n", "10", "--temp", "0", "-q")
    b = run("generate", "-m", str(tiny_model("llama")), "-n", "10", "--temp", "0", "-q", input="tok_5")
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout and a.stdout


def test_prompt_from_file(tiny_model, tmp_path):
    p = tmp_path / "prompt.txt"
    p.write_text("tok_5")
    a = run("generate", "-f", str(p), "-m", str(tiny_model("llama")), "-n", "5", "--temp", "0", "-q")
    b = run("generate", "tok_5", "-m", str(tiny_model("llama")), "-n", "5", "--temp", "0", "-q")
    assert a.exit_code == 0 and a.stdout == b.stdout


@pytest.mark.parametrize(
    "args,code,msg",
    [
        (["generate", "x", "-m", "/no/such/model.gguf"], 2, "no such file"),
        (["generate", "x", "-m", "no-such-model-name"], 2, "models list"),
        (["generate", "x", "--temp", "-1"], 2, "Invalid value"),
        (["generate", "x", "--top-p", "2"], 2, "Invalid value"),
        (["generate", "x", "-n", "-5"], 2, "Invalid value"),
        (["generate", "x", "--system", "be nice"], 2, "--system needs --chat"),
        (["generate", "-f", "/no/such/prompt.txt"], 2, "prompt file not found"),
        (["generate", "x", "--grammar-file", "/no/such.gbnf"], 2, "grammar file not found"),
    ],
)
def test_usage_errors(args, code, msg):
    r = run(*args)
    assert r.exit_code == code, r.output
    assert msg in r.output
    assert "Traceback" not in r.output


def test_not_a_gguf_is_one_line_runtime_error(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("hello")
    r = run("generate", "x", "-m", str(p))
    assert r.exit_code == 1
    assert "not a GGUF file" in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1


def test_truncated_gguf(tmp_path, tiny_model):
    data = tiny_model("llama").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:3000])
    r = run("generate", "x", "-m", str(p))
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "truncated" in r.stderr or "incomplete" in r.stderr


def test_prompt_longer_than_context(tiny_model):
    r = run("generate", "tok_5 " * 400, "-m", str(tiny_model("llama")), "-c", "256")
    assert r.exit_code == 2
    assert "context" in r.stderr and "Traceback" not in r.output


def test_bad_grammar_file(tiny_model, tmp_path):
    g = tmp_path / "g.gbnf"
    g.write_text("root ::= (")
    r = run("generate", "x", "-m", str(tiny_model("llama")), "--grammar-file", str(g))
    assert r.exit_code == 1 and "grammar" in r.stderr and "Traceback" not in r.output


def test_debug_shows_traceback(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_text("hello")
    r = run("--debug", "generate", "x", "-m", str(p))
    assert r.exit_code != 0 and r.exception is not None


@pytest.mark.real
def test_default_pair_generates():
    from llamaspec.models import load_registry

    pair = load_registry().pair(load_registry().default_pair)  # the README's first command speculates with it
    real_model(pair.target), real_model(pair.draft)  # fetched (and derived) on first use
    r = run("generate", "def fibonacci(n):", "-n", "24", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip()) > 10
    s = r.stderr.strip().splitlines()[-1]
    assert s.startswith("generated 24 tokens at") and _says_vs_plain(s) and "acceptance" in s


@pytest.mark.real
def test_chat_and_grammar(tmp_path):
    path = str(real_model("smollm2-135m-q4_1"))
    g = tmp_path / "yesno.gbnf"
    g.write_text('root ::= ("yes" | "no")\n')
    r = run("generate", "Is the sky blue? Answer yes or no.", "-m", path, "--chat", "--grammar-file", str(g),
            "-n", "8", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() in ("yes", "no")


def test_unwritable_stats_json_fails_before_work(tiny_model):
    r = run("generate", "x", "-m", str(tiny_model("llama")), "--stats-json", "/no/such/dir/s.json")
    assert r.exit_code == 2 and "does not exist" in r.stderr and r.stdout == ""


def test_draft_heads_are_refused_clearly(tiny_model):
    r = run("generate", "x", "-n", "3", "-m", str(tiny_model("eagle3")))
    assert r.exit_code == 2 and "eagle3" in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) <= 2


def test_a_head_reading_a_layer_the_target_lacks_runs_with_one_warning(tiny_model, caplog):
    """The tiny head reads layer id n_layer (the nextn state), which a llama target does not write: llama.cpp
    runs the pair anyway (tests/test_eagle3.py), and so does llamaspec, with one warning line."""
    r = run("generate", "x", "-n", "3", "-md", str(tiny_model("eagle3")), "-m", str(tiny_model("llama")))
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    assert sum("does not provide" in rec.getMessage() for rec in caplog.records) == 1


def test_pair_conflicts_with_model():
    r = run("generate", "x", "--pair", "gemma3-270m", "-m", "foo.gguf")
    assert r.exit_code == 2 and "--pair" in r.stderr


def test_unknown_pair():
    r = run("generate", "x", "--pair", "no-such-pair")
    assert r.exit_code == 2 and "unknown pair" in r.stderr


# -------------------------------------------------------------------------------------------------
# the first run (issue 14): default pair, the summary line, the overview
# -------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_registry(tiny_model, tmp_path, monkeypatch):
    """models.toml whose default pair is two tiny models (nothing to fetch); no user file merged."""
    toml = tmp_path / "models.toml"
    toml.write_text(
        '[defaults]\nmodel = "tiny-target"\npair = "tiny"\n'
        f'[models.tiny-target]\npath = "{tiny_model("llama")}"\n'
        f'[models.tiny-draft]\npath = "{tiny_model("llama-draft")}"\n'
        '[pairs.tiny]\ntarget = "tiny-target"\ndraft = "tiny-draft"\n'
    )
    monkeypatch.setenv("LLAMASPEC_MODELS_TOML", str(toml))
    monkeypatch.setenv("LLAMASPEC_USER_MODELS_TOML", str(tmp_path / "no-user-models.toml"))
    return toml


def _summary(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert lines, "no summary line on stderr"
    return lines[-1]


def _says_vs_plain(s: str) -> bool:
    """The summary's word on plain decoding: an estimate, the run's own plain rounds, or, on a machine too busy
    for either, that it was not estimated (never a confident figure from noise)."""
    return any(x in s for x in ("x vs plain (estimated:", "x vs plain (measured in-run:", "vs plain: not estimated"))


def test_summary_says_when_the_machine_was_too_busy():
    from llamaspec.cli.generate import NOISY_SPREAD, _in_run_plain, _summary_line
    from llamaspec.referee import Referee

    class E:  # the parts of an engine the summary reads
        chain = type("C", (), {"types": ["draft-simple"]})()
        referee = Referee()

    e = E()
    assert _in_run_plain(e) is None                          # no plain round measured yet
    for t in (0.010, 0.011, 0.010, 0.012):
        e.referee.record(False, 1, 1, t)
    b = _in_run_plain(e)
    assert b["kind"] == "measured in-run" and b["n_plain_rounds"] == 4 and not b["noisy"]
    stats = {"n_predicted": 10, "decode_tokens_per_second": 200.0, "n_drafted": 0,
             "baseline": {**b, "speedup": 2.0}}
    assert "2.00x[/] vs plain (measured in-run:" in _summary_line(e, stats)
    for t in (0.030, 0.004, 0.02, 0.003, 0.05):              # another process takes the cores now and then
        e.referee.record(False, 1, 1, t)
    b = _in_run_plain(e)
    assert b["noisy"] and b["spread"] > NOISY_SPREAD
    line = _summary_line(e, {**stats, "baseline": {**b, "speedup": 2.0}})
    assert "not estimated, the machine was busy" in line and "2.00x" not in line


def test_no_model_uses_the_default_pair(tiny_registry, tiny_model, tmp_path):
    stats = tmp_path / "s.json"
    r = run("generate", "tok_5 tok_9", "-n", "12", "--temp", "0", "--stats-json", str(stats))
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["model"] == str(tiny_model("llama")) and d["draft_model"] == str(tiny_model("llama-draft"))
    assert d["spec_types"] == ["ngram-lookup", "draft-simple"] and d["n_drafted"] > 0  # the default: --spec-type auto
    assert d["baseline"]["kind"] in ("estimated", "measured in-run") and d["baseline"]["plain_tokens_per_second"] > 0
    # greedy: the same text as plain decoding of the target
    plain = run("generate", "tok_5 tok_9", "-n", "12", "--temp", "0", "-q", "-m", str(tiny_model("llama")))
    assert plain.exit_code == 0 and plain.stdout == r.stdout


def test_model_alone_is_plain(tiny_registry, tiny_model, tmp_path):
    # -m alone drafts with n-grams by default (--spec-type auto); --spec-type none (or --spec-parity) is plain
    stats = tmp_path / "s.json"
    for flags in (["--spec-type", "none"], ["--spec-parity"]):
        r = run("generate", "tok_5 tok_9", "-n", "8", "--temp", "0", "-m", "tiny-target", "--stats-json", str(stats), *flags)
        assert r.exit_code == 0, r.output
        d = json.loads(stats.read_text())
        assert d["draft_model"] is None and d["spec_types"] == [] and "baseline" not in d
        assert "plain decoding" in _summary(r.stderr)
    r = run("generate", "tok_5 tok_9", "-n", "8", "--temp", "0", "-m", "tiny-target", "--stats-json", str(stats))
    assert r.exit_code == 0, r.output
    d = json.loads(stats.read_text())
    assert d["draft_model"] is None and d["spec_types"] == ["ngram-lookup"]


def test_summary_line_is_one_glanceable_line(tiny_registry):
    r = run("generate", "tok_5 tok_9", "-n", "12", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # the summary only, no table
    s = _summary(r.stderr)
    for part in ("generated 12 tokens at", "tok/s", "acceptance", "mean accepted length"):
        assert part in s, s
    assert _says_vs_plain(s), s
    # stdout and stderr mixed (CliRunner cannot tell them apart): the summary starts its own line
    assert "\n" + s in r.output and r.stdout and not r.stdout.endswith("\n")


def test_summary_on_its_own_line_in_one_file(tiny_registry, tmp_path):
    import subprocess
    import sys

    log = tmp_path / "run.log"
    with log.open("w") as f:
        p = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "generate", "tok_5 tok_9", "-n", "12", "--temp", "0"],
                           stdout=f, stderr=subprocess.STDOUT, timeout=300)
    assert p.returncode == 0, log.read_text()
    text, _, last = log.read_text().rstrip("\n").rpartition("\n")
    assert last.startswith("generated 12 tokens at"), log.read_text()
    assert text and "generated" not in text
    # stdout alone (a file of its own) is exactly the text: no newline added
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as fo, err.open("w") as fe:
        p = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "generate", "tok_5 tok_9", "-n", "12", "--temp", "0"],
                           stdout=fo, stderr=fe, timeout=300)
    assert p.returncode == 0 and out.read_text() == text
    assert err.read_text().startswith("generated 12 tokens at")


def test_quiet_prints_nothing_but_the_text(tiny_registry):
    r = run("generate", "tok_5 tok_9", "-n", "8", "--temp", "0", "-q")
    assert r.exit_code == 0 and r.stdout and r.stderr == ""


@pytest.mark.parametrize("flag", [["--stats"], ["-v"], ["GROUP-v"]])
def test_stats_shows_the_full_table(tiny_registry, flag):
    args = ["generate", "tok_5 tok_9", "-n", "12", "--temp", "0"]
    args = ["-v"] + args if flag == ["GROUP-v"] else args + flag
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "speculative decoding" in r.stderr and "drafted" in r.stderr  # the table
    assert "statistics     draft-simple" in r.stderr  # llama.cpp's line
    assert "plain estimate" in r.stderr or "plain measured in-run" in r.stderr
    assert _summary(r.stderr).startswith("generated 12 tokens at")


def test_baseline_measures_plain(tiny_registry, tmp_path):
    stats = tmp_path / "s.json"
    r = run("generate", "tok_5 tok_9", "-n", "12", "--temp", "0", "--baseline", "--stats-json", str(stats))
    assert r.exit_code == 0, r.output
    b = json.loads(stats.read_text())["baseline"]
    assert b["kind"] == "measured" and b["plain_tokens_per_second"] > 0 and b["speedup"] > 0
    assert "x vs plain (measured:" in _summary(r.stderr)


def test_no_arguments_prints_the_overview(tiny_registry):
    r = run()
    assert r.exit_code == 0, r.output
    out = r.output
    assert "Try first" in out and "Usage:" not in out
    assert 'llamaspec generate "def fibonacci(n):" --temp 0' in out and "default pair tiny" in out
    assert "llamaspec probe tiny-target -md tiny-draft" in out
    assert "serve" in out
    assert "Usage:" in run("--help").output


def test_estimate_arithmetic():
    import doctest

    import llamaspec.estimate as est

    assert doctest.testmod(est).failed == 0
