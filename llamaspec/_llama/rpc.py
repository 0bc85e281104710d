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
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import re
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from llama_cpp import llama_cpp as native

from ..errors import RpcError, UsageError

log = logging.getLogger("llamaspec")

#: the RPC protocol version of the vendored llama.cpp (ggml/include/ggml-rpc.h, RPC_PROTO_*_VERSION)
PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH = 7, 0, 0
#: GGML_RPC_MAX_SERVERS
MAX_SERVERS = 16
#: RPC_CMD_HELLO (fixed at 14 across versions), RPC_CONN_CAPS_SIZE (bytes of transport capabilities)
_CMD_HELLO = 14
_CONN_CAPS_SIZE = 24

#: seconds for the TCP connect and the HELLO reply of :func:`check_server`
CONNECT_TIMEOUT_S = float(os.environ.get("LLAMASPEC_RPC_CONNECT_TIMEOUT", "3"))
#: seconds one decode (or state save/load, free) over RPC may take before the servers count as stuck
DECODE_TIMEOUT_S = float(os.environ.get("LLAMASPEC_RPC_TIMEOUT", "120"))

BUILD_HINT = ("build llama.cpp with RPC (scripts/build_llama_cpp.sh --rpc) and point llama-cpp-python at it: "
              "export LLAMA_CPP_LIB_PATH=$PWD/native/lib")

_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")


# ---------------------------------------------------------------------------------------------------
# parsing
# ---------------------------------------------------------------------------------------------------


def parse_servers(value, *, flag: str = "--rpc") -> tuple[str, ...] | None:
    """``HOST:PORT[,HOST:PORT...]`` (a string or a list of endpoints) as a tuple of ``host:port``; None
    stays None. :class:`UsageError` with one line for a bad entry. ggml splits an endpoint at its first
    ``:``, so an IPv6 address cannot be used (give a host name).

    >>> parse_servers("127.0.0.1:50052, gpu-box:50053")
    ('127.0.0.1:50052', 'gpu-box:50053')
    >>> parse_servers(["localhost:1"])
    ('localhost:1',)
    >>> parse_servers("127.0.0.1")
    Traceback (most recent call last):
    llamaspec.errors.UsageError: --rpc: '127.0.0.1' is not HOST:PORT (e.g. 192.168.1.10:50052)
    >>> parse_servers("h:0")
    Traceback (most recent call last):
    llamaspec.errors.UsageError: --rpc: port of 'h:0' must be 1..65535
    """
    if value is None:
        return None
    if isinstance(value, (str, bytes)):
        text = value.decode() if isinstance(value, bytes) else value
        items = text.split(",")
        if not text.strip():
            raise UsageError(f"{flag}: no RPC server given: expected HOST:PORT[,HOST:PORT...]")
    elif hasattr(value, "__iter__"):
        items = list(value)
        if not items:
            raise UsageError(f"{flag}: no RPC server given: expected a list of 'HOST:PORT'")
    else:
        raise UsageError(f"{flag}: expected HOST:PORT[,HOST:PORT...] or a list of them, got {value!r}")
    out: list[str] = []
    for raw in items:
        if not isinstance(raw, str):
            raise UsageError(f"{flag}: expected 'HOST:PORT' strings, got {raw!r}")
        item = raw.strip()
        if not item:
            raise UsageError(f"{flag}: empty entry in {value!r}: expected HOST:PORT[,HOST:PORT...]")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port:
            raise UsageError(f"{flag}: {item!r} is not HOST:PORT (e.g. 192.168.1.10:50052)")
        if ":" in host or host.startswith("["):
            raise UsageError(f"{flag}: {item!r}: IPv6 addresses are not supported by ggml's RPC client; use a "
                             "host name or an IPv4 address")
        if not _HOST_RE.match(host):
            raise UsageError(f"{flag}: {item!r}: bad host name {host!r}")
        if not port.isdigit():
            raise UsageError(f"{flag}: {item!r}: port {port!r} is not a number")
        if not 1 <= int(port) <= 65535:
            raise UsageError(f"{flag}: port of {item!r} must be 1..65535")
        ep = f"{host}:{int(port)}"
        if ep in out:
            raise UsageError(f"{flag}: {ep} is listed twice")
        out.append(ep)
    if len(out) > MAX_SERVERS:
        raise UsageError(f"{flag}: {len(out)} servers, ggml's RPC client supports at most {MAX_SERVERS}")
    return tuple(out)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


