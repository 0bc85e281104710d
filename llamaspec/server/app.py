"""The Starlette application of ``llamaspec serve``: llama-server's routes, shapes and codes.

=========================================  ==============================================================
``GET /health``, ``/v1/health``            public; 503 ``unavailable_error`` while the model loads
``GET /v1/models``, ``/models``            the model and its metadata
``POST /v1/completions``                   OpenAI completions, stream and non-stream
``POST /v1/chat/completions``              OpenAI chat (the GGUF's template, ``--chat-template``)
``POST /v1/responses``, ``/responses``     OpenAI Responses API over the chat path, stream and non-stream
``POST /completion``, ``/completions``     llama.cpp's native completion (no ``[DONE]`` in streams)
``POST /tokenize``, ``/detokenize``        llama-server's bodies
``POST /apply-template``                   the chat prompt as text, not generated
``POST /v1/chat/completions/input_tokens`` the chat prompt's length in tokens
``POST /infill``                           fill-in-the-middle, as ``/completion`` (``server/infill.py``)
``GET /slots``                             per-slot state (``--no-slots``: 501)
``POST /slots/{id}?action=``               save, restore, erase a slot (``--slot-save-path``, else 501)
``GET /props``                             server settings (``POST``: 501 without ``--props``)
``GET /metrics``                           Prometheus (``--metrics``, else 501)
``GET``, ``POST /cors-proxy?url=``         the web UI's MCP proxy (``--ui-mcp-proxy``, else 403)
``GET /openapi.json``                      the OpenAPI 3.1 description of these routes (``server/openapi.py``)
=========================================  ==============================================================

Every error is ``{"error": {"code", "message", "type"}}`` with llama-server's code; a bad request is a 400
(never a 422 or 500). While the model loads every route but ``/health`` answers 503; with ``--api-key``
every route but ``/health`` (and ``/v1/health``) needs ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``, as
in llama-server.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Callable

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Route

from .cors_proxy import cors_proxy
from .middleware import EXCEPTION_HANDLERS, CorsMiddleware, GuardMiddleware, PrefixMiddleware
from .openapi import OPENAPI_PATH, openapi
from .pipeline import routes as generation_routes
from .routes import (
    apply_template,
    chat_input_tokens,
    detokenize,
    health,
    metrics,
    models,
    props,
    slots,
    tokenize,
)
from .slot_actions import slot_action
from .state import ServerConfig, ServerState

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["create_app", "ServerConfig", "ServerState"]


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
        *generation_routes(),  # /v1/completions, /v1/chat/completions, /v1/responses, /completion, /infill
        Route("/apply-template", apply_template, methods=["POST"]),
        Route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/v1/chat/completions/input_tokens", chat_input_tokens, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/slots", slots, methods=["GET"]),
        Route("/slots/{id_slot}", slot_action, methods=["POST"]),
        Route("/props", props, methods=["GET", "POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/cors-proxy", cors_proxy, methods=["GET", "POST"]),
        Route(OPENAPI_PATH, openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(PrefixMiddleware, prefix=state.config.api_prefix),
            Middleware(CorsMiddleware, state=state),
            Middleware(GuardMiddleware, state=state),
        ],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=lifespan,
    )
    app.state.llamaspec = state
    return app
