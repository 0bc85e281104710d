"""llama.cpp's RPC backend (issue 13): parsing, server checks, errors, and end to end over loopback.

Pure tests (parsing, the HELLO check against fake servers written here, CLI errors) always run. The end
to end tests need a llama.cpp library built with RPC and ``ggml-rpc-server``
(``scripts/build_llama_cpp.sh --rpc``); they are skipped with the reason otherwise. The library is chosen
when llama_cpp is imported, so they run in a child process with ``LLAMA_CPP_LIB_PATH`` set.
"""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import pytest
from click.testing import CliRunner

from llamaspec.cli.main import main
from llamaspec._llama import rpc
from llamaspec.errors import RpcError, UsageError
from support.rpc_servers import REPO, RpcServers, child_env, free_port, rpc_build

RPC_LIB, RPC_SERVER, WHY_NO_RPC = rpc_build()
needs_rpc = pytest.mark.skipif(bool(WHY_NO_RPC), reason=WHY_NO_RPC or "ok")


def run(*args):
    return CliRunner().invoke(main, list(args))


# -------------------------------------------------------------------------------------------------
# parsing
# -------------------------------------------------------------------------------------------------


def test_parse_servers_accepts():
    assert rpc.parse_servers("127.0.0.1:50052") == ("127.0.0.1:50052",)
    assert rpc.parse_servers(" a:1 ,b.local:65535") == ("a:1", "b.local:65535")
    assert rpc.parse_servers(["gpu-1:50052", "gpu-2:050053"]) == ("gpu-1:50052", "gpu-2:50053")
    assert rpc.parse_servers(None) is None


@pytest.mark.parametrize("value,msg", [
    ("", "no RPC server given"),
    ("127.0.0.1", "is not HOST:PORT"),
    (":50052", "is not HOST:PORT"),
    ("host:", "is not HOST:PORT"),
    ("a:1,,b:2", "empty entry"),
    ("a:1,", "empty entry"),
    ("host:port", "is not a number"),
    ("host:0", "must be 1..65535"),
    ("host:70000", "must be 1..65535"),
    ("::1:50052", "IPv6 addresses are not supported"),
    ("[::1]:50052", "IPv6 addresses are not supported"),
    ("bad host:1", "bad host name"),
    ("a:1,a:1", "listed twice"),
    (",".join(f"h{i}:1" for i in range(17)), "at most 16"),
    ([], "no RPC server given"),
    ([1], "expected 'HOST:PORT' strings"),
    (5, "expected HOST:PORT"),
])
def test_parse_servers_rejects(value, msg):
    with pytest.raises(UsageError) as ei:
        rpc.parse_servers(value)
    assert msg in str(ei.value) and "\n" not in str(ei.value)


