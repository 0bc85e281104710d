#!/usr/bin/env python
"""The trace benchmark (issue 25) is ``llamaspec bench --trace`` now; this wrapper forwards its arguments:

    python scripts/bench_trace.py -m gemma3-270m-f32 --repeats 3 --json out.json --markdown out.md
    # = llamaspec bench --trace -m gemma3-270m-f32 --repeats 3 --json out.json --markdown out.md

(the code: llamaspec/bench/trace.py, trace_sessions.py, trace_report.py; ``--servers`` is ``--trace-variants``).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "--trace", *sys.argv[1:]]))
