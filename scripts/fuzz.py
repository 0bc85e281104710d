"""Long property-based fuzzing runs of the engine and the server (tests/test_fuzz_engine.py, tests/test_fuzz_threads.py,
tests/test_fuzz_server.py).

    python scripts/fuzz.py                        # both, 2000 examples each, a random seed
    python scripts/fuzz.py engine -n 20000        # the engine only, longer
    python scripts/fuzz.py server --seed 1234     # the server, reproducibly

The suite runs the same properties on a few dozen fixed examples; this runs them on ``-n`` random ones
(``LLAMASPEC_FUZZ_EXAMPLES``; the threaded engine property of tests/test_fuzz_threads.py, which builds an
engine per example, on ``-n``/10). Among them: clients that disconnect at random points (before the body,
while the prompt waits or is processed, mid-stream) and threads racing ``submit`` / ``cancel`` /
``Engine.close()``. The load & fault run against a real server process is ``scripts/load_faults.py``;
Schemathesis against a real server process, from its ``/openapi.json``, is ``scripts/fuzz_openapi.py``.

A failure prints Hypothesis's shrunk example and, to replay it exactly, ``--seed``; fix the bug, add a focused
regression test, and rerun with that seed.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = {"engine": ["tests/test_fuzz_engine.py", "tests/test_fuzz_threads.py"], "server": ["tests/test_fuzz_server.py"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="*", metavar="{engine,server}", help="what to fuzz (default: both)")
    ap.add_argument("-n", "--examples", type=int, default=2000, help="examples per property (default 2000)")
    ap.add_argument("--seed", type=int, default=None, help="Hypothesis seed (default: a random one, printed)")
    ap.add_argument("-x", "--exitfirst", action="store_true", help="stop at the first failing property")
    args = ap.parse_args(argv)
    bad = [w for w in args.which if w not in TESTS]
    if bad:
        ap.error(f"unknown target(s) {', '.join(bad)}: choose from {', '.join(TESTS)}")
    if args.examples < 1:
        ap.error("--examples must be >= 1")
    seed = random.randrange(1 << 31) if args.seed is None else args.seed
    files = [f for w in (args.which or list(TESTS)) for f in TESTS[w]]
    env = {**os.environ, "LLAMASPEC_FUZZ_EXAMPLES": str(args.examples)}
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "--timeout", "0",
           f"--hypothesis-seed={seed}", "--hypothesis-show-statistics", *(["-x"] if args.exitfirst else [])]
    print(f"fuzzing {', '.join(files)}: {args.examples} examples per property, seed {seed}", flush=True)
    rc = subprocess.call(cmd, cwd=ROOT, env=env)
    if rc:
        print(f"\nfailed; replay with: python scripts/fuzz.py {' '.join(args.which)} -n {args.examples} --seed {seed}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
