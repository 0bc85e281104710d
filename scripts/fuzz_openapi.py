"""A long Schemathesis run against ``llamaspec serve`` (tests/test_schemathesis.py runs it bounded).

    python scripts/fuzz_openapi.py                         # 10 minutes, a random seed (printed)
    python scripts/fuzz_openapi.py -t 3600 --seed 1234     # an hour, reproducibly
    python scripts/fuzz_openapi.py -t 120 --operations /chat -v          # the chat routes, every request shown
    python scripts/fuzz_openapi.py --url http://127.0.0.1:8080 --api-key K    # a server already running

It starts ``llamaspec serve`` on 127.0.0.1 (tiny models with FIM tokens, a draft, 2 slots, an API key,
``--metrics --props --slot-save-path``, small ``--max-*`` limits: tests/support/openapi_fuzz.py), loads
the server's live ``/openapi.json`` and sends to every operation Schemathesis's coverage cases (boundary
values, every wrong type, missing fields, unexpected methods; once) and then, pass after pass with a new seed
until the time is up, ``-n`` Hypothesis cases per operation that fit its schema and ``-n`` that violate it,
with random extra headers, content types and wrong keys, while ``/health`` is polled every second. Every
answer goes through Schemathesis's checks (no 5xx, documented statuses, content types and bodies, negative
data refused, 405 for unknown methods).

It prints the requests (``-v``: each one), the answers by status code and operation, the failed checks with
a curl command to replay each, and the count of answers >= 500; it exits 1 on any 5xx, failed check,
transport error, /health answer other than 200, a server that died or that did not exit 0 on SIGTERM.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # tests/support: the fuzzer and the server process (not shipped)

from support.openapi_fuzz import KEY, Report, fuzz, server_args  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-t", "--seconds", type=float, default=600.0, help="how long to fuzz (default 600)")
    ap.add_argument("-n", "--examples", type=int, default=100,
                    help="Hypothesis cases per operation and mode in each pass (default 100)")
    ap.add_argument("--coverage-limit", type=int, default=None,
                    help="coverage cases per operation (default: all of them; 0: none)")
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed of the first pass (default: random)")
    ap.add_argument("--operations", default="", help="only the paths that contain this text")
    ap.add_argument("--url", default=None, help="fuzz this server instead of starting one")
    ap.add_argument("--api-key", default=KEY, help="the API key of --url's server")
    ap.add_argument("--log", default="fuzz-openapi-server.log", help="the started server's log")
    ap.add_argument("--json", default=None, help="write the report here as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every request and its answer")
    args = ap.parse_args(argv)
    if args.examples < 1 or args.seconds <= 0:
        ap.error("--examples must be >= 1 and --seconds > 0")
    seed = random.randrange(1 << 31) if args.seed is None else args.seed
    if args.url:
        return _fuzz(args, args.url.rstrip("/"), seed, None)
    from support.load_run import ServerProcess

    with tempfile.TemporaryDirectory(prefix="llamaspec-fuzz-") as d:
        srv = ServerProcess(server_args(Path(d)), Path(args.log), ready_timeout=300)
        print(f"llamaspec serve {' '.join(srv.cmd[4:])}\nserver log: {args.log}", flush=True)
        try:
            rc = _fuzz(args, srv.url, seed, srv)
        finally:
            code = srv.terminate(60)
        if code != 0:
            print(f"FAILED: the server's SIGTERM exit was {code} (0 expected)\n{srv.tail()}")
            rc = 1
    return rc


def _fuzz(args: argparse.Namespace, url: str, seed: int, srv) -> int:
    log = print if args.verbose else None
    total = Report()
    deadline = time.monotonic() + args.seconds
    print(f"fuzzing {url} for {args.seconds:.0f} s, seed {seed}", flush=True)
    common = {"operations": args.operations, "key": args.api_key, "log": log}
    if args.coverage_limit != 0:
        rep = fuzz(url, modes=("coverage",), coverage_limit=args.coverage_limit, seconds=args.seconds, **common)
        print(f"--- coverage cases\n{rep.summary()}", flush=True)
        total.add(rep)
    n = 0
    while time.monotonic() < deadline - 1 and (srv is None or srv.proc.poll() is None):
        rep = fuzz(url, modes=("positive", "negative"), max_examples=args.examples, seed=seed + n,
                   seconds=deadline - time.monotonic(), **common)
        print(f"--- pass {n + 1} (seed {seed + n})\n{rep.summary()}", flush=True)
        total.add(rep)
        n += 1
    died = srv is not None and srv.proc.poll() is not None
    print(f"=== total ({n} passes, seed {seed})\n{total.summary()}")
    print(f"answers >= 500: {total.n_5xx}")
    if args.json:
        Path(args.json).write_text(json.dumps({**total.to_json(), "seed": seed, "passes": n}, indent=1, default=str))
    if died:
        print(f"FAILED: the server died (exit {srv.proc.returncode})\n{srv.tail()}")
    if not total.ok or died:
        print(f"FAILED; replay with: python scripts/fuzz_openapi.py --seed {seed} ...")
        return 1
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
