"""The handlers of ``llamaspec serve`` (the route table is :func:`llamaspec.server.app.create_app`'s) and the
request -> engine bridge they share (:func:`submit`)."""
from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .. import _llama
from ..errors import ContextOverflowError
from . import formats
from .chat_prompt import chat_prompt
from .errors import ApiError, api_error, exceed_context, invalid, not_supported, unavailable
from . import cancel
from .jobs import JobGroup, in_worker
from .respond import GenerationResponse
from .limits import check_chars, check_generations, read_body
from .metrics import render as render_metrics
from .prompt_bound import check_prompt
from .parsing import Body, GenParams, parse_gen_params, parse_json, parse_messages, parse_prompts
from .render import SYSTEM_FINGERPRINT, ChatRenderer, CompletionRenderer, NativeRenderer, generation_settings
from .responses import ResponsesRenderer, to_chat
from .state import ServerState
from .tenant import current_tenant
from .tools import ToolSpec, parse_tools
from .chat_format import ChatFormat, chat_format, constrained_grammar

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..request import Request

__all__ = ["submit", "completions_oai", "completion_native", "chat_completions", "health", "models", "tokenize",
           "detokenize", "slots", "props", "metrics", "apply_template", "chat_input_tokens", "responses"]


# ---------------------------------------------------------------------------------------------------
# request -> engine
# ---------------------------------------------------------------------------------------------------
def _tokenizer(eng: "Engine"):
    def tokenize(text: str, add_special: bool) -> list[int]:
        return _tokenize_prompt(eng, text, add_special)

    return tokenize


def _tokenize_prompt(eng: "Engine", text: str, add_special: bool = True) -> list[int]:
    """A prompt's tokens (special tokens parsed); a 400 before llama.cpp sees it when its special-token texts
    alone are too many for the slot's context (:mod:`~llamaspec.server.prompt_bound`)."""
    check_prompt(eng.vocab, text, eng.n_ctx_seq)
    cancel.check()
    return eng.tokenize(text, add_special=add_special, parse_special=True)


def submit(state: ServerState, prompts: list[list[int]], gen: GenParams) -> JobGroup:
    """Queue one engine request per prompt (times ``n``); 400 / 503 before anything runs when one cannot
    (a worker thread runs it, or the event loop for a small request: ``Engine.submit`` builds samplers and may
    admit)."""
    eng = state.need_engine()
    state.check_accepting()
    check_generations(len(prompts), gen.n_cmpl, state.config.limits)
    n_ctx = eng.n_ctx_seq
    for toks in prompts:  # llama-server's exceed_context_size_error before anything is queued
        if len(toks) >= n_ctx:
            raise exceed_context(len(toks), n_ctx)
    # the engine validates them (a UsageError is a 400 naming the field, before anything is queued)
    opts = dataclasses.replace(gen.options, owner=current_tenant())  # the API key's tenant (server/tenant.py)
    reqs: list["Request"] = []
    state.admission.reserve(len(prompts) * gen.n_cmpl)  # 503 + Retry-After when the server is full
    try:
        for toks in prompts:
            for _ in range(gen.n_cmpl):
                reqs.append(eng.submit(toks, opts))
    except BaseException as e:
        state.admission.release(len(prompts) * gen.n_cmpl)
        for r in reqs:
            r.cancel()
        if isinstance(e, ContextOverflowError):
            raise exceed_context(max(len(t) for t in prompts), n_ctx) from e
        raise api_error(e) from e
    group = JobGroup(reqs, on_close=state.drop_group, dispatcher=state.dispatcher)
    state.add_group(group)
    return group


# ---------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------
def _state(request: HttpRequest) -> ServerState:
    return request.app.state.llamaspec


async def _body(request: HttpRequest) -> Body:
    limits = _state(request).config.limits
    raw = await read_body(request, limits)  # 413 past --max-body-size
    if len(raw) > 65536:  # a large body is parsed off the event loop
        return Body(await in_worker(parse_json, raw, limits, request=request), len(raw))
    return Body(parse_json(raw, limits), len(raw))


#: a body up to this size, asking for at most INLINE_REQUESTS generations and no grammar, is tokenised and
#: submitted on the event loop: tens of microseconds of native work, against ~0.3 ms for the hop to a
#: worker thread and back
INLINE_BODY = 8192
INLINE_REQUESTS = 4
_GRAMMAR_FIELDS = ("grammar", "json_schema", "response_format", "tools", "tool_choice")


