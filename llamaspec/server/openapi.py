"""``GET /openapi.json``: an OpenAPI 3.1 description of every route of ``llamaspec serve`` (llama-server has
no such route), built here and nowhere else from the server's own tables and bounds: the sampler fields of
:data:`~llamaspec.server.parsing.SAMPLER_FIELDS`, ``n`` (:data:`~llamaspec.server.parsing.MAX_N_CMPL`), the
probabilities (:mod:`~llamaspec.server.probs`), the ``--max-*`` limits, and, once the model is loaded, its
context, vocabulary, slots and ``speculative.n_max``.

The request schemas are what the server's validation accepts, no narrower: a value a schema refuses is a 400
(``tests/test_openapi.py`` checks every field of :data:`GEN_FIELDS` against ``parse_gen_params``, and the
Schemathesis fuzzer, ``tests/test_schemathesis.py``, sends bodies that violate them to a live server). As in
the server, ``null`` means absent, unknown fields are allowed, and an alias is checked only when the server
reads it (``max_tokens`` under an ``if`` that ``n_predict`` is not given: :data:`ALIASES`). Some values the
schemas allow are still refused (a GBNF grammar that does not parse, a prompt longer than the context, a
``tool_choice`` naming no tool, ``top_logprobs`` without ``logprobs: true``). Public like ``/health``.

>>> spec = describe(ServerConfig())
>>> spec["openapi"], sorted(spec["paths"]["/slots/{id_slot}"]), "security" in spec
('3.1.0', ['post'], False)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from ..params import VERIFY_MODES
from .middleware import PUBLIC
from .parsing import I32_MAX, I32_MIN, MAX_N_CMPL, SAMPLER_FIELDS
from .probs import N_PROBS_MAX, TOP_LOGPROBS_MAX
from .state import ServerConfig

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["OPENAPI_PATH", "GEN_FIELDS", "ALIASES", "describe", "openapi"]

OPENAPI_PATH = "/openapi.json"
U32_MAX = 0xFFFFFFFF
#: the scalar generation fields ``parse_gen_params`` reads: name -> (JSON type, min, max); a bound that is a
#: string is the loaded model's (``n_ctx``, ``slot``: the last slot's id, ``n_max``: the server's draft length)
GEN_FIELDS: dict[str, tuple] = {
    "n_predict": ("integer", -1, I32_MAX), "max_tokens": ("integer", -1, I32_MAX),
    "max_completion_tokens": ("integer", -1, I32_MAX), "temperature": ("number", None, None),
    "top_k": ("integer", I32_MIN, I32_MAX), "top_p": ("number", 0, 1), "min_p": ("number", 0, 1),
    "repeat_penalty": ("number", 0, None), "repeat_last_n": ("integer", -1, "n_ctx"),
    "presence_penalty": ("number", None, None), "frequency_penalty": ("number", None, None),
    "seed": ("integer", -1, U32_MAX), "id_slot": ("integer", -1, "slot"), "n": ("integer", 1, MAX_N_CMPL),
    "n_cmpl": ("integer", 1, MAX_N_CMPL), "n_keep": ("integer", -1, I32_MAX), "n_discard": ("integer", 0, I32_MAX),
    "n_indent": ("integer", 0, I32_MAX), "t_max_predict_ms": ("integer", -1, I32_MAX),
    "n_probs": ("integer", 0, N_PROBS_MAX), "speculative.n_max": ("integer", 0, "n_max"),
    "speculative.n_min": ("integer", 0, I32_MAX), "speculative.p_min": ("number", 0, 1),
    "ignore_eos": ("boolean",), "cache_prompt": ("boolean",), "stream": ("boolean",),
    "timings_per_token": ("boolean",), "return_tokens": ("boolean",), "return_progress": ("boolean",),
    "post_sampling_probs": ("boolean",), "grammar": ("string",),
    **{name: ("integer" if kind is int else "number", lo, hi) for name, (_, kind, lo, hi) in SAMPLER_FIELDS.items()},
}

NULL = {"type": "null"}
ANY: dict = {}
OBJ = {"type": "object"}
STRING = {"type": "string"}
INT = {"type": "integer"}


def _opt(kind: str, lo: Any = None, hi: Any = None, **kw: Any) -> dict:
    """An optional field: ``kind`` or null, within ``lo..hi``."""
    s: dict = {"type": [kind, "null"], **kw}
    if lo is not None:
        s["minimum"] = lo
    if hi is not None:
        s["maximum"] = hi
    return s


def _obj(props: dict, required: tuple = (), nullable: bool = False, **kw: Any) -> dict:
    s: dict = {"type": ["object", "null"] if nullable else "object", "properties": props, **kw}
    if required:
        s["required"] = list(required)
    return s


def _arr(items: dict, nullable: bool = False, **kw: Any) -> dict:
    return {"type": ["array", "null"] if nullable else "array", "items": items, **kw}


def _bounds(eng: "Engine | None") -> dict:
    if eng is None:
        return {}
    n_vocab = eng.vocab.n_tokens
    return {"n_ctx": eng.n_ctx_seq, "slot": eng.n_parallel - 1, "n_vocab": n_vocab,
            "n_max": eng.chain.n_max if eng.chain is not None else 0, "n_probs": min(N_PROBS_MAX, n_vocab)}


def _field(spec: tuple, b: dict) -> dict:
    kind, lo, hi = (spec + (None, None))[:3]
    hi = b.get(hi, I32_MAX) if isinstance(hi, str) else hi
    return _opt(kind, lo, hi)


#: fields read only when the ones before them are not given (``Body.get``'s aliases; ``n_probs`` wins over
#: ``logprobs`` and ``top_logprobs``): each is checked under an ``if`` the ones before it are null
ALIASES = (("n_predict", "max_completion_tokens", "max_tokens"), ("n", "n_cmpl"),
           ("n_probs", "logprobs"), ("n_probs", "top_logprobs"))


def _aliases(props: dict, chains=ALIASES) -> list:
    """Move each alias's schema under an ``if`` (the names before it are null or absent); the ``allOf``
    (one ``if`` per distinct condition: Schemathesis cannot generate from many)."""
    conds: dict[tuple, dict] = {}
    for chain in chains:
        for i, name in enumerate(chain[1:], 1):
            conds.setdefault(chain[:i], {})[name] = props[name]
            props[name] = {"description": f"read when {', '.join(chain[:i])} {'is' if i == 1 else 'are'} not given"}
    return [{"if": {"properties": {k: NULL for k in before}}, "then": {"properties": then}}
            for before, then in conds.items()]


def _generation(cfg: ServerConfig, b: dict, chat: bool) -> dict:
    """The properties every generation route reads (``chat``: the chat routes' ``tools`` and ``verbose``)."""
    lim = cfg.limits
    props = {k: _field(v, b) for k, v in GEN_FIELDS.items()}
    if "n_probs" in b:
        props["n_probs"]["maximum"] = b["n_probs"]
    stop = {"type": "string", "maxLength": lim.max_stop_chars}
    token = {"type": "integer", "minimum": 0, "maximum": b["n_vocab"] - 1 if b else I32_MAX}
    bias = {"anyOf": [{"type": "number"}, {"const": False}]}
    spec_obj = _obj({"n_max": props["speculative.n_max"], "n_min": props["speculative.n_min"],
                     "p_min": props["speculative.p_min"], "verify": {"enum": [*VERIFY_MODES, None]}}, nullable=True)
    props.update({
        "model": {**ANY, "description": "echoed in the answer when a string"},
        "stop": {"anyOf": [stop, _arr(stop, maxItems=lim.max_stop), NULL]},
        "speculative": spec_obj, "speculative.verify": {"enum": [*VERIFY_MODES, None]},
        "stream_options": _obj({"include_usage": _opt("boolean")}, nullable=True),
        "logprobs": {"anyOf": [_opt("boolean"), _field(GEN_FIELDS["n_probs"], b) | (
            {"maximum": b["n_probs"]} if b else {})]},
        "top_logprobs": _opt("integer", 0, TOP_LOGPROBS_MAX),
        "logit_bias": {"anyOf": [{"type": "object", "additionalProperties": bias},
                                 _arr({"type": "array", "minItems": 2, "maxItems": 2,
                                       "prefixItems": [{"anyOf": [token, STRING]}, bias]}), NULL]},
        "json_schema": {**ANY, "description": "a JSON schema the output follows"},
        "response_format": _obj({"type": {"enum": ["text", "json_object", "json_schema", None]}}, nullable=True),
        "dry_sequence_breakers": _arr(STRING, nullable=True, minItems=1),
        "samplers": {"anyOf": [_opt("string"), _arr(STRING)]},
    })
    if chat:
        props.update(_tool_fields(), verbose=_opt("boolean"))
    else:
        props["tools"] = _arr(ANY, nullable=True, maxItems=0, description="tools: only on the chat routes")
    return props


def _tool_fields() -> dict:
    fn = _obj({"name": {"type": "string", "minLength": 1}, "parameters": _opt("object"),
               "description": _opt("string")}, ("name",))
    named = _obj({"function": _obj({"name": STRING}, ("name",))}, ("function",))
    return {"tools": _arr(_obj({"type": {"const": "function"}, "function": fn}, ("function",)), nullable=True),
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]}, named]},
            "parallel_tool_calls": {**ANY, "description": "true or false (read when there are tools)"}}


