"""One chat rendering on every face (``serve``, ``generate --chat``, ``llamaspec.Llama.create_chat_completion``)
with llama.cpp's BOS rule: a template that emits ``{{ bos_token }}`` on a vocabulary that adds BOS gives one BOS,
as llama-server (common/chat.cpp cuts the BOS text before tokenising with special tokens added); the template is
compiled once; compat applies the server's JSON-schema limits.

The expected prompts are the turns' text written out by hand (no BOS text), tokenised as llama-server tokenises
a prompt (special tokens added and parsed). The tiny models' "test" tokenizer adds no BOS token itself and cuts
text into 5-byte chunks, so there a kept BOS text shows as other ids (``"1<|st"`` for ``"<|sta"``) and a
different count; on Gemma 3 (real, SentencePiece) it is a second BOS id."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx")

from click.testing import CliRunner  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from llamaspec._llama import chat_template as jinja_mod  # noqa: E402
from llamaspec.chat import ChatTemplate  # noqa: E402
from llamaspec.cli.main import main  # noqa: E402
from llamaspec.compat import Llama  # noqa: E402
from llamaspec.engine import Engine  # noqa: E402
from llamaspec.server.app import ServerConfig, ServerState, create_app  # noqa: E402
from llamaspec.testing.tiny_models import write_model  # noqa: E402

from helpers import real_model  # noqa: E402
from support.server import LLAMA_SERVER, llama_server  # noqa: E402

BOS = 1
MSGS = [{"role": "user", "content": "Hello"}]
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
LLAMA3_TEXT = "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TEXT = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"

#: (template, text after the BOS, vocabulary adds BOS): with and without ``bos_token``, with and without add_bos
CASES = {
    "bos-template/add-bos": (LLAMA3, LLAMA3_TEXT, True),
    "plain-template/add-bos": (CHATML, CHATML_TEXT, True),
    "bos-template/no-add-bos": (LLAMA3, LLAMA3_TEXT, False),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmpl, text, add_bos = CASES[request.param]
    path = write_model("llama", tmp_path_factory.mktemp("chat") / "m.gguf", bos_token_id=BOS,
                       add_bos_token=add_bos, chat_template=tmpl)
    with Engine(path, n_ctx=256, n_batch=64) as eng:
        expected = eng.vocab.tokenize(text, add_special=True, parse_special=True)
        # /apply-template: the text llama-server tokenises (its BOS text cut only where the vocabulary adds BOS)
        bos_text = eng.vocab.token_to_piece(BOS, special=True).decode()
        rendered = text if add_bos or "bos_token" not in tmpl else bos_text + text
        if not add_bos and "bos_token" in tmpl:
            expected = eng.vocab.tokenize(rendered, add_special=True, parse_special=True)
        yield path, eng, expected, rendered


@pytest.fixture(scope="module")
def client(case):
    with TestClient(create_app(ServerState(ServerConfig(model_id="tiny"), engine=case[1]))) as c:
        yield c


def _spy_submit(monkeypatch) -> list:
    seen = []
    orig = Engine.submit

    def submit(self, prompt, *a, **kw):
        seen.append(list(prompt))
        return orig(self, prompt, *a, **kw)

    monkeypatch.setattr(Engine, "submit", submit)
    return seen


def test_serve_prompt_tokens_as_llama_server(case, client, monkeypatch):
    path, eng, expected, rendered = case
    seen = _spy_submit(monkeypatch)
    r = client.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    n = client.post("/v1/chat/completions/input_tokens", json={"messages": MSGS}).json()["input_tokens"]
    prompt = client.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
    assert seen == [expected] and n == len(expected)
    assert prompt == rendered


def test_generate_chat_prompt_tokens_as_llama_server(case, monkeypatch):
    path, eng, expected, rendered = case
    seen = _spy_submit(monkeypatch)
    r = CliRunner().invoke(main, ["generate", "Hello", "-m", str(path), "--chat", "-n", "1", "-q", "--spec-type",
                                  "none", "-c", "256"])
    assert r.exit_code == 0, r.output
    assert seen == [expected]


def test_compat_chat_prompt_tokens_as_llama_server(case):
    path, eng, expected, rendered = case
    with Llama(str(path), n_ctx=256, verbose=False) as llm:
        assert llm.chat_format == "chat_template.default"
        seen = []
        orig = llm.create_completion

        def create_completion(prompt, **kw):
            seen.append(list(prompt))
            return orig(prompt, **kw)

        llm.create_completion = create_completion
        out = llm.create_chat_completion(MSGS, max_tokens=1)
    assert seen == [expected]
    assert out["usage"]["prompt_tokens"] == len(expected)


def test_template_is_compiled_once(case, client, monkeypatch):
    """Every request renders with the same compiled template (compiling one costs ~10 ms on the event loop)."""
    path, eng, expected, rendered = case
    built = []
    real = jinja_mod.Jinja2ChatFormatter

    def counting(*a, **kw):
        built.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(jinja_mod, "Jinja2ChatFormatter", counting)
    jinja_mod.compiled.cache_clear()
    for _ in range(3):
        assert client.post("/apply-template", json={"messages": MSGS}).status_code == 200
        r = client.post("/apply-template", json={"messages": MSGS, "add_generation_prompt": False})
        assert r.status_code == 200
    with Llama(str(path), n_ctx=256, verbose=False) as llm:
        for _ in range(2):
            llm.create_chat_completion(MSGS, max_tokens=1)
    assert len(built) == 1


def test_compat_applies_the_servers_schema_limits(tiny_model):
    with Llama(str(tiny_model("llama")), n_ctx=256, verbose=False, chat_format="chatml") as llm:
        too_many = {"type": "array", "items": {"type": "integer"}, "minItems": 5000}
        with pytest.raises(ValueError, match="over the limit"):
            llm.create_chat_completion(MSGS, max_tokens=1, response_format={
                "type": "json_schema", "json_schema": {"schema": too_many}})
        with pytest.raises(ValueError, match="over the limit"):
            llm.create_chat_completion(MSGS, max_tokens=1, response_format={"type": "json_object",
                                                                             "schema": too_many})
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"xs": too_many}}}}
        with pytest.raises(ValueError, match="over the limit"):
            llm.create_chat_completion(MSGS, max_tokens=1, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "f"}})


# Gemma 3's published chat template (it starts with {{ bos_token }}); the GGUFs here carry none
GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}"""


