"""The RPC endpoints and the HELLO of ggml's RPC protocol, spoken by llamaspec itself before ggml ever sees an
endpoint (ggml's client aborts the process where this raises :class:`~llamaspec.errors.RpcError`).

Part of :mod:`llamaspec._llama.rpc` (use that module): this one needs no llama.cpp library.
"""
from __future__ import annotations

import os
import re
import socket
import struct

from ..errors import RpcError, UsageError

#: the RPC protocol version of the vendored llama.cpp (ggml/include/ggml-rpc.h, RPC_PROTO_*_VERSION)
PROTO_MAJOR, PROTO_MINOR, PROTO_PATCH = 7, 0, 0
#: GGML_RPC_MAX_SERVERS
MAX_SERVERS = 16
#: RPCCMD_HELLO (fixed at 14 across versions), RPCCONN_CAPS_SIZE (bytes of transport capabilities)
CMD_HELLO = 14
CONN_CAPS_SIZE = 24

#: seconds for the TCP connect and the HELLO reply of :func:`check_server`
CONNECT_TIMEOUT_S = float(os.environ.get("LLAMASPEC_RPC_CONNECT_TIMEOUT", "3"))

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


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of a parsed ``host:port``."""
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
    host, port = split_endpoint(endpoint)
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
        sock.sendall(struct.pack("<BQ", CMD_HELLO, CONN_CAPS_SIZE) + bytes(CONN_CAPS_SIZE))
        size = struct.unpack("<Q", _recv_exact(sock, 8))[0]
        if size != 4 + CONN_CAPS_SIZE:
            raise RpcError(f"RPC server {endpoint} answered HELLO with {size} bytes, expected "
                           f"{4 + CONN_CAPS_SIZE}: not an RPC server of protocol {PROTO_MAJOR}.x "
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

