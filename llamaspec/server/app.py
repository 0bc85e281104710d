"""The Starlette application of ``llamaspec serve``: llama-server's routes, shapes and codes.

=========================================  ==============================================================
``GET /health``, ``/v1/health``            public; 503 ``unavailable_error`` while the model loads
``GET /v1/models``, ``/models``            public (as in llama-server); the model and its metadata
``POST /v1/completions``                   OpenAI completions, stream and non-stream
``POST /v1/chat/completions``              OpenAI chat (the GGUF's template, ``--chat-template``)
``POST /completion``, ``/completions``     llama.cpp's native completion (no ``[DONE]`` in streams)
``POST /tokenize``, ``/detokenize``        llama-server's bodies
``GET /slots``                             per-slot state (``--no-slots``: 501)
``GET /props``                             server settings (``POST``: 501, as llama-server without --props)
``GET /metrics``                           Prometheus (``--metrics``, else 501)
=========================================  ==============================================================

Every error is ``{"error": {"code", "message", "type"}}`` with llama-server's code; a bad request is a 400
(never a 422 or 500). While the model loads every route but ``/health`` answers 503; with ``--api-key``
every route but ``/health`` and ``/v1/models`` needs ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import ContextOverflowError, EngineClosedError, LlamaSpecError, SamplerError, UsageError
from . import formats
from .errors import ApiError, exceed_context, invalid, invalid_api_key, not_supported, unavailable
from .jobs import GenerationResponse, JobGroup
from .parsing import Body, Defaults, GenParams, parse_gen_params, parse_json, parse_messages, parse_prompts
from .render import SYSTEM_FINGERPRINT, ChatRenderer, CompletionRenderer, NativeRenderer, generation_settings

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..request import Request

log = logging.getLogger("llamaspec.server")

#: routes that need neither a loaded model nor an API key
HEALTH = ("/health", "/v1/health")
#: routes that need no API key (llama-server's public endpoints)
PUBLIC = HEALTH + ("/models", "/v1/models")


@dataclass
class ServerConfig:
    """What ``llamaspec serve`` was started with (besides the Engine)."""

    model_id: str = "llamaspec"
    model_path: str = ""
    api_keys: list[str] = field(default_factory=list)
    metrics: bool = False
    slots: bool = True
    #: a built-in template name (``chatml``, ``llama3``...) or a Jinja template; None = the GGUF's own
    chat_template: str | None = None
    sse_ping_interval: float = 30.0
    defaults: Defaults = field(default_factory=Defaults)


class ServerState:
    """The engine (once loaded) and everything the routes share."""

    def __init__(self, config: ServerConfig, engine: "Engine | None" = None):
        self.config = config
        self.engine: "Engine | None" = None
        self.load_error: BaseException | None = None
        self.chat_template: str | None = None
        self.groups: set[JobGroup] = set()
        self._lock = threading.Lock()
        self.on_ready: Callable[["ServerState"], None] | None = None
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self._registry = None
        if engine is not None:
            self._set_engine(engine)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def _set_engine(self, engine: "Engine") -> None:
        tmpl = self.config.chat_template or engine.model.chat_template()
        if tmpl is None:
            log.warning("the model has no chat template: /v1/chat/completions uses chatml (as llama-server); "
                        "--chat-template NAME|TEMPLATE to choose one")
            tmpl = "chatml"
        from ..chat import apply_chat_template

        apply_chat_template(engine.model, [{"role": "user", "content": "x"}], template=tmpl)  # fails early
        self.chat_template = tmpl
        engine.start()
        self.engine = engine

    def load(self, loader: Callable[[], "Engine"]) -> None:
        """Build the engine (in the loader thread); ``/health`` answers 503 until it is ready."""
        eng = None
        try:
            eng = loader()
            self._set_engine(eng)
        except BaseException as e:  # noqa: BLE001 - reported by the serve command as one line
            self.load_error = e
            if eng is not None:
                with contextlib.suppress(Exception):
                    eng.close()
            if self.on_load_failed is not None:
                self.on_load_failed(e)
            return
        if self.on_ready is not None:
            self.on_ready(self)

    def shutdown(self) -> None:
        with self._lock:
            groups = list(self.groups)
        for g in groups:
            g.cancel()
        eng, self.engine = self.engine, None
        if eng is not None:
            with contextlib.suppress(Exception):
                eng.stop()
            eng.close()

    def add_group(self, g: JobGroup) -> None:
        with self._lock:
            self.groups.add(g)

    def drop_group(self, g: JobGroup) -> None:
        with self._lock:
            self.groups.discard(g)

    @property
    def registry(self):
        if self._registry is None:
            from .metrics import make_registry

            self._registry = make_registry(lambda: self.engine)
        return self._registry

    def need_engine(self) -> "Engine":
        eng = self.engine
        if eng is None:
            raise unavailable("Loading model")
        return eng


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
        raise _api_error(e) from e
    group = JobGroup(reqs, on_close=state.drop_group)
    state.add_group(group)
    return group


def _api_error(e: BaseException) -> BaseException:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (UsageError, SamplerError)):
        return invalid(str(e))
    if isinstance(e, EngineClosedError):
        return unavailable("the server is shutting down")
    if isinstance(e, LlamaSpecError):
        return ApiError(500, str(e), "server_error")
    return e


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
    from ..chat import apply_chat_template

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
    from .. import _llama

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
            "stop": list(req.stop), "speculative": _spec_json(getattr(req, "speculative", None))},
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
            "draft_level": eng.dft_level.name if getattr(eng, "ctx_dft", None) is not None else None,
        },
        "cache_prompt": bool(getattr(eng, "cache_prompt", False)),
    })


async def metrics(request: HttpRequest):
    state = _state(request)
    if not state.config.metrics:
        raise not_supported("This server does not support metrics endpoint. Start it with `--metrics`")
    state.need_engine()
    from .metrics import render

    data, ctype = render(state.registry)
    return Response(data, media_type=ctype)


# ---------------------------------------------------------------------------------------------------
# middleware, errors, the app
# ---------------------------------------------------------------------------------------------------
class GuardMiddleware:
    """llama-server's pre-routing: 503 while loading (except /health), then the API key (except public
    routes); CORS preflights pass."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        self.keys = [k.encode("utf-8") for k in state.config.api_keys]

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        given = []
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given.append(auth[7:].strip())
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"].strip())
        return any(hmac.compare_digest(g, k) for g in given for k in self.keys)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            err = None
            if path not in HEALTH and not self.state.ready:
                err = unavailable("Loading model")
            elif self.keys and path not in PUBLIC and not self._authorized(dict(scope.get("headers") or [])):
                err = invalid_api_key()
            if err is not None:
                await JSONResponse(err.to_dict(), status_code=err.code)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error_handler(request: HttpRequest, exc: Exception):
    assert isinstance(exc, ApiError)
    return JSONResponse(exc.to_dict(), status_code=exc.code)


