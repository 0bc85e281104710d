#!/usr/bin/env python
"""The trace benchmark (issue 25) is ``python -m benchmarks.research --trace`` now; this wrapper forwards its arguments:

    python scripts/bench_trace.py -m gemma3-270m-f32 --repeats 3 --json out.json --markdown out.md
    # = python -m benchmarks.research --trace -m gemma3-270m-f32 --repeats 3 --json out.json --markdown out.md

(the code: benchmarks/trace.py, trace_sessions.py, trace_report.py; ``--servers`` is ``--trace-variants``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.research import command  # noqa: E402

if __name__ == "__main__":
    sys.exit(command()(["--trace", *sys.argv[1:]], prog_name="scripts/bench_trace.py"))
