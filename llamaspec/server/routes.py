"""The handlers of ``llamaspec serve`` (the route table is :func:`llamaspec.server.app.create_app`'s) and the
request -> engine bridge they share (:func:`submit`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .. import _llama
from ..chat import apply_chat_template
from ..errors import ContextOverflowError, UsageError
from . import formats
from .errors import ApiError, api_error, exceed_context, invalid, not_supported, unavailable
from .jobs import GenerationResponse, JobGroup
from .metrics import render as render_metrics
from .parsing import Body, GenParams, parse_gen_params, parse_json, parse_messages, parse_prompts
from .render import SYSTEM_FINGERPRINT, ChatRenderer, CompletionRenderer, NativeRenderer, generation_settings
from .state import ServerState

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..request import Request

__all__ = ["submit", "completions_oai", "completion_native", "chat_completions", "health", "models", "tokenize",
           "detokenize", "slots", "props", "metrics"]


# ---------------------------------------------------------------------------------------------------
# request -> engine
# ---------------------------------------------------------------------------------------------------
def _tokenizer(eng: "Engine"):
    def tokenize(text: str, add_special: bool) -> list[int]:
        return eng.tokenize(text, add_special=add_special, parse_special=True)

    return tokenize


def _submit_kwargs(eng: "Engine", gen: GenParams) -> dict:
    return {"n_predict": gen.n_predict, "sampling": gen.sampling, "stop": gen.stop, "speculative": gen.speculative,
            "id_slot": gen.id_slot, "cache_prompt": gen.cache_prompt}


def submit(state: ServerState, prompts: list[list[int]], gen: GenParams) -> JobGroup:
    """Queue one engine request per prompt (times ``n``); 400 / 503 before anything runs when one cannot."""
    eng = state.need_engine()
    n_ctx = eng.n_ctx_seq
    if gen.id_slot >= eng.n_parallel:
        raise invalid(f"Field 'id_slot': this server has {eng.n_parallel} slots (0..{eng.n_parallel - 1}), "
                      f"got {gen.id_slot}")
    for toks in prompts:
        if not toks:
            raise invalid("the prompt is empty (and the model adds no BOS token): give at least one token")
        if len(toks) >= n_ctx:
            raise exceed_context(len(toks), n_ctx)
    reqs: list["Request"] = []
    kw = _submit_kwargs(eng, gen)
    try:
        for toks in prompts:
            for _ in range(gen.n_cmpl):
                reqs.append(eng.submit(toks, **kw))
    except BaseException as e:
        for r in reqs:
            r.cancel()
        if isinstance(e, ContextOverflowError):
            raise exceed_context(max(len(t) for t in prompts), n_ctx) from e
        raise api_error(e) from e
    group = JobGroup(reqs, on_close=state.drop_group)
    state.add_group(group)
    return group


# ---------------------------------------------------------------------------------------------------
# routes
# ---------------------------------------------------------------------------------------------------
def _state(request: HttpRequest) -> ServerState:
    return request.app.state.llamaspec


async def _body(request: HttpRequest) -> Body:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nobody reads the answer
        raise ApiError(400, "the client disconnected before sending the whole body") from None
    return Body(parse_json(raw))


def _model_name(b: Body, state: ServerState) -> str:
    v = b.data.get("model")
    return v if isinstance(v, str) and v else state.config.model_id


async def completions_oai(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    gen = parse_gen_params(b, state.config.defaults)
    prompts = parse_prompts(b, _tokenizer(eng))
    group = submit(state, prompts, gen)
    return GenerationResponse(group, CompletionRenderer(state, gen, _model_name(b, state), "cmpl"), stream=gen.stream,
                              ping_interval=state.config.sse_ping_interval)


async def completion_native(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    gen = parse_gen_params(b, state.config.defaults)
    prompts = parse_prompts(b, _tokenizer(eng))
    group = submit(state, prompts, gen)
    return GenerationResponse(group, NativeRenderer(state, gen, _model_name(b, state)), stream=gen.stream,
                              ping_interval=state.config.sse_ping_interval)


async def chat_completions(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    gen = parse_gen_params(b, state.config.defaults)
    messages = parse_messages(b)
    try:
        text = apply_chat_template(eng.model, messages, template=state.chat_template)
    except UsageError as e:
        raise invalid(str(e)) from None
    prompt = eng.tokenize(text, add_special=True, parse_special=True)
    group = submit(state, [prompt], gen)
    return GenerationResponse(group, ChatRenderer(state, gen, _model_name(b, state), "chatcmpl"), stream=gen.stream,
                              ping_interval=state.config.sse_ping_interval)


async def health(request: HttpRequest):
    state = _state(request)
    if not state.ready:
        raise unavailable("Loading model")
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
    created = formats.now()
    return JSONResponse({"object": "list", "data": [{
        "id": state.config.model_id, "object": "model", "created": created, "owned_by": "llamaspec", "meta": meta}]})


async def tokenize(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    content = b.str("content", None)
    if content is None:
        raise invalid("\"content\" must be provided")
    toks = eng.tokenize(content, add_special=b.bool("add_special", False), parse_special=b.bool("parse_special", True))
    if not b.bool("with_pieces", False):
        return JSONResponse({"tokens": toks})
    out = []
    for t in toks:
        raw = eng.vocab.token_to_piece(t, special=True)
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        out.append({"id": t, "piece": piece})
    return JSONResponse({"tokens": out})


async def detokenize(request: HttpRequest):
    state = _state(request)
    eng = state.need_engine()
    b = await _body(request)
    key, toks = b.get("tokens")
    if toks is None:
        toks = []
    if not isinstance(toks, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in toks):
        raise invalid(f"Field '{key}': expected a list of token ids")
    n = eng.vocab.n_tokens
    bad = [t for t in toks if not 0 <= t < n]
    if bad:
        raise invalid(f"Field '{key}': token id {bad[0]} is outside the vocabulary (0..{n - 1})")
    return JSONResponse({"content": eng.vocab.detokenize(toks, unparse_special=True)})


def _slot_json(state: ServerState, eng: "Engine", info: dict) -> dict:
    slot = eng.slots[info["id"]]
    req = slot.request if info.get("is_processing") else None
    n_decoded = int(info.get("n_predicted", 0))
    n_remain = -1
    if req is not None and req.n_predict >= 0:
        n_remain = max(0, req.n_predict - n_decoded)
    return {
        "id": info["id"],
        "id_task": info.get("id_task") if info.get("id_task") is not None else -1,
        "n_ctx": eng.n_ctx_seq,
        "speculative": eng.chain is not None,
        "is_processing": bool(info.get("is_processing")),
        "params": generation_settings(eng, None, state.config.defaults, state.config.model_id) if req is None else {
            "n_predict": req.n_predict, "temperature": req.sampling.temp, "seed": req.sampling.seed,
            "stop": list(req.stop), "speculative": _spec_json(req.speculative)},
        "next_token": {"has_next_token": bool(info.get("is_processing")), "has_new_line": False, "n_remain": n_remain,
                       "n_decoded": n_decoded, "stopping_word": ""},
        # llamaspec: where the slot is and what its prompt cache holds
        "state": info.get("state"),
        "n_prompt_tokens": info.get("n_prompt", 0),
        "n_prompt_tokens_processed": info.get("n_prompt_done", 0),
        "n_cached": info.get("n_cached", 0),
        "n_past": info.get("n_past", 0),
    }


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
        raise not_supported("This server does not support changing global properties.")
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
    return Response(data, media_type=ctype)
