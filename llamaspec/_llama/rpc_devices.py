"""RPC servers as ggml devices: registering a server with ggml's RPC backend (checked first), its devices,
the local GPUs that follow them, and the device array for model loading.

Part of :mod:`llamaspec._llama.rpc` (use that module).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Sequence

from ..errors import RpcError
from . import rpc_protocol
from .rpc_ggml import BUILD_HINT, ggml, library_dir, setup_lock
from .rpc_guard import DECODE_TIMEOUT_S, call, check_alive, connected
from .rpc_protocol import parse_servers

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
        devs = []
        for i in range(int(g.ggml_backend_reg_dev_count(ctypes.c_void_p(reg)))):
            ptr = g.ggml_backend_reg_dev_get(ctypes.c_void_p(reg), i)
            name = (g.ggml_backend_dev_name(ctypes.c_void_p(ptr)) or b"").decode("utf-8", "replace")
            desc = (g.ggml_backend_dev_description(ctypes.c_void_p(ptr)) or b"").decode("utf-8", "replace")
            devs.append(Device(endpoint, i, int(ptr), name, desc))
        _devices[endpoint] = tuple(devs)
        log.info("RPC server %s: %s", endpoint, ", ".join(f"{d.name} ({d.description})" for d in devs))
        return _devices[endpoint]


def devices(servers: Sequence[str], *, timeout: float | None = None) -> list[Device]:
    """Every device of every server, in the order given (llama.cpp's ``-ts`` proportions follow it)."""
    eps = parse_servers(list(servers)) or ()
    out: list[Device] = []
    for ep in eps:
        out.extend(add_server(ep, timeout=timeout))
    return out


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
            name = (g.ggml_backend_dev_name(ctypes.c_void_p(ptr)) or b"").decode("utf-8", "replace")
            desc = (g.ggml_backend_dev_description(ctypes.c_void_p(ptr)) or b"").decode("utf-8", "replace")
            (gpus if t == _DEV_GPU else igpus).append(Device("local", i, int(ptr), name, desc))
    return gpus or igpus


def device_array(devs: Sequence[Device]):
    """The NULL-terminated ``ggml_backend_dev_t`` array for ``llama_model_params.devices`` (keep it alive
    while the model loads)."""
    arr = (ctypes.c_void_p * (len(devs) + 1))(*[d.ptr for d in devs], None)
    return arr