def _inline(b: Body) -> bool:
    """Whether the request is cheap to submit on the event loop (see INLINE_BODY).

    >>> _inline(Body({"prompt": "hi", "n": 2}, size=30)), _inline(Body({"prompt": ["a"] * 5}, size=30))
    (True, False)
    >>> _inline(Body({"prompt": "hi", "grammar": "root ::= x"}, size=40)), _inline(Body({"prompt": "hi"}, size=9000))
    (False, False)
    """
    if b.size is None or b.size > INLINE_BODY or any(b.data.get(k) is not None for k in _GRAMMAR_FIELDS):
        return False
    prompt = b.data.get("prompt")
    n = b.data.get("n", b.data.get("n_cmpl", 1))
    n_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return isinstance(n, int) and n_prompts * n <= INLINE_REQUESTS


async def _generation(state: ServerState, b: Body, prompts, tools: ToolSpec | None = None,
                      request: HttpRequest | None = None, fmt: ChatFormat | None = None) -> tuple[GenParams, JobGroup]:
    """Parse, tokenise (``prompts(b, gen)``: the token lists) and submit, in a worker thread unless the request
    is small (:func:`_inline`); ``tools``: the chat request's (a forced ``tool_choice`` constrains the output
    with their grammar); ``request``: its HTTP request (the work stops when its client leaves); ``fmt``: its
    JSON schema on the Jinja chat path (server/chat_format.py)."""
    eng = state.need_engine()

    def work() -> tuple[GenParams, JobGroup]:
        gen = parse_gen_params(b, state.config.defaults, n_ctx=eng.n_ctx_seq, limits=state.config.limits,
                               tokenize=lambda text: eng.tokenize(text, add_special=False, parse_special=False),
                               tools_ok=tools is not None)
        grammar = constrained_grammar(gen.sampling.grammar, tools, fmt, state.config.limits.max_grammar_alternatives)
        if grammar is not None:
            gen.with_grammar(grammar)
        return gen, submit(state, prompts(b, gen), gen)

    return work() if _inline(b) else await in_worker(work, request=request)


def _respond(state: ServerState, gen: GenParams, group: JobGroup, renderer) -> GenerationResponse:
    """The response of a generation route (``renderer()`` makes its renderer). Until the response owns the
    group, an error (a bad field read last) closes it: its requests are cancelled and their admission released
    (they would otherwise run on and count against --max-queued-generations forever)."""
    try:
        return GenerationResponse(group, renderer(), stream=gen.stream, ping_interval=state.config.sse_ping_interval)
    except BaseException:
        group.close()
        raise


def _model_name(b: Body, state: ServerState) -> str:
    v = b.data.get("model")
    return v if isinstance(v, str) and v else state.config.model_id


def _verbose(b: Body, state: ServerState) -> bool:
    """The request's ``verbose`` (llama-server: ``__verbose`` in the answer), default ``--verbose``."""
    v = b.data.get("verbose")
    if v is None:
        return state.config.verbose > 0
    if not isinstance(v, bool):
        raise invalid(f"Field 'verbose': expected true or false, got {v!r}")
    return v


def _completion_prompts(state: ServerState, eng: "Engine"):
    """How /completion and /v1/completions read their prompts (``_generation``'s prompt parser)."""
    return lambda b, gen: parse_prompts(b, _tokenizer(eng), limits=state.config.limits, n_cmpl=gen.n_cmpl,
                                        n_ctx=eng.n_ctx_seq)


