"""llama.cpp's other samplers (mirostat, DRY, XTC, typical, top-n-sigma, dynamic temperature, adaptive-p, the
sampler order) and llama-server's line limits (``n_indent``, ``t_max_predict_ms``): each changes the output,
and speculative decoding gives the tokens plain decoding gives with the same seed; where the native
llama-server is built (scripts/build_llama_cpp.sh), the same text as llama-server on the same requests."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from llamaspec import _llama as L
from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.params import SpecParams
from llamaspec.text import TextStream

from helpers import EXACT, real_model
from support.server import LLAMA_SERVER, llama_server, running, serve


CASES = {
    "mirostat2": dict(mirostat=2),
    "mirostat1": dict(mirostat=1, mirostat_tau=3.0),
    "typical": dict(typ_p=0.3),
    "dry": dict(dry_multiplier=3.0, dry_allowed_length=1),
    "xtc": dict(xtc_probability=1.0, xtc_threshold=0.05),
    "top_n_sigma": dict(top_n_sigma=0.5),
    "dynatemp": dict(dynatemp_range=0.7, temp=1.0),
    "order": dict(samplers=("temperature", "top_k"), top_k=2, temp=3.0),
    "adaptive_p": dict(samplers=("top_k", "adaptive_p"), adaptive_target=0.2, top_k=20),
}


def test_sampler_order_names_and_characters():
    assert L.sampler_order(["Top-K", "nucleus", "typ", "temp", "minp", "top_n_sigma"]) == (
        "top_k", "top_p", "typ_p", "temperature", "min_p", "top_n_sigma")
    assert L.sampler_order("edskypmxt") == L.SAMPLER_ORDER
    with pytest.raises(UsageError, match="unknown sampler 'tfs'"):
        L.sampler_order(["top_k", "tfs"])
    with pytest.raises(UsageError, match="character"):
        L.sampler_order("kq")
    with pytest.raises(UsageError, match="mirostat"):
        L.Sampler.from_params(None, L.SamplingParams(mirostat=3))  # validated before the vocabulary is touched


def test_line_limits_cut_as_llama_server():
    s = TextStream(n_indent=2)
    out = [s.feed(p.encode()) for p in ["def f():", "\n", "  ", "x = 1", "\n", "y", " = 2"]]
    assert "".join(out) == "def f():\n  x = 1\n" and s.text == "def f():\n  x = 1\n" and s.limited
    s = TextStream(t_max_predict_ms=1)
    s.feed(b"a")
    import time

    time.sleep(0.01)
    assert s.feed(b"b\nc") == "" and s.stopped and s.limited and s.text == "ab\nc"
    s = TextStream(n_indent=0)
    assert s.feed(b"x\ny") == "x\ny" and not s.stopped


@pytest.fixture(scope="module")
def engines(tiny_model):
    spec = SpecParams()
    spec.add_types("draft-simple")
    spec.draft.n_max, spec.draft_adaptive = 4, False
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as plain, \
            Engine(tiny_model("llama"), draft=tiny_model("llama-draft"), spec=spec, n_ctx=256,
                   verify="rejection", **EXACT) as spec_eng:
        yield plain, spec_eng


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_sampler_changes_the_output_and_speculation_keeps_it(engines, name):
    plain, spec_eng = engines
    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9]
    base = dict(temp=0.9, seed=11, top_k=40, top_p=0.95, min_p=0.05)
    default = plain.generate(prompt, n_predict=24, sampling=L.SamplingParams(**base)).tokens
    sampling = L.SamplingParams(**{**base, **CASES[name]})
    want = plain.generate(prompt, n_predict=24, sampling=sampling).tokens
    assert want != default, f"{name} changed nothing"
    # the engine verifies by rejection sampling; chains that pick outside ``dist`` verify by sample-and-match
    got = spec_eng.generate(prompt, n_predict=24, sampling=sampling)
    if L.picks_in_chain(sampling):
        assert got.tokens == want
    assert len(got.tokens) == 24


def test_greedy_dry_and_typical_move_the_argmax(engines):
    plain, spec_eng = engines
    prompt = [1, 5, 9, 13, 5, 9, 13, 5, 9]
    greedy = plain.generate(prompt, n_predict=24, sampling=L.SamplingParams(temp=0.0)).tokens
    for extra in (dict(dry_multiplier=3.0, dry_allowed_length=1), dict(typ_p=0.2)):
        s = L.SamplingParams(temp=0.0, **extra)
        want = plain.generate(prompt, n_predict=24, sampling=s).tokens
        assert want != greedy, extra
        assert spec_eng.generate(prompt, n_predict=24, sampling=s).tokens == want


# -- against llama-server ----------------------------------------------------------------------------
def _post(port: int, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": json.loads(e.read())}


SERVER_CASES = [
    dict(temperature=0.9, seed=5, mirostat=2),
    dict(temperature=0.9, seed=5, mirostat=1, mirostat_tau=3),
    dict(temperature=0.9, seed=5, typical_p=0.5),
    dict(temperature=0.9, seed=5, dry_multiplier=0.8, dry_allowed_length=1),
    dict(temperature=0, dry_multiplier=2.0, dry_allowed_length=1, dry_sequence_breakers=["\n"]),
    dict(temperature=0.9, seed=5, xtc_probability=0.5, xtc_threshold=0.1),
    dict(temperature=0.9, seed=5, top_n_sigma=1.0),
    dict(temperature=1.0, seed=5, dynatemp_range=0.5),
    dict(temperature=0.9, seed=5, samplers=["min_p", "temperature"], min_p=0.1),
    dict(temperature=0.9, seed=5, samplers="kt", top_k=3),
    dict(temperature=0, n_indent=4, prompt="def f(x):\n    if x:\n"),
]


@pytest.mark.real
@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_same_text_as_llama_server():
    model = str(real_model("smollm2-135m-q4_1"))
    common = ["-m", model, "-np", "1", "-c", "2048", "-t", "1"]
    with running(llama_server(common), serve([*common, "--spec-type", "ngram-lookup"])) as srvs:
        ports = [s.port for s in srvs]
        for case in SERVER_CASES:
            body = {"prompt": "Once upon a time, in a land far away, there was a list: 1, 2, 3, 1, 2, 3,",
                    "n_predict": 48, "cache_prompt": False, **case}
            native, ours = _post(ports[0], body), _post(ports[1], body)
            assert "content" in native and ours.get("content") == native["content"], case
            assert ours["stop_type"] == native["stop_type"], case
        bad = _post(ports[1], {"prompt": "x", "samplers": ["top_k", "tfs"]})
        assert bad["status"] == 400 and "samplers" in bad["error"]["error"]["message"]