def test_engine_rejects_bad_servers_before_loading(tiny_model, monkeypatch):
    from llama_cpp import llama_cpp as native

    from llamaspec.engine import Engine

    loads = []
    monkeypatch.setattr(native, "llama_model_load_from_file", lambda *a: loads.append(a))
    for kw, msg in ((dict(rpc_servers="x"), "rpc_servers (--rpc): 'x' is not HOST:PORT"),
                    (dict(rpc_servers_draft=["a:1", "a:1"]), "rpc_servers_draft (--rpc-draft): a:1 is listed twice")):
        with pytest.raises(UsageError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Engine(str(tiny_model("llama")), n_ctx=64, **kw)
    assert loads == []


def test_protocol_constants_match_the_vendored_header():
    hdr = REPO / "native/src/llama.cpp/ggml/include/ggml-rpc.h"
    src = REPO / "native/src/llama.cpp/ggml/src/ggml-rpc/ggml-rpc.cpp"
    if not hdr.exists():
        pytest.skip(f"{hdr} absent (the llama.cpp tree of scripts/build_llama_cpp.sh)")
    text = hdr.read_text()
    for name, v in (("MAJOR", rpc.PROTO_MAJOR), ("MINOR", rpc.PROTO_MINOR), ("PATCH", rpc.PROTO_PATCH)):
        assert f"RPC_PROTO_{name}_VERSION    {v}" in text or f"RPC_PROTO_{name}_VERSION {v}" in text, name
    assert f"GGML_RPC_MAX_SERVERS       {rpc.MAX_SERVERS}" in text
    assert "RPC_CMD_HELLO == 14" in src.read_text()
    transport = src.parent / "transport.h"
    assert f"RPC_CONN_CAPS_SIZE = {rpc.CONN_CAPS_SIZE}" in transport.read_text()


# -------------------------------------------------------------------------------------------------
# the server check, against fake servers
# -------------------------------------------------------------------------------------------------


class FakeServer:
    """Accepts one client at a time on 127.0.0.1 and answers as ``reply(request_bytes) -> bytes | None``
    (None: close without answering; "hang": keep the connection open, say nothing)."""

    def __init__(self, reply):
        self.reply = reply
        self.requests: list[bytes] = []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self._conns.append(c)
            c.settimeout(2)
            req = b""
            try:
                while len(req) < 1 + 8 + rpc.CONN_CAPS_SIZE:  # ggml sends the command in pieces
                    part = c.recv(1 + 8 + rpc.CONN_CAPS_SIZE - len(req))
                    if not part:
                        break
                    req += part
            except OSError:
                pass
            self.requests.append(req)
            out = self.reply(req)
            if out == "hang":
                continue
            if out is not None:
                c.sendall(out)
            c.close()

    def close(self):
        self._stop.set()
        self.thread.join(2)
        for c in self._conns:
            c.close()
        self.sock.close()


def _hello_reply(major, minor, patch, size=4 + rpc.CONN_CAPS_SIZE):
    body = bytes([major, minor, patch, 0]) + bytes(rpc.CONN_CAPS_SIZE)
    return lambda req: struct.pack("<Q", size) + body[:size]


@pytest.fixture
def fake():
    servers = []

    def make(reply):
        s = FakeServer(reply)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def test_hello_speaks_the_wire_format(fake):
    s = fake(_hello_reply(rpc.PROTO_MAJOR, rpc.PROTO_MINOR, 3))
    assert rpc.check_server(s.endpoint, timeout=2) == (rpc.PROTO_MAJOR, rpc.PROTO_MINOR, 3)
    cmd, size = struct.unpack("<BQ", s.requests[0][:9])
    assert (cmd, size, s.requests[0][9:]) == (14, rpc.CONN_CAPS_SIZE, bytes(rpc.CONN_CAPS_SIZE))  # plain TCP


@pytest.mark.parametrize("version,ok", [((7, 0, 9), True), ((6, 0, 0), False), ((8, 0, 0), False), ((7, 1, 0), False)])
def test_version_rule_is_ggmls(fake, version, ok):
    s = fake(_hello_reply(*version))
    if ok:
        assert rpc.check_server(s.endpoint, timeout=2) == version
        return
    with pytest.raises(RpcError) as ei:
        rpc.check_server(s.endpoint, timeout=2)
    msg = str(ei.value)
    assert f"speaks protocol {'.'.join(map(str, version))}" in msg and "same llama.cpp" in msg and "\n" not in msg


def test_unreachable_is_one_line():
    port = free_port()  # nothing listens there
    with pytest.raises(RpcError) as ei:
        rpc.check_server(f"127.0.0.1:{port}", timeout=1)
    assert f"RPC server 127.0.0.1:{port} is unreachable" in str(ei.value) and "ggml-rpc-server" in str(ei.value)


def test_silent_server_times_out(fake):
    import time

    s = fake(lambda req: "hang")
    t0 = time.monotonic()
    with pytest.raises(RpcError, match="did not answer within 0.3 s: it is busy with another client"):
        rpc.check_server(s.endpoint, timeout=0.3)
    assert time.monotonic() - t0 < 3


def test_server_that_hangs_up_or_answers_garbage(fake):
    s = fake(lambda req: None)  # an older server closes the connection on a HELLO it does not know
    with pytest.raises(RpcError, match="closed the connection during HELLO"):
        rpc.check_server(s.endpoint, timeout=2)
    s = fake(_hello_reply(7, 0, 0, size=4))
    with pytest.raises(RpcError, match="answered HELLO with 4 bytes"):
        rpc.check_server(s.endpoint, timeout=2)


# -------------------------------------------------------------------------------------------------
# CLI (any build)
# -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["generate", "probe", "bench", "serve"])
def test_help_lists_rpc_flags(cmd):
    h = " ".join(run(cmd, "--help").output.split())
    assert "--rpc HOST:PORT[,...]" in h and "--rpc-draft HOST:PORT[,...]" in h, cmd
    assert "default: none, the draft runs locally" in h


@pytest.mark.parametrize("args,msg", [
    (["generate", "x", "--rpc", "127.0.0.1"], "--rpc: '127.0.0.1' is not HOST:PORT"),
    (["generate", "x", "--rpc-draft", "a:1,a:1"], "--rpc-draft: a:1 is listed twice"),
    (["probe", "--rpc", "h:99999"], "--rpc: port of 'h:99999' must be 1..65535"),
    (["bench", "--quick", "--rpc", ""], "--rpc: no RPC server given"),
])
def test_cli_bad_servers_one_line(args, msg):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_bench_rpc_only_with_the_llamaspec_engine():
    r = run("bench", "--quick", "--engines", "llamaspec,native", "--rpc", "127.0.0.1:50052")
    assert r.exit_code == 2 and "work with --engines llamaspec only (not native)" in r.stderr, r.output
    r = run("bench", "--server", "--quick", "--rpc", "127.0.0.1:50052")
    assert r.exit_code == 2 and "not supported with bench --server" in r.stderr, r.output


def test_bench_rpc_reaches_the_models(monkeypatch, tmp_path):
    """bench --rpc: the target is loaded on the servers with all layers (the bench's CPU default -ngl 0
    would leave them empty), the draft locally (Model is replaced: no server needed)."""
    from llamaspec import _llama as L

    seen = []

    class Stop(Exception):
        pass

    def fake_model(path, **kw):
        seen.append(kw)
        if len(seen) == 2:
            raise Stop
        return None

    monkeypatch.setattr(L, "Model", fake_model)
    r = run("bench", "--quick", "--engines", "llamaspec", "--rpc", "127.0.0.1:50052,127.0.0.1:50053", "-ts", "1,1",
            "--no-progress", "--json", str(tmp_path / "r.json"))
    assert isinstance(r.exception, Stop), r.output
    assert seen[0]["rpc_servers"] == ("127.0.0.1:50052", "127.0.0.1:50053") and seen[0]["n_gpu_layers"] == -1
    assert seen[1]["rpc_servers"] is None  # the draft stays local by default


@pytest.mark.skipif(rpc.supported(), reason="this llama.cpp library has RPC")
def test_build_without_rpc_says_how_to_build(tiny_model):
    r = run("generate", "x", "-m", str(tiny_model("llama")), "-n", "2", "--rpc", "127.0.0.1:50052")
    assert r.exit_code == 2, r.output
    line = r.stderr.strip()
    assert len(line.splitlines()) == 1 and "built without RPC" in line
    assert "scripts/build_llama_cpp.sh --rpc" in line and "LLAMA_CPP_LIB_PATH" in line


# -------------------------------------------------------------------------------------------------
# end to end over loopback (RPC build only), each in a child process
# -------------------------------------------------------------------------------------------------

CHILD = textwrap.dedent(r'''
    import json, os, signal, sys, time
    import numpy as np
    from llamaspec import _llama as L
    from llamaspec.engine import Engine
    from llamaspec.params import RequestSpec, SpecParams
    from llamaspec.errors import RpcError
    a = json.loads(sys.argv[1])
    out = {"supported": L.rpc.supported()}
    greedy = L.SamplingParams(temp=0.0)

    def near_tie(target, prompt, x, y, tol=0.25):
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if k is None:
            return True, "prefix" if len(x) != len(y) else "equal"
        with L.Model(target) as m, L.Context(m, n_ctx=512) as ctx:
            toks = prompt + x[:k]
            ctx.decode_tokens(toks, 0, 0)
            lg = ctx.logits((len(toks) - 1) % ctx.n_batch).astype(np.float64)
        gap, top = abs(lg[x[k]] - lg[y[k]]), lg.max()
        return bool(gap <= tol and top - max(lg[x[k]], lg[y[k]]) <= tol), f"token {k}: gap {gap:.4f}"

    if a["case"] == "equal":
        T, D, eps, n = a["target"], a["draft"], a["servers"], a["n"]
        with Engine(T, n_ctx=256) as e:
            toks = [e.tokenize(p) for p in a["prompts"]]
            local = [e.generate(t, n_predict=n, sampling=greedy).tokens for t in toks]
        sp = SpecParams(); sp.draft.n_max = 4
        with Engine(T, draft=D, spec=sp, n_ctx=256, rpc_servers=eps, tensor_split=[1, 1]) as e:  # one upload
            out["devices"] = [d.endpoint for d in e.model.rpc_devices]
            out["draft_devices"] = [d.endpoint for d in e.model_dft.rpc_devices]
            off = RequestSpec(n_max=0)  # plain decoding on the same engine
            plain = [e.generate(t, n_predict=n, sampling=greedy, speculative=off).tokens for t in toks]
            res = [e.generate(t, n_predict=n, sampling=greedy) for t in toks]
            spec = [r.tokens for r in res]
            out["drafted"] = sum(r.stats.n_drafted for r in res)
        out["rpc_vs_local"] = [near_tie(T, t, x, y) for t, x, y in zip(toks, local, plain)]
        out["spec_vs_plain"] = [near_tie(T, t, x, y) for t, x, y in zip(toks, plain, spec)]
        out["lengths"] = [len(x) for x in local + plain + spec]
    elif a["case"] == "draft_on_rpc":
        with Engine(a["target"], draft=a["draft"], n_ctx=128, rpc_servers_draft=a["servers"][1:]) as e:
            out["target_devices"] = [d.endpoint for d in e.model.rpc_devices]
            out["draft_devices"] = [d.endpoint for d in e.model_dft.rpc_devices]
            out["tokens"] = e.generate("tok_1 tok_2", n_predict=6, sampling=greedy).tokens
        with Engine(a["target"], draft=a["draft"], n_ctx=128) as e:
            out["local_tokens"] = e.generate("tok_1 tok_2", n_predict=6, sampling=greedy).tokens
    elif a["case"] == "kill":
        e = Engine(a["target"], draft=a["draft"], n_ctx=256, n_parallel=2, rpc_servers=a["servers"], tensor_split=[1, 1])
        seen = [0]
        def on_chunk(i, ch):
            seen[0] += 1
            if seen[0] == 3:
                os.kill(a["pid"], getattr(signal, a.get("signal", "SIGKILL")))
        t0 = time.monotonic()
        res = e.generate_many(["tok_1 tok_2", "tok_3 tok_4"], n_predict=200, sampling=greedy, on_chunk=on_chunk)
        out["results"] = [(str(r.finish_reason), r.error, len(r.tokens)) for r in res]
        out["seconds"] = time.monotonic() - t0
        try:
            e.generate("tok_5", n_predict=2)
            out["after"] = "ok?"
        except Exception as ex:
            out["after"] = f"{type(ex).__name__}: {ex}"
        # the failed slots' sequences were released in both memories (host-side bookkeeping, no server needed)
        out["mem"] = [[e.ctx.memory.pos_max(s), e.ctx_dft.memory.pos_max(s)] for s in range(2)]
        e.close()
        with Engine(a["target"], n_ctx=64) as loc:  # local models still work in this process
            out["local_after"] = len(loc.generate("tok_1", n_predict=3, sampling=greedy).tokens)
    elif a["case"] == "ggml_handshake":
        from llamaspec._llama import rpc_protocol
        rpc_protocol.check_server = lambda *x, **k: None  # let ggml meet the wrong version itself (rpc.add_server looks it up there)
        try:
            L.rpc.devices([a["endpoint"]])
            out["error"] = None
        except RpcError as ex:
            out["error"] = str(ex)
    print("RESULT " + json.dumps(out), flush=True)
''')


def child(case: dict, timeout: float = 240) -> dict:
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True,
                       timeout=timeout, env=child_env(RPC_LIB), cwd=str(REPO))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    out = json.loads(lines[-1][7:])
    assert out["supported"], f"{RPC_LIB} has no RPC"
    return out


