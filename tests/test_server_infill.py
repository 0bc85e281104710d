"""``POST /infill`` (llama-server's fill-in-the-middle route): the prompt layout, speculative = plain greedy
output, streams, the 400s and the 501 of a model without FIM tokens, ``--spm-infill``.

The tiny models have no FIM tokens: :func:`support.fim.with_fim_tokens` gives a copy of the tiny
``llama`` three of its ids as FIM prefix / suffix / middle (and two more as separator / repository). A real
``llamaspec serve`` process (draft-simple with the tiny draft, so every request drafts) answers the route;
the layout, ``--spm-infill`` and the 501 are checked in process (Starlette's TestClient).
"""
from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from llamaspec.engine import Engine  # noqa: E402
from llamaspec.server.app import ServerConfig, ServerState, create_app  # noqa: E402
from llamaspec.server.infill import fim_prompt  # noqa: E402
from support.fim import with_fim_tokens  # noqa: E402
from llamaspec.testing.tiny_models import write_model  # noqa: E402

from support.server import Server  # noqa: E402 - the real-process helper

FIM = {"pre": 60, "suf": 61, "mid": 62, "sep": 59, "rep": 58}
BODY = {"input_prefix": "#include <stdio.h>\nint main() {\n", "input_suffix": "}\n", "prompt": "    int n = ",
        "input_extra": [{"filename": "util.h", "text": "int helper(void);\n"}, {"text": "no name\n"}],
        "n_predict": 24, "temperature": 0, "return_tokens": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("infill")
    plain = write_model("llama", d / "llama.gguf", n_ctx=1024, eos_token_id=63)
    fim = with_fim_tokens(plain, d / "llama-fim.gguf", **FIM)
    draft = write_model("llama-draft", d / "llama-draft.gguf", n_ctx=1024, eos_token_id=63)
    return {"plain": plain, "fim": fim, "draft": draft, "dir": d}


@pytest.fixture(scope="module")
def server(models):
    srv = Server(["-m", str(models["fim"]), "-md", str(models["draft"]), "--spec-type", "draft-simple",
                  "--no-spec-draft-adaptive", "-np", "2", "-c", "1024", "-b", "32", "-t", "1", "--temp", "0"],
                 models["dir"] / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _tokenize(http, text: str) -> list[int]:
    r = http.post("/tokenize", json={"content": text, "add_special": False, "parse_special": False})
    return r.json()["tokens"]


def _expected_prompt(tok, body: dict, *, n_batch: int, n_ctx: int, spm: bool) -> list[int]:
    class F:
        pre, suf, mid, pad, rep, sep = FIM["pre"], FIM["suf"], FIM["mid"], -1, FIM["rep"], FIM["sep"]

    return fim_prompt(F, tok, prefix=tok(body["input_prefix"]), suffix=tok(body["input_suffix"]),
                      extra=body["input_extra"], prompt=tok(body["prompt"]), n_batch=n_batch, n_predict=-1,
                      n_ctx=n_ctx, spm=spm, bos=None)


def test_infill_speculative_equals_plain_and_is_the_fim_prompt(http):
    spec = http.post("/infill", json=BODY).json()
    plain = http.post("/infill", json={**BODY, "speculative.n_max": 0}).json()
    assert spec["stop"] is True and spec["tokens_predicted"] == 24
    assert spec["content"] == plain["content"] and spec["tokens"] == plain["tokens"]
    assert spec["timings"]["draft_n"] > 0 and plain["timings"]["draft_n"] == 0  # the speculative path drafted
    # the prompt is llama-server's FIM layout (the extra context, the prefix + prompt, the suffix, FIM_MID):
    # the same tokens sent to /completion give the same greedy output
    expected = _expected_prompt(lambda s: _tokenize(http, s), BODY, n_batch=32, n_ctx=512, spm=False)
    tok = lambda s: _tokenize(http, s)  # noqa: E731
    tail = [FIM["pre"], *tok(BODY["input_prefix"]), *tok(BODY["prompt"]), FIM["suf"], *tok(BODY["input_suffix"]),
            FIM["mid"]]
    head = [FIM["rep"], *tok("myproject\n"), FIM["sep"], *tok("util.h\n"), *tok("int helper(void);\n"),
            FIM["sep"], *tok("tmp\n"), *tok("no name\n"), FIM["sep"], *tok("filename\n")]
    assert expected == head + tail  # the extra context (every file), prefix + prompt, suffix, middle
    assert spec["tokens_evaluated"] == len(expected)
    ref = http.post("/completion", json={"prompt": expected, "n_predict": 24, "temperature": 0,
                                         "return_tokens": True}).json()
    assert ref["tokens"] == spec["tokens"]


def test_infill_stream_is_the_whole_answer(http):
    whole = http.post("/infill", json=BODY).json()
    with http.stream("POST", "/infill", json={**BODY, "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and "data: [DONE]" not in lines  # /completion's stream: no [DONE]
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert events[-1]["stop"] is True and events[-1]["timings"]["predicted_n"] == 24
    assert "".join(e["content"] for e in events) == whole["content"]


@pytest.mark.parametrize("body,needle", [
    ({"input_extra": [{}]}, "\"text\" field"),
    ({"input_extra": [{"filename": "ok"}]}, "\"text\" field"),
    ({"input_extra": [{"filename": 123}]}, "\"text\" field"),
    ({"input_extra": [{"filename": 123, "text": "abc"}]}, "\"filename\" field must be a string"),
    ({"input_extra": [{"filename": 123, "text": 456}]}, "\"text\" field"),
    ({"input_extra": {"text": "x"}}, "must be an array"),
    ({"input_prefix": None}, "\"input_prefix\" is required"),
    ({"input_suffix": 5}, "Field 'input_suffix'"),
    ({"prompt": ["x"]}, "\"prompt\" must be a string"),
])
def test_infill_bad_requests_are_400(http, body, needle):
    data = {k: v for k, v in {**BODY, **body}.items() if v is not None}
    r = http.post("/infill", json=data)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_spm_infill_and_a_model_without_fim_tokens(models):
    with Engine(models["fim"], n_ctx=512, n_batch=32, cache_prompt=True) as eng:
        state = ServerState(ServerConfig(model_id="tiny", spm_infill=True, chat_template="chatml"), engine=eng)
        with TestClient(create_app(state)) as c:
            got = c.post("/infill", json=BODY).json()
            tok = lambda s: eng.tokenize(s, add_special=False, parse_special=False)  # noqa: E731
            expected = _expected_prompt(tok, BODY, n_batch=32, n_ctx=512, spm=True)
            tail = [FIM["suf"], *tok(BODY["input_suffix"]), FIM["pre"], *tok(BODY["input_prefix"]),
                    *tok(BODY["prompt"]), FIM["mid"]]
            assert expected[-len(tail):] == tail  # suffix, then prefix + prompt, then middle
            ref = c.post("/completion", json={"prompt": expected, "n_predict": 24, "temperature": 0,
                                              "return_tokens": True}).json()
            assert got["tokens_evaluated"] == len(expected) and got["tokens"] == ref["tokens"]
    with Engine(models["plain"], n_ctx=256, n_batch=32) as eng:
        state = ServerState(ServerConfig(model_id="tiny", chat_template="chatml"), engine=eng)
        with TestClient(create_app(state)) as c:
            r = c.post("/infill", json=BODY)
    assert r.status_code == 501 and r.json()["error"] == {
        "code": 501, "type": "not_supported_error",
        "message": "Infill is not supported by this model: prefix token is missing. suffix token is missing. "
                   "middle token is missing. "}


def test_fim_flags_are_honoured_not_warned():
    from llamaspec.cli.serve import serve
    from llamaspec.cli.server_compat import translate

    new, notes = translate(serve, ["--spm-infill", "--slot-save-path", "/tmp"], {})
    assert notes == [] and "--spm-infill" in new and "--slot-save-path" in new


def test_infill_doctests():
    import doctest

    import llamaspec.server.infill as mod

    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