# ---------------------------------------------------------------------------------------------------
# the server check (before ggml sees the endpoint)
# ---------------------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("connection closed")
        buf += part
    return buf


def hello(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """Connect and do the RPC protocol's HELLO: the server's ``(major, minor, patch)``. Raises
    :class:`RpcError` (one line) when the server is unreachable, does not answer in ``timeout`` seconds or
    answers something that is not an RPC HELLO reply. Wire format (ggml-rpc.cpp): request ``| cmd u8 |
    size u64 | conn_caps[24] |``, reply ``| size u64 | major minor patch pad u8 | conn_caps[24] |``; zero
    capabilities keep the connection plain TCP."""
    timeout = CONNECT_TIMEOUT_S if timeout is None else timeout
    host, port = _split(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint} is unreachable: no connection within {timeout:g} s "
                       "(host down or port filtered?)") from None
    except OSError as e:
        why = e.strerror or str(e)
        raise RpcError(f"RPC server {endpoint} is unreachable: {why} (is ggml-rpc-server running there, "
                       f"e.g. ggml-rpc-server -H 0.0.0.0 -p {port}?)") from None
    try:
        sock.settimeout(timeout)
        sock.sendall(struct.pack("<BQ", _CMD_HELLO, _CONN_CAPS_SIZE) + bytes(_CONN_CAPS_SIZE))
        size = struct.unpack("<Q", _recv_exact(sock, 8))[0]
        if size != 4 + _CONN_CAPS_SIZE:
            raise RpcError(f"RPC server {endpoint} answered HELLO with {size} bytes, expected "
                           f"{4 + _CONN_CAPS_SIZE}: not an RPC server of protocol {PROTO_MAJOR}.x "
                           "(another llama.cpp version?)")
        major, minor, patch = struct.unpack("<BBB", _recv_exact(sock, size)[:3])
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint} accepted the connection but did not answer within {timeout:g} s: "
                       "it is busy with another client (ggml-rpc-server serves one at a time) or is not an "
                       "RPC server") from None
    except (ConnectionError, OSError) as e:
        raise RpcError(f"RPC server {endpoint} closed the connection during HELLO ({e}): not an RPC server, "
                       f"or one of an older protocol than {PROTO_MAJOR}.{PROTO_MINOR} (rebuild ggml-rpc-server "
                       "from the same llama.cpp as this library)") from None
    finally:
        sock.close()
    return major, minor, patch


def check_server(endpoint: str, timeout: float | None = None) -> tuple[int, int, int]:
    """:func:`hello`, and the version rule of ggml's client (same major, minor not newer than ours):
    :class:`RpcError` for a mismatch, where ggml itself would abort the process."""
    major, minor, patch = hello(endpoint, timeout)
    if major != PROTO_MAJOR or minor > PROTO_MINOR:
        raise RpcError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}, this llama.cpp "
                       f"{PROTO_MAJOR}.{PROTO_MINOR}.{PROTO_PATCH}: run a ggml-rpc-server built from the same "
                       "llama.cpp (scripts/build_llama_cpp.sh --rpc builds one)")
    return major, minor, patch


# ---------------------------------------------------------------------------------------------------
# ggml's backend registry, bound by name on the library llama_cpp loaded
# ---------------------------------------------------------------------------------------------------


def supported() -> bool:
    """Whether the loaded llama.cpp library has the RPC backend (``llama_supports_rpc``)."""
    return bool(native.llama_supports_rpc())


def library_dir() -> Path:
    """The directory of the libllama that llama_cpp loaded (libggml*.so sit next to it)."""
    return Path(native._lib._name).resolve().parent