@pytest.fixture
def servers(tmp_path):
    with RpcServers(RPC_SERVER, 2, threads=1, log_dir=tmp_path) as s:
        yield s


@needs_rpc
@pytest.mark.real
def test_gemma_split_over_two_servers_equals_local(servers):
    """Gemma F32 split across two servers (-ts 1,1), draft local: greedy equals local, speculative equals
    plain (near-tie aware)."""
    from helpers import real_model

    target, draft = str(real_model("gemma3-270m-f32")), str(real_model("gemma3-270m-q4km"))
    out = child({"case": "equal", "target": target, "draft": draft, "servers": servers.endpoints, "n": 8,
                 "prompts": ["def fibonacci(n):", "The capital of France is"]})
    assert out["devices"] == servers.endpoints and out["draft_devices"] == []  # the draft stayed local
    assert out["drafted"] > 0 and set(out["lengths"]) == {8}
    for ok, why in out["rpc_vs_local"] + out["spec_vs_plain"]:
        assert ok, why


@needs_rpc
def test_draft_on_its_own_server(servers, tiny_model):
    out = child({"case": "draft_on_rpc", "target": str(tiny_model("llama")), "draft": str(tiny_model("llama-draft")),
                 "servers": servers.endpoints})
    assert out["target_devices"] == [] and out["draft_devices"] == servers.endpoints[1:]
    assert out["tokens"] == out["local_tokens"] and len(out["tokens"]) == 6