async def completions_oai(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    verbose = _verbose(b, state)
    gen, group = await _generation(state, b, _completion_prompts(state, eng), request=request)
    return _respond(state, gen, group, lambda: CompletionRenderer(state, gen, _model_name(b, state), "cmpl",
                                                                  verbose=verbose))


async def completion_native(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    gen, group = await _generation(state, b, _completion_prompts(state, eng), request=request)
    return _respond(state, gen, group, lambda: NativeRenderer(state, gen, _model_name(b, state)))


def _chat_prompts(state: ServerState, eng: "Engine"):
    """How the chat routes read their prompt (``_generation``'s prompt parser): the messages, templated."""
    def prompt(b: Body, gen: GenParams) -> list[list[int]]:
        text = chat_prompt(state, b.data, parse_messages(b, state.config.limits))
        return [_tokenize_prompt(eng, text)]

    return prompt


async def chat_completions(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    verbose = _verbose(b, state)
    tools = parse_tools(b.data)  # 400 on bad tools before anything runs
    fmt = chat_format(state, b)
    gen, group = await _generation(state, b, _chat_prompts(state, eng), tools=tools, request=request, fmt=fmt)
    return _respond(state, gen, group, lambda: ChatRenderer(state, gen, _model_name(b, state), "chatcmpl",
                                                            verbose=verbose, tools=tools, fmt=fmt))


async def responses(request: HttpRequest):
    """OpenAI's Responses API over the chat path (:mod:`llamaspec.server.responses`)."""
    state = _state(request)
    eng = state.need_engine()
    raw = await _body(request)
    # off the event loop: the input list's length is the client's (100k items take seconds)
    b, tools = await in_worker(lambda: (lambda b: (b, parse_tools(b.data)))(Body(to_chat(raw.data), raw.size)),
                               request=request)
    fmt = chat_format(state, b)
    gen, group = await _generation(state, b, _chat_prompts(state, eng), tools=tools, request=request, fmt=fmt)
    return _respond(state, gen, group, lambda: ResponsesRenderer(state, gen, _model_name(b, state), tools, fmt))


async def apply_template(request: HttpRequest):
    """llama-server's ``POST /apply-template``: the chat prompt text, not generated."""
    state = _state(request)
    state.need_engine()
    b = await _body(request)
    # off the event loop, as every piece of work whose size the client chooses (the messages: 250k of them)
    return await in_worker(lambda: JSONResponse(
        {"prompt": chat_prompt(state, b.data, parse_messages(b, state.config.limits))}), request=request)


async def chat_input_tokens(request: HttpRequest):
    """``POST /v1/chat/completions/input_tokens``: how many tokens the chat prompt is."""
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)

    def count() -> JSONResponse:
        text = chat_prompt(state, b.data, parse_messages(b, state.config.limits))
        return JSONResponse({"input_tokens": len(eng.tokenize(text, add_special=True, parse_special=True))})

    return await in_worker(count, request=request)


async def health(request: HttpRequest):
    state = _state(request)
    if not state.ready:
        raise unavailable("Loading model")
    state.check_accepting()  # draining after a SIGTERM: route elsewhere
    if _llama.rpc.failure() is not None:  # the models on RPC servers cannot serve any more: route elsewhere
        raise unavailable(f"an RPC server failed ({_llama.rpc.failure()}); restart the server")
    return JSONResponse({"status": "ok"})


async def models(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    m = eng.model
    meta = {"vocab_type": getattr(eng.vocab, "type", None), "n_vocab": eng.vocab.n_tokens,
            "n_ctx_train": m.n_ctx_train, "n_embd": m.n_embd, "n_ctx": eng.n_ctx_seq}
    for k in ("n_params", "size"):
        v = getattr(m, k, None)
        if isinstance(v, (int, float)):
            meta[k] = v
    cfg = state.config
    created = formats.now()
    return JSONResponse({
        # llama-server's Ollama-style list first, then OpenAI's
        "models": [{"name": cfg.model_id, "model": cfg.model_id, "modified_at": "", "size": "", "digest": "",
                    "type": "model", "description": "", "tags": list(cfg.tags) or [""], "capabilities": ["completion"],
                    "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "", "families": [""],
                                                  "parameter_size": "", "quantization_level": ""}}],
        "object": "list",
        "data": [{"id": cfg.model_id, "aliases": list(cfg.aliases) or [cfg.model_id], "tags": list(cfg.tags),
                  "object": "model", "created": created, "owned_by": "llamaspec", "meta": meta}]})


async def tokenize(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    content = b.str("content", None)
    if content is None:
        raise invalid("\"content\" must be provided")
    check_chars("content", len(content), state.config.limits)
    add_special, parse_special = b.bool("add_special", False), b.bool("parse_special", True)
    with_pieces = b.bool("with_pieces", False)

    def work() -> Response:  # off the event loop: a million characters are millions of tokens and pieces
        toks = eng.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return _json_list("tokens", toks)
        out = []
        for i, t in enumerate(toks):
            if i % cancel.EVERY == 0:
                cancel.check()
            raw = eng.vocab.token_to_piece(t, special=True)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return _json_list("tokens", out)

    return await in_worker(work, request=request)


def _json_list(key: str, items: list, step: int = 8192) -> Response:
    """``{key: items}`` as JSON, encoded a slice at a time: one ``json.dumps`` of millions of items would hold
    the interpreter's lock for a second, and the event loop with it."""
    parts = []
    for i in range(0, len(items), step):
        cancel.check()
        parts.append(json.dumps(items[i:i + step], ensure_ascii=False, separators=(",", ":"))[1:-1])
    return Response(f'{{{json.dumps(key)}:[{",".join(parts)}]}}'.encode("utf-8"), media_type="application/json")


async def detokenize(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    key, toks = b.get("tokens")
    if toks is None:
        toks = []

    def work() -> JSONResponse:
        if not isinstance(toks, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in toks):
            raise invalid(f"Field '{key}': expected a list of token ids")
        n = eng.vocab.n_tokens
        bad = [t for t in toks if not 0 <= t < n]
        if bad:
            raise invalid(f"Field '{key}': token id {bad[0]} is outside the vocabulary (0..{n - 1})")
        return JSONResponse({"content": eng.vocab.detokenize(toks, unparse_special=True)})

    # a long list (a body holds a million and more) off the event loop
    return work() if not isinstance(toks, list) or len(toks) <= 4096 else await in_worker(work, request=request)


def _slot_json(state: ServerState, eng: "Engine", info: dict) -> dict:
    """One ``/slots`` entry as llama-server shapes it: ``id``, ``n_ctx``, ``speculative``, ``is_processing``,
    ``next_token`` (a list, as llama-server; nothing left over once idle), a busy one ``id_task`` and ``params``
    too; then llamaspec's prompt-cache fields."""
    busy = bool(info.get("is_processing"))
    out: dict = {"id": info["id"], "n_ctx": eng.n_ctx_seq, "speculative": eng.chain is not None, "is_processing": busy}
    req = eng.request_in_slot(info["id"]) if busy else None
    n_decoded, n_remain = (int(info.get("n_predicted", 0)), -1) if busy else (0, -1)  # idle: nothing left over
    opts = req.options if req is not None else None
    if opts is not None and opts.n_predict >= 0:
        n_remain = max(0, opts.n_predict - n_decoded)
    if busy:
        out["id_task"] = info.get("id_task") if info.get("id_task") is not None else -1
        out["params"] = generation_settings(eng, None, state.config.defaults, state.config.model_id) if opts is None else {
            "n_predict": opts.n_predict, "temperature": opts.sampling.temp, "seed": opts.sampling.seed,
            "stop": list(opts.stop), "speculative": _spec_json(opts.speculative)}
    out["next_token"] = [{"has_next_token": busy, "has_new_line": False, "n_remain": n_remain, "n_decoded": n_decoded,
                          "stopping_word": ""}]
    # llamaspec: where the slot is and what its prompt cache holds
    out.update({"state": info.get("state"), "n_prompt_tokens": info.get("n_prompt", 0),
                "n_prompt_tokens_processed": info.get("n_prompt_done", 0), "n_cached": info.get("n_cached", 0),
                "n_past": info.get("n_past", 0)})
    return out


def _spec_json(rs) -> dict | None:
    if rs is None:
        return None
    return {k: getattr(rs, k) for k in ("n_max", "n_min", "p_min", "verify")}


async def slots(request: HttpRequest):
    state = _state(request)
    if not state.config.slots:
        raise not_supported("This server does not support slots endpoint.")
    eng = state.need_engine()
    infos = eng.slots_info()
    out = [_slot_json(state, eng, info) for info in infos]
    if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and all(s["is_processing"] for s in out):
        raise ApiError(503, "no slot available", "unavailable_error")
    return JSONResponse(out)


async def props(request: HttpRequest):
    state = _state(request)
    if request.method == "POST":
        if not state.config.props:
            raise not_supported("This server does not support changing global properties. Start it with `--props`")
        await _body(request)  # a JSON object (nothing in it changes the server yet, as in llama-server)
        return JSONResponse({"success": True})
    eng = state.need_engine()
    cfg = state.config
    spec = eng.spec
    vocab = eng.vocab

    def piece(t: int) -> str:
        return vocab.token_to_piece(t, special=True).decode("utf-8", "replace") if t is not None and t >= 0 else ""

    return JSONResponse({
        "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": eng.n_ctx_seq, "speculative": eng.chain is not None,
                                        "is_processing": False,
                                        "params": generation_settings(eng, None, cfg.defaults, cfg.model_id)},
        "total_slots": eng.n_parallel,
        "model_alias": cfg.model_id,
        "model_path": cfg.model_path,
        "chat_template": state.chat_template or "",
        "bos_token": piece(getattr(vocab, "bos", -1)),
        "eos_token": piece(getattr(vocab, "eos", -1)),
        "build_info": SYSTEM_FINGERPRINT,
        "modalities": {"vision": False, "audio": False},
        "is_sleeping": False,
        # llamaspec: the server-wide speculative settings (per-request fields may only lower n_max)
        "speculative": {
            "types": list(eng.chain.types) if eng.chain is not None else ["none"],
            "n_max": eng.chain.n_max if eng.chain is not None else 0,
            "n_min": spec.draft.n_min, "p_min": spec.draft.p_min, "verify": eng.verify,
            "target_level": eng.tgt_level.name,
            "draft_level": eng.dft_level.name if eng.ctx_dft is not None else None,
        },
        "cache_prompt": bool(eng.cache_prompt),
    })


async def metrics(request: HttpRequest):
    state = _state(request)
    if not state.config.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    state.need_engine()
    data, ctype = render_metrics(state.registry)
    resp = Response(data, media_type=ctype)
    resp.raw_headers.append((b"Process-Start-Time-Unix", str(int(state.t_start)).encode()))  # llama-server's spelling
    return resp