class _Ggml:
    """ggml functions llama-cpp-python does not bind, looked up in libggml / libggml-base next to libllama."""

    _SIGS = {
        "ggml_backend_reg_by_name": (ctypes.c_void_p, [ctypes.c_char_p]),
        "ggml_backend_reg_get_proc_address": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]),
        "ggml_backend_reg_dev_count": (ctypes.c_size_t, [ctypes.c_void_p]),
        "ggml_backend_reg_dev_get": (ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]),
        "ggml_backend_dev_name": (ctypes.c_char_p, [ctypes.c_void_p]),
        "ggml_backend_dev_description": (ctypes.c_char_p, [ctypes.c_void_p]),
        "ggml_backend_dev_memory": (None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                           ctypes.POINTER(ctypes.c_size_t)]),
        "ggml_backend_dev_count": (ctypes.c_size_t, []),
        "ggml_backend_dev_get": (ctypes.c_void_p, [ctypes.c_size_t]),
        "ggml_backend_dev_type": (ctypes.c_int, [ctypes.c_void_p]),
        "ggml_set_abort_callback": (ctypes.c_void_p, [ctypes.c_void_p]),
    }

    def __init__(self) -> None:
        d = library_dir()
        libs = []
        for stem in ("libggml", "libggml-base"):
            for suffix in (".so", ".dylib", ".dll"):
                p = d / f"{stem}{suffix}"
                if p.exists():
                    libs.append(ctypes.CDLL(str(p)))  # already loaded by libllama: the same handle
                    break
        missing = []
        for name, (res, args) in self._SIGS.items():
            fn = None
            for lib in libs:
                try:
                    fn = getattr(lib, name)
                    break
                except AttributeError:
                    continue
            if fn is None:
                missing.append(name)
                continue
            fn.restype, fn.argtypes = res, args
            setattr(self, name, fn)
        if missing:
            raise RpcError(f"the ggml library in {d} lacks {', '.join(missing)}: cannot use RPC with it; {BUILD_HINT}")


_ggml: _Ggml | None = None
_lock = threading.RLock()


def ggml() -> _Ggml:
    """The bound ggml functions; :class:`UsageError` (one line, how to build with RPC) without RPC."""
    global _ggml
    with _lock:
        if _ggml is None:
            if not supported():
                raise UsageError(f"this llama.cpp library ({library_dir()}) was built without RPC: {BUILD_HINT}")
            _ggml = _Ggml()
        return _ggml


# ---------------------------------------------------------------------------------------------------
# the guard: native calls that talk to servers run on one worker thread
# ---------------------------------------------------------------------------------------------------

_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


class _State:
    def __init__(self) -> None:
        self.failure: str | None = None
        self.message: str | None = None  # the error line, with the servers that are gone (computed once)
        self.cv = threading.Condition()
        self.worker: threading.Thread | None = None
        self.jobs: "queue.SimpleQueue" = queue.SimpleQueue()
        self.abort_cb = None
        self.in_use: dict[str, int] = {}  # endpoint -> models loaded on it (ggml holds one connection)

    def fail(self, why: str) -> None:
        with self.cv:
            if self.failure is None:
                self.failure = why
            self.cv.notify_all()


_state = _State()


def failure() -> str | None:
    """Why RPC failed in this process (None while it works)."""
    return _state.failure


def _refuses(endpoint: str, timeout: float = 0.5) -> bool:
    """True when nothing accepts a TCP connection at ``endpoint`` (a server we are connected to would not
    answer a HELLO: it serves one client at a time, so only the connect tells)."""
    try:
        socket.create_connection(_split(endpoint), timeout=timeout).close()
        return False
    except OSError:
        return True


def _failure_error(what: str = "") -> RpcError:
    if _state.message is None:
        down = [ep for ep in list(_state.in_use) if _refuses(ep)]
        who = f"RPC server {', '.join(down)} is gone" if down else "an RPC server failed"
        _state.message = (f"{who}: {_state.failure or 'unknown error'}; the models on RPC servers cannot be used any "
                          "more in this process (restart the server and this process)")
    return RpcError(_state.message if not what else f"{_state.message} [during {what}]")