@pytest.mark.real
def test_real_gemma3_one_bos(monkeypatch):
    """Gemma 3 (adds BOS, its template emits it): 16 prompt tokens for these messages, as llama-server counts
    (it was 17, ``[2, 2, ...]``, under ``serve --jinja``)."""
    msgs = [{"role": "system", "content": "You are a helpful assistant"}, {"role": "user", "content": "Hello"}]
    text = "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\n"
    seen = _spy_submit(monkeypatch)
    with Engine(real_model("gemma3-270m-q4km"), n_ctx=512) as eng:
        bos = eng.vocab.bos
        assert eng.vocab.add_bos
        expected = [bos] + eng.vocab.tokenize(text, add_special=False, parse_special=True)
        assert len(expected) == 16
        cli = eng.tokenize(ChatTemplate.of_model(eng.model, GEMMA3).render(msgs), add_special=True,
                           parse_special=True)
        state = ServerState(ServerConfig(model_id="gemma", chat_template=GEMMA3), engine=eng)
        with TestClient(create_app(state)) as c:
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 1})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 16
    assert seen == [expected] and cli == expected
    assert seen[0][:2] != [bos, bos]


CHATML_TRIM = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.skipif(not LLAMA_SERVER.exists(),
                    reason="native llama-server not built (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("add_bos", [True, False])
@pytest.mark.parametrize("tmpl", [LLAMA3, CHATML, CHATML_TRIM, GEMMA3], ids=["llama3", "chatml", "chatml-trim", "gemma3"])
def test_prompt_tokens_equal_native_llama_server(tmp_path, tmpl, add_bos, monkeypatch):
    """The reference llama-server (``--jinja``, the template by ``--chat-template-file``) on the same model and
    messages: the same prompt ids on serve, generate --chat's rendering and llamaspec.Llama."""
    import httpx

    path = write_model("llama", tmp_path / "m.gguf", bos_token_id=BOS, add_bos_token=add_bos, chat_template=tmpl)
    (tmp_path / "t.jinja").write_text(tmpl)
    with llama_server(["-m", path, "-c", "256", "-np", "1", "-t", "1", "--jinja", "--chat-template-file",
                       tmp_path / "t.jinja"]) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            n_native = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).json()["usage"][
                "prompt_tokens"]
            text = c.post("/apply-template", json={"messages": MSGS}).json()["prompt"]
            native = c.post("/tokenize", json={"content": text, "add_special": True, "parse_special": True}).json()[
                "tokens"]
    assert n_native == len(native)
    seen = _spy_submit(monkeypatch)
    with Engine(path, n_ctx=256) as eng:
        cli = eng.tokenize(ChatTemplate.of_model(eng.model).render(MSGS), add_special=True, parse_special=True)
        c = TestClient(create_app(ServerState(ServerConfig(model_id="tiny"), engine=eng)))
        assert c.post("/apply-template", json={"messages": MSGS}).json()["prompt"] == text
        assert c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 1}).status_code == 200
    with Llama(str(path), n_ctx=256, verbose=False) as llm:
        compat = []
        orig = llm.create_completion
        llm.create_completion = lambda prompt, **kw: compat.append(list(prompt)) or orig(prompt, **kw)
        llm.create_chat_completion(MSGS, max_tokens=1)
    assert seen[0] == cli == compat[0] == native
