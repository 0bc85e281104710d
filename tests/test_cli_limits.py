"""CLI behaviour at the limits (issue 9): -n 0, small batches with n-gram drafters, many slots, small -b."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

from llamaspec.cli.main import main


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


def test_n_predict_zero_says_so(tiny_model):
    r = run("generate", "tok_5 tok_9", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")),
            "-n", "0", "--temp", "0")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == ""
    assert "nothing generated" in r.stderr


@pytest.mark.parametrize("spec_type", ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"])
def test_small_batch_with_ngram_drafters(tiny_model, spec_type):
    prompt = "abcdefghij" * 40  # repetitive text: long drafts
    args = ["generate", prompt, "-m", str(tiny_model("llama")), "-n", "40", "--temp", "0", "-q", "-b", "32"]
    plain = run(*args)
    short_keys = {"ngram-simple": ["--spec-ngram-simple-size-n", "1"], "ngram-map-k": ["--spec-ngram-map-k-size-n", "1"],
                  "ngram-map-k4v": ["--spec-ngram-map-k4v-size-n", "1"],
                  "ngram-mod": ["--spec-ngram-mod-n-match", "1", "--spec-ngram-mod-n-min", "1"]}.get(spec_type, [])
    spec = run(*args, "--spec-type", spec_type, *short_keys, "--stats-json", "/dev/null")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout


def test_four_slots_batch_16(tiny_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("tok_1 tok_2\ntok_3\ntok_4 tok_5 tok_6\ntok_7\n")
    base = ["generate", "--prompts-file", str(prompts), "-m", str(tiny_model("llama")), "-n", "16", "--temp", "0", "-q"]
    one = run(*base)
    many = run(*base, "-np", "4", "-b", "16", "-md", str(tiny_model("llama-draft")), "--spec-draft-n-max", "8")
    assert one.exit_code == 0 and many.exit_code == 0, many.output
    assert many.stdout == one.stdout


def test_logit_bias_flag(tiny_model):
    """``-l TOKEN_ID(+/-)BIAS`` as llama.cpp: ``-inf`` keeps tokens out of the output; a malformed value or an
    id outside the vocabulary is one line, exit code 2."""
    args = ["generate", "tok_5 tok_9 tok_3", "-m", str(tiny_model("llama")), "-n", "12", "--temp", "0", "-q",
            "--spec-type", "none"]
    plain = run(*args)
    assert plain.exit_code == 0, plain.output
    from llamaspec import _llama as L
    from llamaspec.engine import Engine

    with Engine(tiny_model("llama"), n_ctx=256) as e:
        toks = e.generate("tok_5 tok_9 tok_3", n_predict=12, sampling=L.SamplingParams(temp=0.0)).tokens
    assert toks
    banned = sorted(set(toks))[:2]
    biased = run(*args, *[x for t in banned for x in ("-l", f"{t}-inf")])
    assert biased.exit_code == 0, biased.output
    assert biased.stdout != plain.stdout
    for bad in ("abc", "5", "999999+1"):
        r = run(*args, "--logit-bias", bad)
        assert r.exit_code == 2 and "logit-bias" in r.stderr and "Traceback" not in r.output, r.output
