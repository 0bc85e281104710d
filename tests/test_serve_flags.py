"""``llamaspec serve`` takes llama-server's command line: every flag of the pinned llama-server, its spellings,
its ``LLAMA_ARG_*`` variables; llama-server's own test suite's command lines parse; bad values exit 2 with one
line. In-process: CORS, ``--api-prefix``, ``/v1/models`` aliases and tags, ``POST /props``."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from llamaspec.cli.serve import serve
from llamaspec.cli.server_compat import cli_spellings, translate
from llamaspec.cli.server_flags import FLAGS, by_name

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "native" / "bin" / "llama-server"

# command lines of llama.cpp's server tests (tools/server/tests/utils.py), as the conformance harness logged them
SUITE_ARGV = [
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --model M --batch-size 32 --threads 1 --no-slots "
    "--alias tinyllama-2 --ctx-size 512 --parallel 2 --n-predict 64 --no-jinja",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1,::1 --offline --model M --batch-size 32 --threads 1 "
    "--no-slots --alias tinyllama-2 --ctx-size 512 --parallel 2 --n-predict 64 --api-key test-multiple-addresses "
    "--no-jinja",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --model M --model-draft D --batch-size 32 "
    "--threads 1 --slots --ctx-size 256 --parallel 1 --n-predict 64 --spec-type draft-simple --spec-draft-n-max 8 "
    "--spec-draft-n-min 4 --spec-synth-rates 0,0,0 --jinja",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --model M --batch-size 32 --threads 1 --kv-unified "
    "--slots --ctx-size 256 --parallel 4 --n-predict 64 -fa on --verbose --context-shift --jinja "
    "--chat-template-file tmpl.jinja",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --threads 1 --cors-origins localhost "
    "--ctx-size 1024 --batch-size 16 --parallel 1 --n-predict 16 --no-jinja --tools all",
    "--port 8080 --temp 0.8 --seed 42 --host 127.0.0.1 --offline --model M --threads 1 --metrics --slots "
    "--alias a,b,c --tags chat,fim --api-key k --ui-mcp-proxy --backend_sampling -ctk q8_0 -ctv q8_0 --jinja",
]


def _parse(argv: list[str], env: dict | None = None) -> tuple[dict, list[str]]:
    new, notes = translate(serve, argv, env or {})
    with serve.make_context("serve", new) as ctx:
        return dict(ctx.params), notes


def _run(argv: list[str], env: dict | None = None):
    return CliRunner().invoke(serve, argv, env=env or {}, catch_exceptions=False)


def _help_flags(text: str) -> tuple[set[str], set[str]]:
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("-") and not line.startswith("-----"):
            head = re.split(r"\s{2,}", re.sub(r",\s+", ", ", line))[0]
            names.update(re.findall(r"(?:^|, )(-[-\w.]+)", head))
    return names, set(re.findall(r"\(env: ([A-Z0-9_]+)\)", text))


@pytest.mark.skipif(not NATIVE.exists(), reason="the reference llama-server is not built (scripts/build_llama_cpp.sh)")
def test_table_is_the_pinned_llama_servers_help():
    text = subprocess.run([str(NATIVE), "--help"], capture_output=True, text=True, timeout=60).stdout
    names, envs = _help_flags(text)
    ours = {n for f in FLAGS for n in f.names + f.neg}
    assert names == ours
    assert envs == {f.env for f in FLAGS if f.env}


def test_table_shape():
    assert len(FLAGS) == 255
    assert len({n for f in FLAGS for n in f.names + f.neg}) == sum(len(f.names) + len(f.neg) for f in FLAGS)
    for f in FLAGS:
        assert f.kind in ("V", "B", "I", "S", "S2") and (f.kind == "B") == bool(f.neg), f
        if f.use == "cli":  # every flag we implement is one of serve's options, both of its forms
            pos, neg = cli_spellings(serve, f)
            assert pos is not None and (neg is not None or not f.neg), f
    assert by_name("--n_predict") is by_name("-n") and by_name("--no-kv-unified") is by_name("-kvu")


@pytest.mark.parametrize("line", SUITE_ARGV)
def test_suite_command_lines_parse(line):
    params, notes = _parse(line.split())
    assert params["port"] == 8080 and params["seed"] == 42


def test_every_flag_is_accepted():
    """A command line with every llama-server flag (but the ones that exit or name a model source) parses;
    each ignored one gives exactly one note."""
    skip = {"--help", "--version", "--cache-list", "--completion-bash", "--list-devices", "--model-url", "--hf-repo",
            "--hf-file", "--spec-draft-hf", "--model", "--spec-draft-model"}
    values = {"I": ["1"], "S": ["1"], "S2": ["1", "2"]}
    special = {"--flash-attn": ["on"], "--cache-type-k": ["f16"], "--cache-type-v": ["f16"], "--spec-type": ["none"],
               "--split-mode": ["layer"], "--tensor-split": ["1"], "--spec-synth-rates": ["0.5"],
               "--ctx-size": ["256"], "--verbosity": ["3"], "--log-file": [], "--spec-synth-len": [],
               "--alias": ["x"], "--api-key-file": [], "--chat-template-file": [], "--ssl-key-file": [],
               "--ssl-cert-file": [], "--chat-template": ["chatml"], "--lookup-cache-static": [],
               "--lookup-cache-dynamic": [], "--rpc": [], "--spec-draft-ngl": [], "--spec-draft-n-min": ["0"],
               "--parallel": ["2"], "--host": ["127.0.0.1"], "--port": ["8080"], "--seed": ["1"],
               "--samplers": ["top_k;temperature"], "--sampler-seq": ["kt"], "--adaptive-decay": ["0.5"]}
    argv: list[str] = []
    ignored = 0
    for f in FLAGS:
        if f.key in skip or f.use.startswith("gone:") or (f.key in special and not special[f.key]):
            continue
        if f.use not in ("cli", "same", "exit"):
            ignored += 1
        argv += [f.names[0], *special.get(f.key, values.get(f.kind, []))]
    params, notes = _parse(argv)
    assert sum(n.startswith("ignoring ") for n in notes) == ignored
    assert params["flash_attn"] == "on" and params["n_parallel"] == 2


def test_spellings_negations_and_underscores():
    params, notes = _parse(["--temperature", "0.3", "--predict", "7", "-no-kvu", "--no-cont-batching",
                            "--n_predict", "9", "--backend_sampling", "--no-ui", "--threads-draft", "2", "-lv", "4"])
    assert params["temp"] == 0.3 and params["n_predict"] == 9 and params["kv_unified"] is False
    assert params["threads_draft"] == "2" and params["verbosity"] == 4
    assert notes == []  # continuous batching and sampling on the CPU are what llamaspec does; no UI to turn off
    params, notes = _parse(["--webui", "--mmproj", "x.gguf", "--keep", "-1"])
    assert len(notes) == 3 and all(n.startswith("ignoring ") for n in notes)


def test_environment_variables():
    params, notes = _parse([], {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_ARG_NO_ENDPOINT_SLOTS": "1",
                                "LLAMA_ARG_JINJA": "false", "LLAMA_API_KEY": "k1", "LLAMA_ARG_ENDPOINT_METRICS": "1",
                                "LLAMA_ARG_FLASH_ATTN": "off", "LLAMA_ARG_N_PARALLEL": "3",
                                "LLAMA_ARG_SPEC_DRAFT_N_MAX": "5", "LLAMA_ARG_CONT_BATCHING": "1"})
    assert params["ctx_size"] == 1024 and params["slots"] is False and params["jinja"] is False
    assert params["api_keys"] == ("k1",) and params["metrics"] is True and params["flash_attn"] == "off"
    assert params["n_parallel"] == 3 and params["spec_draft_n_max"] == 5 and notes == []
    # the command line wins over the variable (llama-server says so)
    params, notes = _parse(["-c", "512", "--api-key", "k2"], {"LLAMA_ARG_CTX_SIZE": "1024", "LLAMA_API_KEY": "k1"})
    assert params["ctx_size"] == 512 and params["api_keys"] == ("k2",) and len(notes) == 2
    # a switch that is off in the environment does nothing; an ignored variable says which
    params, notes = _parse([], {"LLAMA_ARG_ENDPOINT_METRICS": "0", "LLAMA_ARG_MMPROJ": "x.gguf"})
    assert params["metrics"] is False and notes == ["ignoring --mmproj (from LLAMA_ARG_MMPROJ): llamaspec serve is "
                                                    "text-only (no multimodal projector)"]


@pytest.mark.parametrize("argv,env,needle", [
    (["--draft-max", "4"], {}, "the argument has been removed. use --spec-draft-n-max"),
    (["--keep", "abc"], {}, "--keep: expected an integer"),
    (["--cache-reuse"], {}, "--cache-reuse needs a value"),
    ([], {"LLAMA_ARG_JINJA": "maybe"}, "LLAMA_ARG_JINJA: expected 1/0"),
    ([], {"LLAMA_ARG_CTX_SIZE": "big"}, "LLAMA_ARG_CTX_SIZE: expected an integer"),
    (["--ctx-size", "x"], {}, "--ctx-size"),
    (["-sps", "1.5"], {}, "--slot-prompt-similarity"),
])
def test_bad_command_lines_exit_2_before_loading(argv, env, needle):
    r = _run(argv, env)
    assert r.exit_code == 2 and needle in r.output, r.output


@pytest.mark.parametrize("argv,needle", [
    (["-fa", "maybe"], "expected on, off or auto"),
    (["-np", "0"], "-np / --parallel"),
    (["-ctk", "q9_9"], "unknown KV cache type"),
    (["-c", "8"], "-c / --ctx-size"),
    (["-hff", "x.gguf"], "-hff names a file of -hf"),
    (["-hf", "nouser", "--offline"], "expected USER/MODEL"),
    (["-m", "a.gguf", "-hf", "u/m"], "not several"),
])
def test_bad_values_are_one_line(argv, needle):
    r = _run(argv)
    assert r.exit_code == 2 and needle in r.output and r.output.count("error:") == 1, r.output
    assert "Traceback" not in r.output


def test_version_exits_0():
    r = _run(["--version"])
    assert r.exit_code == 0 and "llamaspec" in r.output


def test_settings():
    from llamaspec.cli import serve_setup as s

    assert s.flash_attn_arg("enabled") is True and s.flash_attn_arg("-1") is None and s.flash_attn_arg("0") is False
    notes: list[str] = []
    assert s.kv_f32_arg("f32", "F32", notes) is True and notes == []
    assert s.kv_f32_arg("q8_0", "f16", notes) is False and len(notes) == 1
    assert s.n_parallel_arg(-1) == s.AUTO_N_PARALLEL and s.ctx_size_arg(0) == s.FROM_MODEL_N_CTX
    cfg = s.server_config(model="m", path="/x/m.gguf", alias="tinyllama-2,fim,code", tags="chat,fim", keys=[],
                          template=None, defaults={"presence_penalty": 0.5}, cors=("*", "GET", "*", True))
    assert cfg.model_id == "code" and cfg.aliases == ["code", "fim", "tinyllama-2"] and cfg.tags == ["chat", "fim"]
    assert cfg.defaults.presence_penalty == 0.5


# ---------------------------------------------------------------------------------------------------
# in-process: CORS, --api-prefix, /v1/models, POST /props
# ---------------------------------------------------------------------------------------------------
def _client(**config):
    pytest.importorskip("starlette")
    pytest.importorskip("httpx")
    from starlette.testclient import TestClient

    from llamaspec.server.app import ServerConfig, ServerState, create_app

    return TestClient(create_app(ServerState(ServerConfig(**config))))


def _preflight(c, origin: str, path: str = "/completions"):
    return c.options(path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                    "Access-Control-Request-Headers": "Authorization"})


def test_cors_as_llama_server():
    with _client(api_keys=["k"]) as c:  # default: * with credentials echoes the Origin, before key and loading
        r = _preflight(c, "web.mydomain.fr")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "web.mydomain.fr"
        assert r.headers["access-control-allow-credentials"] == "true"
        assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "*"
        r = c.get("/health", headers={"Origin": "http://a.b"})
        assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "http://a.b"
    with _client(cors_origins="localhost") as c:
        for origin in ("http://localhost", "http://127.0.0.1:3000", "http://[::1]:3000"):
            assert _preflight(c, origin).headers["access-control-allow-origin"] == origin
        for origin in ("http://evil.com", "http://localhost.evil.com", "http://notlocalhost"):
            r = _preflight(c, origin)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    with _client(cors_origins="https://a.example", cors_credentials=False) as c:
        r = _preflight(c, "https://b.example")
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        assert r.headers["access-control-allow-credentials"] == "false"


def test_api_prefix():
    with _client(api_prefix="/llama/") as c:
        assert c.get("/llama/health").status_code == 503  # routed (loading)
        r = c.get("/health")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_serve_command_is_a_click_command():
    assert isinstance(serve, click.Command) and sys.modules["llamaspec.cli.server_compat"]


def test_chat_prompt_prefill_and_continuation():
    """llama-server's chat prompt rules: a last assistant message is continued (its end of turn dropped);
    two at the end, or add_generation_prompt with continue_final_message, are a 400."""
    from types import SimpleNamespace

    from llamaspec.chat import ChatTemplate
    from llamaspec.server.chat_prompt import chat_prompt
    from llamaspec.server.errors import ApiError
    from llamaspec.server.state import ServerConfig

    state = SimpleNamespace(config=ServerConfig(), chat_template="chatml", chat=ChatTemplate("chatml"))
    user = {"role": "user", "content": "Hi"}
    text = chat_prompt(state, {}, [user])
    assert text.endswith("<|im_start|>assistant\n")
    prefill = chat_prompt(state, {}, [user, {"role": "assistant", "content": "Hel"}])
    assert prefill == text + "Hel"
    assert chat_prompt(state, {"add_generation_prompt": False, "continue_final_message": True},
                       [user, {"role": "assistant", "content": "Hel"}]) == prefill
    assert not chat_prompt(state, {"add_generation_prompt": False}, [user]).endswith("assistant\n")
    for body, msgs in (({}, [user, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]),
                       ({"add_generation_prompt": True, "continue_final_message": True}, [user])):
        with pytest.raises(ApiError) as e:
            chat_prompt(state, body, msgs)
        assert e.value.code == 400


def test_timings_as_llama_server():
    from llamaspec.server import formats
    from llamaspec.slot import GenerationStats

    s = GenerationStats()
    s.n_prompt, s.n_predicted, s.t_prompt_s, s.t_decode_s = 4, 16, 0.01, 0.3
    t = formats.timings(s)
    assert "draft_n" not in t  # plain decoding: as llama-server without a draft
    assert t["predicted_per_second"] == pytest.approx(15 / 0.3)  # the first token costs no decode step
    assert formats.timings(s, speculative=True)["draft_n"] == 0  # speculating: always there, zeros included
    s.n_predicted = 1
    assert formats.timings(s)["predicted_per_second"] == 0.0 and formats.timings(s)["predicted_per_token_ms"] == 0.0
