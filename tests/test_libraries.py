"""The libraries people put on top of llama-server and llama-cpp-python (issue 35), against a real
``llamaspec serve`` on 127.0.0.1 and a real ``llamaspec.Llama`` (SmolLM2-135M, temperature 0), each with and
without a draft model (the same text either way). ``pip install -e ".[libs]"`` installs them; a missing one
skips its tests with its name.

The reference runs the same checks: the server ones on the pinned llama-server (``native/bin/llama-server
--jinja``, skipped where scripts/build_llama_cpp.sh has not built it), the Python-class ones on
``llama_cpp.Llama``. A check the reference fails is a strict expected failure there only
(:func:`reference_fails`); on llamaspec every check must pass."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
from pydantic import BaseModel  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODEL = "smollm2-135m-q4_1"
SETTINGS = dict(temperature=0, max_tokens=48)


class User(BaseModel):
    name: str
    age: int


ASK = "Extract the user: Alice is 31 years old."
NATIVE = Path(__file__).resolve().parents[1] / "native" / "bin" / "llama-server"


@pytest.fixture(scope="module", params=["plain", "draft", "native"])
def server(request, tmp_path_factory):
    """``llamaspec serve`` without and with a draft model (SmolLM2 drafting for itself, every draft accepted
    or not, the text the same), then the reference llama-server on the same model."""
    from helpers import real_model
    from support.server import Server

    path = str(real_model(MODEL))
    d = tmp_path_factory.mktemp("libs")
    args = ["-m", path, "-c", "2048", "-t", "1"]
    if request.param == "native":
        if not NATIVE.exists():
            pytest.skip(f"the reference llama-server is not built ({NATIVE}; scripts/build_llama_cpp.sh)")
        s = Server([*args, "--jinja", "-np", "1"], d / "native.log", exe=[str(NATIVE)])
    else:
        draft = ["-md", path, "--spec-draft-n-max", "4"] if request.param == "draft" else ["--spec-type", "none"]
        s = Server([*args, *draft], d / "serve.log")
    s.native = request.param == "native"
    yield s
    s.stop()


def reference_fails(request, server, reason: str) -> None:
    """The check fails on the reference llama-server: a strict expected failure there (it must fail, for
    ``reason``), never on llamaspec."""
    if server.native:
        request.node.add_marker(pytest.mark.xfail(strict=True, reason=f"llama-server: {reason}"))


_seen: dict = {}


def same_as_plain(server, key: str, value):
    """The first server (plain) records ``value``; the draft one and the reference must give the same."""
    _seen.setdefault(key, value)
    assert value == _seen[key], (key, value, _seen[key])


# -- instructor -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "JSON", "TOOLS"])
def test_instructor(server, mode, request):
    instructor = pytest.importorskip("instructor")
    if mode == "TOOLS":  # tool_choice {"type": "function", "function": {"name": "User"}}
        reference_fails(request, server, "ignores an object tool_choice (\"Wrong type supplied for parameter "
                        "'tool_choice'\"): SmolLM2 answers in text, no tool call")
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0),
                                    mode=getattr(instructor.Mode, mode))
    if mode == "JSON":  # response_format json_object: any object, in llama-server's Jinja grammar (a fence allowed)
        from instructor.core.exceptions import InstructorRetryException

        # SmolLM2 writes ```json and echoes the schema instructor's system prompt shows it, as it does on the
        # pinned llama-server (the same request, the same text): the JSON comes back without the fence
        with pytest.raises(InstructorRetryException) as e:
            client.chat.completions.create(model="m", response_model=User, max_retries=0,
                                           messages=[{"role": "user", "content": ASK}], **{**SETTINGS, "max_tokens": 128})
        content = e.value.last_completion.choices[0].message.content
        assert isinstance(json.loads(content), dict) and not content.startswith("`"), content
        same_as_plain(server, f"instructor-{mode}", content)
        return
    user = client.chat.completions.create(model="m", response_model=User, max_retries=0,
                                          messages=[{"role": "user", "content": ASK}], **SETTINGS)
    assert isinstance(user, User) and user.name
    same_as_plain(server, f"instructor-{mode}", user.model_dump())


# -- pydantic-ai --------------------------------------------------------------------------------------------
def _agent(server, **kw):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=server.url + "/v1", api_key="x"))
    return Agent(model, model_settings=dict(SETTINGS), **kw)


def test_pydantic_ai_output_type(server, request):
    reference_fails(request, server, "does not force tool_choice \"required\" on SmolLM2's template (no tool-call "
                    "syntax in it): the model answers in text, no tool call")
    agent = _agent(server, output_type=User, retries=0)  # a forced tool call: {"name", "arguments"} written out
    out = agent.run_sync(ASK, model_settings={**SETTINGS, "max_tokens": 128}).output
    assert isinstance(out, User)
    same_as_plain(server, "pydantic-ai-output", out.model_dump())


def test_pydantic_ai_native_output(server):
    pydantic_ai = pytest.importorskip("pydantic_ai")

    out = _agent(server, output_type=pydantic_ai.NativeOutput(User), retries=0).run_sync(ASK).output  # response_format
    assert isinstance(out, User)
    same_as_plain(server, "pydantic-ai-native", out.model_dump())


def test_pydantic_ai_tool(server):
    calls = []
    agent = _agent(server, retries=0)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    res = agent.run_sync("What is the weather in Paris? Use the tool.", model_settings={**SETTINGS,
                                                                                        "max_tokens": 32})
    assert isinstance(res.output, str)
    same_as_plain(server, "pydantic-ai-tool", (calls, res.output))


# -- litellm ----------------------------------------------------------------------------------------------
def test_litellm(server):
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(model="openai/m", api_base=server.url + "/v1", api_key="x",
                           messages=[{"role": "user", "content": "Say hello."}], **SETTINGS)
    text = r.choices[0].message.content
    assert isinstance(text, str) and text
    r2 = litellm.completion(model="openai/m", api_base=server.url + "/v1", api_key="x",
                            messages=[{"role": "user", "content": ASK}], response_format=User, **SETTINGS)
    User.model_validate_json(r2.choices[0].message.content)
    same_as_plain(server, "litellm", (text, r2.choices[0].message.content))


# -- the llm CLI -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_llm_cli(server, tmp_path, api, request):
    pytest.importorskip("llm")
    if api == "responses":  # llm sends the schema as text.format, which the pinned llama-server ignores
        reference_fails(request, server, "drops text.format on /v1/responses: --schema gives free text")
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: local\n  model_name: m\n  api_base: {server.url}/v1\n  supports_schema: true\n"
        + ("  responses: true\n" if api == "responses" else ""))
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "x"}

    def llm(*args):
        r = subprocess.run([sys.executable, "-m", "llm", "-m", "local", "--no-log", "-o", "temperature", "0",
                            "-o", "max_tokens", "48", *args], capture_output=True, text=True, env=env, timeout=300,
                           input="")  # llm appends whatever stdin holds to the prompt: an empty pipe, not
        # /dev/null (where that is a plain file something wrote into, the prompt gets its bytes)
        assert r.returncode == 0, r.stderr
        return r.stdout

    text = llm("Say hello.")
    assert text.strip()
    obj = json.loads(llm("--schema", "name, age int", ASK))
    assert set(obj) == {"name", "age"} and isinstance(obj["age"], int)
    same_as_plain(server, f"llm-{api}", (text, obj))


# -- llamaspec.Llama: outlines and LangChain's LlamaCpp ------------------------------------------------------
@pytest.fixture(scope="module")
def model_path():
    from helpers import real_model

    return str(real_model(MODEL))


def _llms(model_path):
    """(name, factory) of the Python classes compared: llama_cpp.Llama, llamaspec.Llama, with a draft."""
    from llamaspec._llama.lcp import load_llama
    from llamaspec.compat import Llama

    kw = dict(n_ctx=1024, verbose=False, n_threads=1)
    return [("llama_cpp", lambda: load_llama(model_path, **kw)), ("llamaspec", lambda: Llama(model_path, **kw)),
            ("llamaspec+draft", lambda: Llama(model_path, draft_model=model_path, **kw))]


def test_outlines(model_path):
    outlines = pytest.importorskip("outlines")
    pytest.importorskip("numba")  # outlines' numpy kernels (llama.cpp's logits are numpy arrays)
    from outlines.types import Regex

    results = {}
    for name, make in _llms(model_path):
        llm = make()
        try:
            m = outlines.from_llamacpp(llm)
            results[name] = (m("Describe a person as JSON.", User, max_tokens=40, temperature=0),
                             m("Is the sky blue? Answer yes or no.", Literal["yes", "no"], max_tokens=5, temperature=0),
                             m("Give a phone number.", Regex(r"[0-9]{3}-[0-9]{4}"), max_tokens=10, temperature=0))
        finally:
            llm.close()
    User.model_validate_json(results["llamaspec"][0])
    assert results["llamaspec"][1] in ("yes", "no")
    assert results["llamaspec"] == results["llama_cpp"] == results["llamaspec+draft"]


def test_langchain_llamacpp(model_path, monkeypatch):
    community = pytest.importorskip("langchain_community.llms")
    chat_models = pytest.importorskip("langchain_community.chat_models")
    import llama_cpp

    import llamaspec

    class WithDraft(llamaspec.Llama):
        """The drop-in with a draft model (SmolLM2 drafting for itself) under the kwargs LangChain passes."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, draft_model=model_path, **kwargs)

    results, orig = {}, llama_cpp.Llama
    for name in ("llama_cpp", "llamaspec", "llamaspec+draft"):
        if name != "llama_cpp":  # LangChain builds llama_cpp.Llama itself: the drop-in takes its place
            monkeypatch.setattr(llama_cpp, "Llama", WithDraft if name.endswith("draft") else llamaspec.Llama)
        llm = community.LlamaCpp(model_path=model_path, temperature=0, max_tokens=16, n_ctx=1024, n_threads=1,
                                 verbose=False)
        text = llm.invoke("The capital of France is")
        streamed = "".join(llm.stream("The capital of France is"))
        chat = chat_models.ChatLlamaCpp(model_path=model_path, temperature=0, max_tokens=48, n_ctx=1024,
                                        n_threads=1, verbose=False)
        reply = chat.invoke("Say hello.").content
        user = chat.with_structured_output(User).invoke(ASK)
        results[name] = (text, streamed, reply, user)
        assert isinstance(llm.client, orig if name == "llama_cpp" else llamaspec.Llama)
        assert (llm.client.draft_model is not None) == name.endswith("draft")
    assert results["llamaspec"][0] == results["llamaspec"][1]
    assert results["llamaspec"] == results["llama_cpp"] == results["llamaspec+draft"]

