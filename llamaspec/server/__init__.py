"""``llamaspec serve``: an OpenAI-compatible HTTP server with llama-server's routes, shapes and codes.

Needs the ``server`` extra (``pip install "llamaspec[server]"``: Starlette, uvicorn, prometheus-client).

* :mod:`.app`: the Starlette app (:func:`create_app`: the route table, middleware, lifespan)
* :mod:`.state`: :class:`ServerConfig`, :class:`ServerState` (the engine's start, the loading thread, shutdown)
* :mod:`.pipeline`: the generation routes (one table, one handler: parse, tokenise, submit)
* :mod:`.routes`: the other handlers; :mod:`.render`, :mod:`.responses`: the response shapes
* :mod:`.middleware`: 503 while loading, the API key, the exception handlers; :mod:`.errors`: the error shape
* :mod:`.parsing`: request bodies -> sampling, length, stop, per-request speculative settings
* :mod:`.jobs`: engine requests -> asyncio (pump threads), SSE, cancel on client disconnect
* :mod:`.formats`: ``timings`` (llama-server's fields + the acceptance report), ``usage``
* :mod:`.metrics`: Prometheus collector with llama-server's names
* :mod:`.run`: uvicorn on a pre-bound socket, the model loaded in a thread
* :mod:`.openapi`: ``GET /openapi.json``, the OpenAPI 3.1 description of every route
"""
from __future__ import annotations

__all__ = ["ServerConfig", "ServerState", "create_app", "serve"]


def __getattr__(name: str):
    if name in ("ServerConfig", "ServerState", "create_app"):
        from . import app

        return getattr(app, name)
    if name == "serve":
        from .run import serve

        return serve
    raise AttributeError(name)
