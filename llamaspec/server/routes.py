"""The handlers of ``llamaspec serve`` other than the generation routes (those are
:mod:`~llamaspec.server.pipeline`'s; the route table is :func:`llamaspec.server.app.create_app`'s)."""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from .. import _llama
from . import cancel, formats
from .chat_prompt import chat_prompt
from .errors import ApiError, invalid, not_supported, unavailable
from .jobs import in_worker
from .limits import check_chars
from .metrics import render as render_metrics
from .parsing import parse_messages
from .pipeline import read_json, state_of
from .render import SYSTEM_FINGERPRINT, generation_settings
from .state import ServerState
from .tools import parse_tools

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["health", "models", "tokenize", "detokenize", "slots", "props", "metrics", "apply_template",
           "chat_input_tokens"]


async def _chat_text(request: HttpRequest, answer) -> JSONResponse:
    """The answer ``answer(engine, text)`` about a request's chat prompt text (made off the event loop, as every
    piece of work whose size the client chooses: the messages, 250k of them)."""
    state = state_of(request)
    eng = state.need_engine()
    b = await read_json(request)
    return await in_worker(lambda: JSONResponse(answer(eng, chat_prompt(
        state, b.data, parse_messages(b, state.config.limits), parse_tools(b.data)))), request=request)


async def apply_template(request: HttpRequest):
    """llama-server's ``POST /apply-template``: the chat prompt text, not generated."""
    return await _chat_text(request, lambda eng, text: {"prompt": text})


async def chat_input_tokens(request: HttpRequest):
    """``POST /v1/chat/completions/input_tokens``: how many tokens the chat prompt is."""
    return await _chat_text(request, lambda eng, text: {
        "input_tokens": len(eng.tokenize(text, add_special=True, parse_special=True))})


async def health(request: HttpRequest):
    state = state_of(request)
    if not state.ready:
        raise unavailable("Loading model")
    state.check_accepting()  # draining after a SIGTERM: route elsewhere
    if _llama.rpc.failure() is not None:  # the models on RPC servers cannot serve any more: route elsewhere
        raise unavailable(f"an RPC server failed ({_llama.rpc.failure()}); restart the server")
    return JSONResponse({"status": "ok"})


async def models(request: HttpRequest):
    state = state_of(request)
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
    state = state_of(request)
    eng = state.need_engine()
    b = await read_json(request)
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
    state = state_of(request)
    eng = state.need_engine()
    b = await read_json(request)
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
    state = state_of(request)
    if not state.config.slots:
        raise not_supported("This server does not support slots endpoint.")
    eng = state.need_engine()
    infos = eng.slots_info()
    out = [_slot_json(state, eng, info) for info in infos]
    if request.query_params.get("fail_on_no_slot") not in (None, "", "0", "false") and all(s["is_processing"] for s in out):
        raise ApiError(503, "no slot available", "unavailable_error")
    return JSONResponse(out)


async def props(request: HttpRequest):
    state = state_of(request)
    if request.method == "POST":
        if not state.config.props:
            raise not_supported("This server does not support changing global properties. Start it with `--props`")
        await read_json(request)  # a JSON object (nothing in it changes the server yet, as in llama-server)
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
    state = state_of(request)
    if not state.config.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    state.need_engine()
    data, ctype = render_metrics(state.registry)
    resp = Response(data, media_type=ctype)
    resp.raw_headers.append((b"Process-Start-Time-Unix", str(int(state.t_start)).encode()))  # llama-server's spelling
    return resp
