"""llama.cpp's RPC backend: model layers on ``ggml-rpc-server`` processes, possibly on other machines.

What llama.cpp's ``--rpc host:port,...`` does, done through ggml's backend registry with ctypes (nothing of
it is bound by llama-cpp-python): find the ``RPC`` backend (``ggml_backend_reg_by_name``), its
``ggml_backend_rpc_add_server`` entry point (``ggml_backend_reg_get_proc_address``), call it once per server
(it returns a registry holding that server's devices) and hand the devices to model loading through
``llama_model_params.devices``. Unlike llama.cpp's tools, the devices are **not** registered globally, so a
model loaded without ``devices`` (the draft, by default) stays local and other models in the process are
not affected.

Failure handling, because ggml's RPC client aborts the process on any network error:

* before ggml ever sees an endpoint, :func:`check_server` connects with a short timeout and does the
  protocol's HELLO itself: an unreachable server, a server busy with another client (``ggml-rpc-server``
  serves one client at a time), something that is not an RPC server, or another protocol version is one
  :class:`~llamaspec.errors.RpcError` line;
* every native call that talks to a server (model load, context creation, decode, state save/load, free)
  runs on one worker thread (:func:`call`); ggml's abort hook (``ggml_set_abort_callback``) parks the
  thread that hit an RPC error instead of returning into ``abort()``, and the caller gets an
  :class:`RpcError`. From then on every call on an RPC-backed model or context raises that error at once
  (the dead connection cannot be reused: ggml keeps it), their native objects are left allocated (freeing
  them would wait on the dead connection), and new RPC models need a new process. Local models go on.
* a server that stops answering (alive but stuck) fails the same way after :data:`DECODE_TIMEOUT_S`.

The pieces: :mod:`.rpc_protocol` (endpoints, the HELLO check), :mod:`.rpc_ggml` (the ggml binding),
:mod:`.rpc_guard` (the worker thread, the abort hook, timeouts, connection counts) and :mod:`.rpc_devices`
(servers and their devices). Callers use this module.
"""
from __future__ import annotations

from .rpc_devices import Device, add_server, device_array, devices, local_gpu_devices
from .rpc_ggml import BUILD_HINT, ggml, library_dir, supported
from .rpc_guard import DECODE_TIMEOUT_S, acquire, call, call_or_leak, check_alive, connected, failure, release
from .rpc_protocol import (CMD_HELLO, CONN_CAPS_SIZE, CONNECT_TIMEOUT_S, MAX_SERVERS, PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH,
                           check_server, hello, parse_servers, split_endpoint)

__all__ = [
    "BUILD_HINT", "CMD_HELLO", "CONN_CAPS_SIZE", "CONNECT_TIMEOUT_S", "DECODE_TIMEOUT_S", "MAX_SERVERS", "PROTO_MAJOR",
    "PROTO_MINOR", "PROTO_PATCH", "Device", "acquire", "add_server", "call", "call_or_leak", "check_alive", "check_server",
    "connected", "device_array", "devices", "failure", "ggml", "hello", "library_dir", "local_gpu_devices",
    "parse_servers", "release", "split_endpoint", "supported",
]

# doctest.testmod("llamaspec._llama.rpc") only looks at objects defined in this module: name the worked examples
__test__ = {"parse_servers": parse_servers}