@needs_rpc
def test_server_killed_mid_run_fails_requests_cleanly(servers, tiny_model):
    out = child({"case": "kill", "target": str(tiny_model("llama")), "draft": str(tiny_model("llama-draft")),
                 "servers": servers.endpoints, "pid": servers.procs[1].pid}, timeout=180)
    gone = f"RPC server {servers.endpoints[1]} is gone"
    for reason, error, n in out["results"]:
        assert reason == "error" and error.startswith(gone) and "\n" not in error, (reason, error)
        assert 0 < n < 200  # what was generated before the crash was delivered
    assert gone in out["after"] and out["local_after"] == 3
    assert out["mem"] == [[-1, -1], [-1, -1]]


@needs_rpc
def test_server_that_stops_answering_times_out(servers, tiny_model):
    """SIGSTOP: the connection stays up and nothing comes back; LLAMASPEC_RPC_TIMEOUT bounds the wait."""
    case = {"case": "kill", "signal": "SIGSTOP", "target": str(tiny_model("llama")), "draft": str(tiny_model("llama-draft")),
            "servers": servers.endpoints, "pid": servers.procs[0].pid}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(case)], capture_output=True, text=True, timeout=120,
                       env=child_env(RPC_LIB, LLAMASPEC_RPC_TIMEOUT="3"), cwd=str(REPO))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, p.stderr[-3000:]
    out = json.loads(lines[-1][7:])
    for reason, error, n in out["results"]:
        assert reason == "error" and "no reply from the RPC servers within 3 s" in error, error
    assert out["seconds"] < 60 and out["local_after"] == 3