def _messages() -> dict:
    part = {"anyOf": [STRING, _obj({"type": {"const": "text"}, "text": STRING}, ("type", "text"))]}
    call = _obj({"function": _obj({"name": {"type": "string", "minLength": 1},
                                   "arguments": {"anyOf": [STRING, OBJ, NULL]}}, ("name",))}, ("function",))
    msg = _obj({"role": {"type": "string", "minLength": 1}, "content": {"anyOf": [STRING, _arr(part), NULL]},
                "tool_calls": _arr(call, nullable=True), "tool_call_id": _opt("string"), "name": _opt("string")},
               ("role",))
    return _arr(msg, minItems=1)


def _chat_fields() -> dict:
    return {"messages": _messages(), "add_generation_prompt": _opt("boolean"),
            "continue_final_message": {"type": ["boolean", "string", "null"]}, **_tool_fields()}


def _prompt() -> dict:
    piece = {"anyOf": [STRING, INT]}
    one = {"anyOf": [STRING, _arr(piece), _obj({"prompt_string": {"anyOf": [STRING, _arr(piece)]},
                                                "multimodal_data": NULL}, ("prompt_string",))]}
    return {"anyOf": [one, _arr(one, minItems=1)],
            "description": "a string, token ids, a mixed list, {\"prompt_string\": ...}, or a list of those"}


