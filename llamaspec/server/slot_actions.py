"""``POST /slots/{id_slot}?action=save|restore|erase``: llama-server's slot files (``--slot-save-path DIR``).

* ``save`` (body ``{"filename": NAME}``): the slot's prompt cache (its tokens and the target's state of them)
  to ``DIR/NAME`` in llama-server's file format (:mod:`llamaspec.slot_file`);
  ``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``.
* ``restore`` (same body): that file into the slot: the next request whose prompt shares a prefix with the
  saved tokens decodes only the rest (``timings.cache_n``);
  ``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``. A file that cannot be
  restored is a 400 ``Unable to restore slot: ...`` and leaves the slot empty.
* ``erase``: drop the slot's prompt cache; ``{"id_slot", "n_erased"}``.

A busy slot is waited for (llama-server defers the task), up to :data:`SLOT_WAIT_S`, then a 503 with
``Retry-After``; the waiting happens in threads of their own (:data:`SLOT_WORKERS`), never in the worker pool
the other routes share, so actions on a busy slot stall no ``/tokenize`` or generation. The file name follows llama-server's rule (no path
separators, no ``..``: ``llamaspec.slot_file.valid_filename``), else 400 ``Invalid filename``; without
``--slot-save-path`` every action is a 501, as in llama-server. The engine side is
``Engine.slot_store`` (:mod:`llamaspec.slot_state`: the draft context is cleared and catches up on the next
request). Differs on purpose: a body without ``filename`` is a 400 (llama-server: 500).
"""
from __future__ import annotations

import asyncio
import os
import time
import weakref
from typing import Any, Callable

import anyio
import anyio.to_thread

from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse

from ..errors import LlamaSpecError
from ..slot_file import SlotFileError, valid_filename
from ..slot_state import SlotBusyError
from .errors import ApiError, api_error, invalid, not_supported
from .pipeline import read_json, state_of

__all__ = ["slot_action", "SLOT_WAIT_S", "SLOT_WORKERS"]

#: how long an action waits for its slot to be free before a 503 with ``Retry-After``
SLOT_WAIT_S = 10.0
#: threads for slot actions (apart from :data:`llamaspec.server.jobs.WORKERS`); more actions wait their turn
SLOT_WORKERS = 2
_LIMITERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter]" = weakref.WeakKeyDictionary()


async def _in_slot_worker(fn: Callable[[], Any]) -> Any:
    """``fn()`` in one of the slot actions' own threads; a slot still busy after :data:`SLOT_WAIT_S` is a 503."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        limiter = _LIMITERS[loop] = anyio.CapacityLimiter(SLOT_WORKERS)
    try:
        return await anyio.to_thread.run_sync(fn, limiter=limiter)
    except SlotBusyError as e:
        raise ApiError(503, f"{e}: it still serves a request after {SLOT_WAIT_S:g} s; retry later",
                       "unavailable_error", headers={"Retry-After": "1"}) from e


async def slot_action(request: HttpRequest):
    state = state_of(request)
    directory = state.config.slot_save_path
    if not directory:
        raise not_supported("This server does not support slots action. Start it with `--slot-save-path`")
    eng = state.need_engine()
    try:
        id_slot = int(request.path_params["id_slot"])
    except ValueError:
        raise invalid("Invalid slot ID") from None
    action = request.query_params.get("action")
    if action not in ("save", "restore", "erase"):
        raise invalid("Invalid action")
    if not 0 <= id_slot < eng.n_parallel:
        raise invalid("Invalid slot ID")
    if action == "erase":
        n = await _in_slot_worker(lambda: eng.slot_store.erase(id_slot, timeout=SLOT_WAIT_S))
        return JSONResponse({"id_slot": id_slot, "n_erased": n})
    b = await read_json(request)
    filename = b.data.get("filename")
    if not isinstance(filename, str):
        raise invalid("Field 'filename': expected the name of a file in the --slot-save-path directory")
    if not valid_filename(filename):
        raise invalid("Invalid filename")
    path = os.path.join(directory, filename)
    t0 = time.perf_counter()
    try:
        act = eng.slot_store.save_file if action == "save" else eng.slot_store.restore_file
        n_tokens, n_bytes = await _in_slot_worker(lambda: act(id_slot, path, timeout=SLOT_WAIT_S))
    except SlotFileError as e:
        raise invalid(f"Unable to restore slot: {str(e).replace(directory, '.')}") from e
    except OSError as e:  # its message would name the server's directory: the file's name only
        raise ApiError(500, f"Unable to {action} slot: {filename}: {e.strerror or type(e).__name__}",
                       "server_error") from e
    except LlamaSpecError as e:
        err = api_error(e)
        if isinstance(err, ApiError) and err.code != 500:
            raise err from e
        raise ApiError(500, f"Unable to {action} slot: {str(e).replace(directory, '.')}", "server_error") from e
    ms = (time.perf_counter() - t0) * 1e3
    if action == "save":
        return JSONResponse({"id_slot": id_slot, "filename": filename, "n_saved": n_tokens, "n_written": n_bytes,
                             "timings": {"save_ms": ms}})
    return JSONResponse({"id_slot": id_slot, "filename": filename, "n_restored": n_tokens, "n_read": n_bytes,
                         "timings": {"restore_ms": ms}})
