#!/usr/bin/env python
"""Per-request and per-token latency of ``llamaspec serve`` against ``llama-server`` on a tiny random model.

Both servers run on the same tiny llama (``llamaspec.testing.tiny_models``, written to a temporary folder)
with the same flags (one thread, ``-np``). One client sends, on one keep-alive connection per server,
a greedy ``/completion`` of 1 token and one of 64 tokens from a 40-token prompt, alternating the servers
(A B, then B A) for ``--reps`` rounds. Printed per server: the median latency of each, their difference per
generated token (the loop's cost per token) and the 1-token latency (the fixed cost of a request: HTTP,
parsing, submitting, rendering, plus the prompt).

    python scripts/request_latency.py [--reps 150] [-np 8] [--native-dir native]
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited at start-up: {' '.join(cmd)}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            r = c.getresponse()
            r.read()
            if r.status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"{cmd[0]} did not become ready")


def main(argv: list[str] | None = None) -> int:
    from llamaspec.bench.native import find_tool, free_port
    from llamaspec.testing.tiny_models import write_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=150)
    ap.add_argument("-np", "--parallel", type=int, default=8)
    ap.add_argument("--native-dir", default=None)
    args = ap.parse_args(argv)
    server = find_tool("llama-server", args.native_dir)
    if server is None:
        raise SystemExit("llama-server is not built (scripts/build_llama_cpp.sh --targets tools)")
    tmp = tempfile.TemporaryDirectory(prefix="llamaspec-latency-")
    model = str(write_model("llama", Path(tmp.name) / "llama.gguf"))
    common = ["-m", model, "-c", "2048", "-b", "512", "-np", str(args.parallel), "--temp", "0", "--seed", "42",
              "-t", "1", "-tb", "1", "-ngl", "0", "--host", "127.0.0.1"]
    ports = {"llamaspec serve": free_port(), "llama-server": free_port()}
    cmds = {"llamaspec serve": [sys.executable, "-m", "llamaspec.cli.main", "serve", *common, "--spec-type", "none",
                                "--port", str(ports["llamaspec serve"])],
            "llama-server": [str(server), *common, "--no-webui", "--cache-ram", "0", "--port", str(ports["llama-server"])]}
    procs = {k: _start(c, ports[k]) for k, c in cmds.items()}
    try:
        conns = {k: http.client.HTTPConnection("127.0.0.1", p) for k, p in ports.items()}
        prompt = [(7 * i) % 60 + 3 for i in range(40)]

        def call(k: str, n: int) -> float:
            body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "seed": 42,
                               "cache_prompt": False}).encode()
            t = time.perf_counter()
            conns[k].request("POST", "/completion", body, {"Content-Type": "application/json"})
            r = conns[k].getresponse()
            data = json.loads(r.read())
            if r.status != 200 or data.get("tokens_predicted") != n:  # (the tiny model never stops early here)
                raise SystemExit(f"{k}: unexpected answer {r.status}: {str(data)[:200]}")
            return time.perf_counter() - t

        times = {k: {1: [], 64: []} for k in ports}
        names = list(ports)
        for k in names:  # warm-up, not recorded
            call(k, 64)
        for rep in range(args.reps):
            for k in (names if rep % 2 == 0 else names[::-1]):
                for n in (1, 64):
                    times[k][n].append(call(k, n))
        for k, t in times.items():
            one, many = statistics.median(t[1]) * 1e3, statistics.median(t[64]) * 1e3
            print(f"{k:16s} 1 token {one:.3f} ms, 64 tokens {many:.3f} ms, per token {(many - one) / 63 * 1e3:.1f} us, "
                  f"64-token tokens/s {64e3 / many:.0f}")
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(timeout=20)
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
