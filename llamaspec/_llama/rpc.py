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
:mod:`.rpc_guard` (the worker thread, the abort hook, timeouts, connection counts) and this module (servers
and their devices). Callers use this module.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Sequence

from ..errors import RpcError
from . import rpc_protocol
from .rpc_ggml import BUILD_HINT, ggml, library_dir, setup_lock, supported
from .rpc_guard import DECODE_TIMEOUT_S, acquire, call, call_or_leak, check_alive, connected, failure, release
from .rpc_protocol import CONN_CAPS_SIZE, MAX_SERVERS, PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH, check_server, parse_servers

__all__ = [
    "CONN_CAPS_SIZE", "DECODE_TIMEOUT_S", "MAX_SERVERS", "PROTO_MAJOR", "PROTO_MINOR", "PROTO_PATCH", "Device", "acquire",
    "add_server", "call", "call_or_leak", "check_alive", "check_server", "device_array", "devices", "failure",
    "local_gpu_devices", "parse_servers", "release", "supported",
]

# doctest.testmod("llamaspec._llama.rpc") only looks at objects defined in this module: name the worked examples
__test__ = {"parse_servers": parse_servers}

log = logging.getLogger("llamaspec")


@dataclass(frozen=True)
class Device:
    """One device of an RPC server (a server exposes one per backend device it was started with)."""

    endpoint: str
    index: int
    ptr: int  # ggml_backend_dev_t
    name: str
    description: str

    def memory(self) -> tuple[int, int]:
        """``(free, total)`` bytes, as the server reports them (``ggml_backend_dev_memory``)."""
        g = ggml()
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        call(g.ggml_backend_dev_memory, ctypes.c_void_p(self.ptr), ctypes.byref(free), ctypes.byref(total),
             what=f"the memory query of {self.endpoint}", timeout=DECODE_TIMEOUT_S)
        return int(free.value), int(total.value)

    def as_dict(self) -> dict:
        free, total = self.memory()
        return {"endpoint": self.endpoint, "index": self.index, "name": self.name, "description": self.description,
                "memory_free": free, "memory_total": total}


def _device(g, endpoint: str, index: int, ptr) -> Device:
    name, desc = ((fn(ctypes.c_void_p(ptr)) or b"").decode("utf-8", "replace")
                  for fn in (g.ggml_backend_dev_name, g.ggml_backend_dev_description))
    return Device(endpoint, index, int(ptr), name, desc)


_devices: dict[str, tuple[Device, ...]] = {}


def add_server(endpoint: str, *, timeout: float | None = None) -> tuple[Device, ...]:
    """Register one server with ggml's RPC backend (checked first, see :func:`check_server`) and return its
    devices. Cached per endpoint, as ggml caches its registry."""
    with setup_lock:
        check_alive(f"the registration of {endpoint}")
        if endpoint in _devices:
            return _devices[endpoint]
        g = ggml()
        reg_rpc = g.ggml_backend_reg_by_name(b"RPC")
        if not reg_rpc:
            raise RpcError(f"ggml's backend registry has no RPC backend in {library_dir()}; {BUILD_HINT}")
        fn_ptr = g.ggml_backend_reg_get_proc_address(ctypes.c_void_p(reg_rpc), b"ggml_backend_rpc_add_server")
        if not fn_ptr:
            raise RpcError(f"the RPC backend in {library_dir()} has no ggml_backend_rpc_add_server: {BUILD_HINT}")
        if not connected(endpoint):  # a connected server would not answer a second client
            rpc_protocol.check_server(endpoint, timeout)
        # this version: ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint)
        add = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(fn_ptr)
        reg = call(add, endpoint.encode(), what=f"the registration of {endpoint}", timeout=DECODE_TIMEOUT_S)
        if not reg:
            raise RpcError(f"RPC server {endpoint} reports no devices (start ggml-rpc-server with a device, e.g. -d CPU)")
        devs = _devices[endpoint] = tuple(
            _device(g, endpoint, i, g.ggml_backend_reg_dev_get(ctypes.c_void_p(reg), i))
            for i in range(int(g.ggml_backend_reg_dev_count(ctypes.c_void_p(reg)))))
        log.info("RPC server %s: %s", endpoint, ", ".join(f"{d.name} ({d.description})" for d in devs))
        return devs


def devices(servers: Sequence[str], *, timeout: float | None = None) -> list[Device]:
    """Every device of every server, in the order given (llama.cpp's ``-ts`` proportions follow it)."""
    return [d for ep in parse_servers(list(servers)) or () for d in add_server(ep, timeout=timeout)]


#: enum ggml_backend_dev_type
_DEV_GPU, _DEV_IGPU = 1, 2


def local_gpu_devices() -> list[Device]:
    """The local GPUs llama.cpp would use by default (discrete ones, else integrated ones): with explicit
    ``devices`` llama.cpp uses only those given, so they follow the RPC devices as in llama.cpp's order."""
    g = ggml()
    gpus, igpus = [], []
    for i in range(int(g.ggml_backend_dev_count())):
        ptr = g.ggml_backend_dev_get(i)
        t = int(g.ggml_backend_dev_type(ctypes.c_void_p(ptr)))
        if t in (_DEV_GPU, _DEV_IGPU):
            (gpus if t == _DEV_GPU else igpus).append(_device(g, "local", i, ptr))
    return gpus or igpus


def device_array(devs: Sequence[Device]):
    """The NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices`` (keep it alive
    while the model loads)."""
    return (ctypes.c_void_p * (len(devs) + 1))(*[d.ptr for d in devs], None)
