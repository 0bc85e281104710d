#!/usr/bin/env python
"""Trace benchmark (issue 25): multi-turn sessions against llamaspec serve (pool on / off) and llama-server
--spec-default over HTTP, tokens/s per trace (the code and the traces: llamaspec/bench/trace.py).

    python scripts/bench_trace.py -m gemma3-270m-f32 --repeats 2 \
        --json docs/benchmarks/trace.json --markdown docs/benchmarks/trace.md
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec.bench.trace import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