@needs_rpc
def test_cli_unreachable_server_one_line(tiny_model):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "generate", "x", "-m", str(tiny_model("llama")), "-n", "2",
                        "--rpc", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60,
                       env=child_env(RPC_LIB), cwd=str(REPO))
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"error: RPC server 127.0.0.1:{port} is unreachable")
    assert "Traceback" not in p.stderr


@needs_rpc
def test_version_mismatch_ours_and_ggmls(fake):
    s = fake(_hello_reply(rpc.PROTO_MAJOR + 1, 0, 0))
    out = child({"case": "ggml_handshake", "endpoint": s.endpoint}, timeout=60)
    # ggml logs "RPC server version mismatch" and aborts ("RPC handshake failed"): the abort is caught
    assert out["error"] and "handshake failed" in out["error"], out


@needs_rpc
def test_probe_reports_devices_and_curve(servers, tiny_model):
    p = subprocess.run([sys.executable, "-m", "llamaspec.cli.main", "probe", str(tiny_model("llama")), "--json",
                        "--rpc", ",".join(servers.endpoints), "-ts", "1,1", "-t", "1"],
                       capture_output=True, text=True, timeout=180, env=child_env(RPC_LIB), cwd=str(REPO))
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert [e["endpoint"] for e in d["rpc"]] == servers.endpoints
    assert all(e["memory_total"] > 0 and e["models"] == ["target"] for e in d["rpc"])
    assert d["target"]["verify_cost_ms"] and all(v > 0 for v in d["target"]["verify_cost_ms"].values())