def _responses_fields() -> dict:
    item = {"type": "object", "description": "a message, function_call or function_call_output item"}
    function = {"name": {"type": "string", "minLength": 1}, "parameters": _opt("object")}
    tool = {"type": "object", "description": "a function tool (other types are skipped)",
            "if": {"properties": {"type": {"const": "function"}}, "required": ["type"]},
            "then": {"properties": function, "required": ["name"]}}
    return {"input": {"anyOf": [STRING, _arr(item)]}, "instructions": _opt("string"),
            "max_output_tokens": _opt("integer", -1, I32_MAX), "text": _obj({"format": _opt("object")}, nullable=True),
            "previous_response_id": {"enum": [None, "", False, 0, [], {}], "description": "not supported"},
            "tools": _arr(tool, nullable=True), "n": _opt("integer", 1, 1), "messages": ANY, "verbose": ANY,
            "tool_choice": {"anyOf": [{"enum": ["none", "auto", "required", None]},
                                      _obj({"type": {"const": "function"}, "name": STRING}, ("type",))]}}


# ---------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------
ERROR = _obj({"error": _obj({"code": INT, "message": STRING, "type": STRING}, ("code", "message", "type"))},
             ("error",))
MESSAGES = {400: "a bad request (the message names the field)", 401: "no valid API key",
            403: "disabled (--ui-mcp-proxy)", 413: "the body is over --max-body-size",
            500: "the slot file could not be written or read", 501: "not enabled on this server",
            503: "loading, full (Retry-After) or shutting down"}
