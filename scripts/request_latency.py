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
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    from llamaspec.bench.native import find_tool
    from llamaspec.bench.server_mode import HttpServer
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
    servers = [
        HttpServer("llamaspec serve", lambda port: [sys.executable, "-m", "llamaspec.cli.main", "serve", *common,
                                                    "--spec-type", "none", "--port", str(port)], tmp.name),
        HttpServer("llama-server", lambda port: [str(server), *common, "--no-webui", "--cache-ram", "0",
                                                 "--port", str(port)], tmp.name)]
    try:
        for srv in servers:
            srv.start()
        conns = {srv.label: srv.connect() for srv in servers}
        prompt = [(7 * i) % 60 + 3 for i in range(40)]

        def call(srv: HttpServer, n: int) -> float:
            t = time.perf_counter()
            data = srv.complete(prompt, n, 42, conns[srv.label])
            dt = time.perf_counter() - t
            if data.get("tokens_predicted") != n:  # (the tiny model never stops early here)
                raise SystemExit(f"{srv.label}: {data.get('tokens_predicted')} tokens, not {n}")
            return dt

        times = {srv.label: {1: [], 64: []} for srv in servers}
        for srv in servers:  # warm-up, not recorded
            call(srv, 64)
        for rep in range(args.reps):
            for srv in (servers if rep % 2 == 0 else servers[::-1]):
                for n in (1, 64):
                    times[srv.label][n].append(call(srv, n))
        for label, t in times.items():
            one, many = statistics.median(t[1]) * 1e3, statistics.median(t[64]) * 1e3
            print(f"{label:16s} 1 token {one:.3f} ms, 64 tokens {many:.3f} ms, per token {(many - one) / 63 * 1e3:.1f} us, "
                  f"64-token tokens/s {64e3 / many:.0f}")
    finally:
        for srv in servers:
            srv.stop()
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
