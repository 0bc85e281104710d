"""CLI: exit codes, one-line errors, stdout carries only generated text."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.main import main

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
def test_default_model_generates():
    real_model("smollm2-135m-q4_1")  # the default in models.toml; fetched on first use
    r = run("generate", "def fibonacci(n):", "-n", "24", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert len(r.stdout.strip()) > 10


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


@pytest.mark.parametrize("role", ["-m", "-md"])
def test_draft_heads_are_refused_clearly(tiny_model, role):
    args = ["generate", "x", "-n", "3", role, str(tiny_model("eagle3"))]
    if role == "-md":
        args += ["-m", str(tiny_model("llama"))]
    r = run(*args)
    assert r.exit_code == 2 and "eagle3" in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) <= 2


def test_pair_conflicts_with_model():
    r = run("generate", "x", "--pair", "gemma3-270m", "-m", "foo.gguf")
    assert r.exit_code == 2 and "--pair" in r.stderr


def test_unknown_pair():
    r = run("generate", "x", "--pair", "no-such-pair")
    assert r.exit_code == 2 and "unknown pair" in r.stderr