CHOICE = {"type": "object", "required": ["index"], "properties": {"index": INT, "finish_reason": _opt("string")}}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _gen_ok(schema: dict, chunk: dict) -> dict:
    """A generation route's 200: JSON, or with ``"stream": true`` SSE events whose data are ``chunk``s (or an
    error, or OpenAI's ``[DONE]``)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk, ERROR]}}
    event = _obj({"data": {"anyOf": [{"const": "[DONE]"}, data]}, "event": STRING}, ("data",))
    return {**_json(schema), "text/event-stream": {"schema": event}}


def _ok_schemas() -> dict:
    usage = _obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT})
    oai = lambda obj, choice: _obj({"id": STRING, "object": {"const": obj}, "created": INT, "model": STRING,  # noqa: E731
                                    "choices": _arr(choice), "usage": usage}, ("id", "object", "choices"))
    native = _obj({"content": STRING, "stop": {"type": "boolean"}, "tokens_predicted": INT,
                   "tokens_evaluated": INT, "model": STRING}, ("content", "stop"))
    msg = _obj({"role": STRING, "content": _opt("string"), "tool_calls": _arr(OBJ)}, ("role",))
    chunk = lambda obj: _obj({"object": {"const": obj}, "choices": _arr(OBJ)}, ("object", "choices"))  # noqa: E731
    piece = {"anyOf": [INT, _obj({"id": INT, "piece": {"anyOf": [STRING, _arr(INT)]}}, ("id", "piece"))]}
    return {
        "health": _json(_obj({"status": {"const": "ok"}}, ("status",))),
        "models": _json(_obj({"object": {"const": "list"}, "data": _arr(_obj({"id": STRING}, ("id",)), minItems=1),
                              "models": _arr(OBJ)}, ("object", "data"))),
        "completions_oai": _gen_ok(oai("text_completion", {**CHOICE, "properties": {
            **CHOICE["properties"], "text": STRING}, "required": ["index", "text"]}), chunk("text_completion")),
        "chat": _gen_ok(oai("chat.completion", {**CHOICE, "properties": {**CHOICE["properties"], "message": msg},
                                                "required": ["index", "message"]}), chunk("chat.completion.chunk")),
        "responses": _gen_ok(_obj({"id": STRING, "object": {"const": "response"}, "output": _arr(OBJ),
                                   "status": STRING}, ("id", "object", "output")),
                             _obj({"type": STRING, "sequence_number": INT}, ("type", "sequence_number"))),
        "native": _gen_ok({"anyOf": [native, _arr(native, minItems=2)]},
                          _obj({"index": INT, "content": STRING, "stop": {"type": "boolean"}}, ("content", "stop"))),
        "tokenize": _json(_obj({"tokens": _arr(piece)}, ("tokens",))),
        "detokenize": _json(_obj({"content": STRING}, ("content",))),
        "apply_template": _json(_obj({"prompt": STRING}, ("prompt",))),
        "input_tokens": _json(_obj({"input_tokens": {"type": "integer", "minimum": 0}}, ("input_tokens",))),
        "slots": _json(_arr(_obj({"id": INT, "n_ctx": INT, "is_processing": {"type": "boolean"}},
                                 ("id", "is_processing")))),
        "slot_action": _json(_obj({"id_slot": INT}, ("id_slot",))),
        "props": _json(_obj({"total_slots": INT, "default_generation_settings": OBJ}, ("total_slots",))),
        "props_set": _json(_obj({"success": {"const": True}}, ("success",))),
        "metrics": {"text/plain": {"schema": STRING}},
        "proxy": {"*/*": {"schema": ANY}},
        "openapi": _json(_obj({"openapi": STRING, "paths": OBJ}, ("openapi", "paths"))),
    }


# ---------------------------------------------------------------------------------------------------
# the description
# ---------------------------------------------------------------------------------------------------
#: the error codes of a route that reads a body
GEN = (400, 413, 503)


def _routes(cfg: ServerConfig, b: dict) -> list[tuple]:
    """Every route: (path, method, its 200 (:func:`_ok_schemas`), what it is, its body (schema name, fields,
    required; None: no body), its error codes)."""
    gen = _generation(cfg, b, chat=False)
    chat = {**_generation(cfg, b, chat=True), **_chat_fields()}
    resp_props = {**{k: v for k, v in chat.items() if k != "messages"}, **_responses_fields()}
    resp_chains = (("n_predict", "max_completion_tokens", "max_output_tokens", "max_tokens"), *ALIASES[1:])
    resp = ("Response", resp_props, ("input",), _aliases(resp_props, resp_chains))
    gen_if, chat_if = _aliases(gen), _aliases(chat)
    lim = cfg.limits
    completion = ("Completion", {**gen, "prompt": _prompt()}, ("prompt",), gen_if)
    chat_body = ("ChatCompletion", chat, ("messages",), chat_if)
    templ = ("ChatTemplate", _chat_fields(), ("messages",))
    mixed = {"anyOf": [STRING, _arr({"anyOf": [STRING, INT]})]}
    infill = ("Infill", {**gen, "input_prefix": mixed, "input_suffix": mixed, "prompt": _opt("string"),
                         "input_extra": _arr(_obj({"text": STRING, "filename": STRING}, ("text",)), nullable=True)},
              ("input_prefix", "input_suffix"), gen_if)
    tokenize = ("Tokenize", {"content": {"type": "string", "maxLength": lim.max_prompt_chars},
                             "add_special": _opt("boolean"), "parse_special": _opt("boolean"),
                             "with_pieces": _opt("boolean")}, ("content",))
    token = {"type": "integer", "minimum": 0, "maximum": b["n_vocab"] - 1 if b else I32_MAX}
    detok = ("Detokenize", {"tokens": _arr(token, nullable=True)}, ())
    # erase reads no body: any JSON then
    slot_file = ("SlotFile", {"filename": {"description": "save / restore: a file name in --slot-save-path (a string)"}},
                 (), [], "save / restore: an object")
    out = [("/health", "get", "health", "200 once the model is loaded", None, (503,)),
           ("/v1/health", "get", "health", "as /health", None, (503,)),
           ("/models", "get", "models", "the model (llama-server's and OpenAI's lists)", None, (503,)),
           ("/v1/models", "get", "models", "as /models", None, (503,)),
           ("/v1/completions", "post", "completions_oai", "OpenAI completions", completion, GEN),
           ("/v1/chat/completions", "post", "chat", "OpenAI chat completions", chat_body, GEN),
           ("/chat/completions", "post", "chat", "as /v1/chat/completions", chat_body, GEN)]
    out += [(p, "post", "responses", "OpenAI Responses API", resp, GEN) for p in ("/v1/responses", "/responses")]
    out += [(p, "post", "native", "llama.cpp's completion (no [DONE])", completion, GEN)
            for p in ("/completion", "/completions")]
    out += [("/apply-template", "post", "apply_template", "the chat prompt as text", templ, GEN)]
    out += [(p, "post", "input_tokens", "the chat prompt's length in tokens", templ, GEN)
            for p in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens")]
    out += [("/tokenize", "post", "tokenize", "text -> token ids", tokenize, GEN),
            ("/detokenize", "post", "detokenize", "token ids -> text", detok, GEN),
            ("/slots", "get", "slots", "per-slot state", None, (501, 503)),
            ("/slots/{id_slot}", "post", "slot_action", "save, restore or erase a slot (--slot-save-path)",
             slot_file, (400, 413, 500, 501, 503)),
            ("/infill", "post", "native", "fill-in-the-middle, answered as /completion", infill, GEN + (501,)),
            ("/props", "get", "props", "server settings", None, (503,)),
            ("/props", "post", "props_set", "accepted, changes nothing (--props)", ("Props", {}, ()), GEN + (501,)),
            ("/metrics", "get", "metrics", "Prometheus metrics (--metrics)", None, (501, 503)),
            ("/cors-proxy", "get", "proxy", "the web UI's MCP proxy (--ui-mcp-proxy)", None, (400, 403, 503)),
            ("/cors-proxy", "post", "proxy", "the web UI's MCP proxy (--ui-mcp-proxy)", None, (400, 403, 413, 503)),
            (OPENAPI_PATH, "get", "openapi", "this description", None, (503,))]
    return out


def _parameters(path: str, b: dict) -> list[dict]:
    if path == "/slots/{id_slot}":
        slot = {"type": "integer", "minimum": 0, **({"maximum": b["slot"]} if b else {})}
        return [{"name": "id_slot", "in": "path", "required": True, "schema": slot},
                {"name": "action", "in": "query", "required": True, "schema": {"enum": ["save", "restore", "erase"]}}]
    if path == "/slots":
        return [{"name": "fail_on_no_slot", "in": "query", "required": False, "schema": STRING,
                 "description": "503 when every slot is busy"}]
    if path == "/cors-proxy":
        return [{"name": "url", "in": "query", "required": False, "schema": {"type": "string", "format": "uri"}}]
    return []


def describe(cfg: ServerConfig, engine: "Engine | None" = None) -> dict:
    """The OpenAPI 3.1 document of a server started with ``cfg`` (``engine``: the loaded model's bounds)."""
    b = _bounds(engine)
    oks = _ok_schemas()
    paths: dict = {}
    schemas: dict = {"Error": ERROR}
    error = _json({"$ref": "#/components/schemas/Error"})
    for path, method, ok, summary, body, codes in _routes(cfg, b):
        public = path in PUBLIC
        codes = sorted(set(codes) | ({401} if cfg.api_keys and not public else set()))
        op: dict = {"operationId": f"{method}_{path.strip('/').replace('/', '_').replace('{', '').replace('}', '')}"
                    or "root", "summary": summary,
                    "responses": {"200": {"description": "OK", "content": oks[ok]},
                                  **{str(c): {"description": MESSAGES.get(c, "an error"), "content": error}
                                     for c in codes}}}
        params = _parameters(path, b)
        if params:
            op["parameters"] = params
        if body is not None:
            name, props, required, *more = body
            schemas[name] = _obj(props, required, **({"allOf": more[0]} if more and more[0] else {}))
            if len(more) > 1:  # not always an object
                schemas[name] = {"description": more[1], "properties": props}
            op["requestBody"] = {"required": path != "/slots/{id_slot}",
                                 "content": _json({"$ref": f"#/components/schemas/{name}"})}
        if public and cfg.api_keys:
            op["security"] = []
        paths.setdefault(path, {})[method] = op
    doc: dict = {"openapi": "3.1.0",
                 "info": {"title": "llamaspec serve", "version": _version(),
                          "description": "llama-server's and OpenAI's routes, with speculative decoding"},
                 "servers": [{"url": "/" + cfg.api_prefix.strip("/") if cfg.api_prefix.strip("/") else "/"}],
                 "paths": paths, "components": {"schemas": schemas}}
    if cfg.api_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "apiKey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}}
        doc["security"] = [{"bearer": []}, {"apiKey": []}]
    return doc


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("llamaspec")
    except Exception:  # noqa: BLE001 - not installed (a source tree)
        return "0"


async def openapi(request: HttpRequest):
    state = request.app.state.llamaspec
    return JSONResponse(describe(state.config, state.engine))