def check_alive(what: str = "") -> None:
    """:class:`RpcError` when an RPC server failed earlier in this process."""
    if _state.failure is not None:
        raise _failure_error(what)


def _on_abort(message: bytes) -> None:  # pragma: no cover - called from C, on the thread that hit the abort
    text = (message or b"").decode("utf-8", errors="replace").strip()
    th = threading.current_thread()
    rpc = "rpc" in text.lower() or th is _state.worker
    if rpc and th is not threading.main_thread():
        short = text.split(": ", 1)[-1] if ": " in text else text
        _state.fail(short)
        try:
            log.debug("ggml abort on an RPC thread, parked instead: %s", text)
        except Exception:  # noqa: BLE001
            pass
        threading.Event().wait()  # never returns: returning would let ggml call abort()
    try:
        sys.stderr.write(f"{text}\n")
    except Exception:  # noqa: BLE001
        pass


def _worker_loop() -> None:
    while True:
        fn, args, box, done = _state.jobs.get()
        try:
            box["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()
            with _state.cv:
                _state.cv.notify_all()


def _ensure_worker() -> None:
    with _lock:
        if _state.abort_cb is None:
            cb = _ABORT_CB(_on_abort)
            ggml().ggml_set_abort_callback(ctypes.cast(cb, ctypes.c_void_p))
            _state.abort_cb = cb  # keep the trampoline alive for the life of the process
        if _state.worker is None:
            t = threading.Thread(target=_worker_loop, name="llamaspec-rpc", daemon=True)
            t.start()
            _state.worker = t


def call(fn: Callable, *args, what: str = "an RPC call", timeout: float | None = None):
    """Run ``fn(*args)`` (a native call that may talk to RPC servers) on the RPC worker thread and return
    its result. :class:`RpcError` when a server failed (now or before) or ``timeout`` seconds passed."""
    check_alive(what)
    _ensure_worker()
    if threading.current_thread() is _state.worker:
        return fn(*args)
    box: dict = {}
    done = threading.Event()
    _state.jobs.put((fn, args, box, done))
    deadline = None if timeout is None else time.monotonic() + timeout
    with _state.cv:
        while not done.is_set():
            if _state.failure is not None:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                _state.fail(f"no reply from the RPC servers within {timeout:g} s (server stuck, or the network?); "
                            "raise LLAMASPEC_RPC_TIMEOUT if this decode is simply slow")
                break
            _state.cv.wait(0.5 if left is None else min(0.5, left))
    if not done.is_set():
        raise _failure_error(what)
    if "error" in box:
        raise box["error"]
    return box["result"]


def call_or_leak(fn: Callable, *args, what: str = "freeing") -> bool:
    """For frees: run ``fn`` guarded; False (and the native object is left allocated) when RPC failed."""
    if _state.failure is not None:
        log.debug("RPC failed earlier: %s skipped (the native object stays allocated)", what)
        return False
    try:
        call(fn, *args, what=what, timeout=DECODE_TIMEOUT_S)
        return True
    except RpcError as e:
        log.debug("%s skipped: %s", what, e)
        return False


# ---------------------------------------------------------------------------------------------------
# servers and devices
# ---------------------------------------------------------------------------------------------------


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
    with _lock:
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
        if not _state.in_use.get(endpoint):  # a connected server would not answer a second client
            check_server(endpoint, timeout)
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


def acquire(endpoints: Sequence[str]) -> None:
    """A model now holds a connection to these servers (the pre-check would block on them)."""
    with _lock:
        for ep in set(endpoints):
            _state.in_use[ep] = _state.in_use.get(ep, 0) + 1


def release(endpoints: Sequence[str]) -> None:
    with _lock:
        for ep in set(endpoints):
            n = _state.in_use.get(ep, 0) - 1
            if n > 0:
                _state.in_use[ep] = n
            else:
                _state.in_use.pop(ep, None)


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