async def _http_error_handler(request: HttpRequest, exc: Exception):
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        err = ApiError(404, "File Not Found", "not_found_error")
    elif exc.status_code == 405:
        err = ApiError(405, f"method {request.method} is not allowed on {request.url.path}", "invalid_request_error")
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return JSONResponse(err.to_dict(), status_code=err.code, headers=getattr(exc, "headers", None))


async def _library_error_handler(request: HttpRequest, exc: Exception):
    err = _api_error(exc)
    if not isinstance(err, ApiError):
        log.error("unexpected error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        err = ApiError(500, f"{type(exc).__name__}: {exc}", "server_error")
    return JSONResponse(err.to_dict(), status_code=err.code)


def create_app(state: ServerState, *, loader: Callable[[], "Engine"] | None = None) -> Starlette:
    """The ASGI app. With ``loader`` the engine is built in a thread at start-up (``/health`` is 503
    meanwhile); without it ``state`` must already hold an engine."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if loader is not None and not state.ready:
            threading.Thread(target=state.load, args=(loader,), name="llamaspec-load", daemon=True).start()
        try:
            yield
        finally:
            state.shutdown()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/models", models, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions_oai, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/chat/completions", chat_completions, methods=["POST"]),
        Route("/completion", completion_native, methods=["POST"]),
        Route("/completions", completion_native, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/props", props, methods=["GET", "POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"]),
            Middleware(GuardMiddleware, state=state),
        ],
        exception_handlers={ApiError: _api_error_handler, HTTPException: _http_error_handler,
                            LlamaSpecError: _library_error_handler, Exception: _library_error_handler},
        lifespan=lifespan,
    )
    app.state.llamaspec = state
    return app
