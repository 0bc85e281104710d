"""The generation routes' one path (llamaspec/server/pipeline.py; review e661e80 1(c)): a chat request goes from
its route to ``Engine.submit`` through few modules, its tools are parsed once, no server module reads another's
private helpers, and the prompts meet the slot's context once, as tokens."""
from __future__ import annotations

import ast
import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("starlette")

from llamaspec.server.app import ServerConfig, ServerState, create_app  # noqa: E402
from test_server import _ScriptedEngine  # noqa: E402

SERVER = Path(sys.modules["llamaspec.server"].__file__).parent


class _Submitted(Exception):
    """Raised by the engine's submit: what the trace measures is over."""


class _Engine(_ScriptedEngine):
    """test_server's scripted engine (its module is not ours: it is not counted), whose submit ends the trace."""

    def __init__(self):
        super().__init__([])
        self.prompts = []

    def submit(self, prompt, options=None, **kw):
        self.prompts.append(list(prompt))
        raise _Submitted


def _post(path: str, body: dict, profile=None) -> tuple[list[dict], _Engine]:
    """POST ``body`` to a fresh app in this process (``profile``: set for this thread and the workers')."""
    eng = _Engine()
    app = create_app(ServerState(ServerConfig(chat_template="chatml"), engine=eng))
    raw = json.dumps(body).encode()
    sent: list[dict] = []

    async def run():
        msgs = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            if msgs:
                return msgs.pop()
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("test", 80),
                 "client": ("test", 1), "http_version": "1.1", "app": app}
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            await app(scope, receive, send)
        except _Submitted:
            pass
        finally:
            sys.setprofile(None)
            threading.setprofile(None)

    asyncio.run(run())
    return sent, eng


def _module(frame) -> str:
    return frame.f_globals.get("__name__") or ""


def _path_modules(path: str, body: dict) -> tuple[str, set[str]]:
    """The route's module and the modules of ours it hands the request to on the way to ``Engine.submit``:
    every call between the handler's start and the engine's submit is the nearest ``llamaspec`` frame's above it
    (the callee of a call made from inside parsing is parsing's business, not the route's)."""
    calls: list[tuple[str, str | None]] = []
    state = {"handler": None, "over": False}

    def profile(frame, event, arg):
        if event != "call" or state["over"]:
            return
        if frame.f_code is _Engine.submit.__code__:
            state["over"] = True
            return
        mod = _module(frame)
        if state["handler"] is None:  # the route's handler: the function Starlette's routing calls
            if not mod.startswith("llamaspec") or frame.f_back is None or _module(frame.f_back) != "starlette.routing":
                return
            state["handler"] = mod
        caller = frame.f_back
        while caller is not None and not _module(caller).startswith("llamaspec"):
            caller = caller.f_back
        calls.append((mod, _module(caller) if caller is not None else None))

    _, eng = _post(path, body, profile)
    assert state["over"] and eng.prompts, "the request never reached Engine.submit"
    handler = state["handler"]
    return handler, {m for m, caller in calls if caller == handler and m != handler and m.startswith("llamaspec")}


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_a_chat_request_reaches_the_engine_through_few_modules():
    """From its route to ``Engine.submit`` a chat request is handed to at most 5 other modules of ours (the body,
    its fields, its template, its tokens, the server's admission); before the one generation route it was
    handed to 10 (limits, parsing, tools, chat_format, chat_prompt, prompt_bound, cancel, tenant, options,
    state). Work that hops to a worker thread adds the worker pool's module, nothing else."""
    handler, inline = _path_modules("/v1/chat/completions", CHAT)
    assert len(inline) <= 5, f"{handler} hands a chat request to {len(inline)} modules: {sorted(inline)}"
    assert handler == "llamaspec.server.pipeline"
    _, worker = _path_modules("/v1/chat/completions", {**CHAT, "tools": TOOLS})  # tools: off the event loop
    assert worker - inline <= {"llamaspec.server.jobs"}, sorted(worker - inline)


def test_tools_are_parsed_once_per_chat_request():
    from llamaspec.server import tools

    code, n = tools.parse_tools.__code__, []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is code:
            n.append(1)

    for path, body in (("/v1/chat/completions", {**CHAT, "tools": TOOLS}), ("/v1/responses", {
            "input": "hi", "tools": [{"type": "function", "name": "f"}]})):
        n.clear()
        _, eng = _post(path, body, profile)
        assert eng.prompts and len(n) == 1, (path, len(n))


def test_no_server_module_imports_another_ones_private_names():
    bad = []
    for path in sorted(SERVER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_a_mixed_prompt_meets_the_context_as_tokens():
    """The prompts meet the slot's context once, as the tokens the engine would get: a prompt of token ids and
    text counts both (llama-server's ``n_prompt_tokens``), not its ids alone."""
    sent, eng = _post("/completion", {"prompt": [5] * 100 + ["text"]})
    assert sent[0]["status"] == 400 and not eng.prompts
    err = json.loads(sent[1]["body"])["error"]
    assert err["type"] == "exceed_context_size_error" and (err["n_prompt_tokens"], err["n_ctx"]) == (102, 100)
