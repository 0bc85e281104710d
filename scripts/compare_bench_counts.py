#!/usr/bin/env python3
"""Compare the token and acceptance counts of two ``llamaspec bench --json`` reports (a refactor's check).

    llamaspec bench --quick --json before.json      # on the old commit
    llamaspec bench --quick --json after.json       # on the new one
    python scripts/compare_bench_counts.py before.json after.json

Every run of the first report (engine, mode, prompt, repeat) must be in the second with the same
``n_predicted``, ``n_drafted``, ``n_accepted``, ``n_verif_steps`` and ``accepted_per_pos`` (timings are not
compared). Runs only in the second report (e.g. native engines built since) are listed, not counted as
differences. Exit status 1 when anything differs.
"""
from __future__ import annotations

import json
import sys

FIELDS = ("n_predicted", "n_drafted", "n_accepted", "n_verif_steps", "accepted_per_pos")


def runs(report: dict) -> dict:
    return {(r.get("engine"), r.get("mode"), r.get("prompt_id"), r.get("repeat")): r for r in report.get("runs", [])}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        print("usage: compare_bench_counts.py BEFORE.json AFTER.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        before = runs(json.load(f))
    with open(argv[1], encoding="utf-8") as f:
        after = runs(json.load(f))
    diffs = 0
    for key, a in before.items():
        b = after.get(key)
        if b is None:
            print("missing in the second report:", key)
            diffs += 1
            continue
        for field in FIELDS:
            if a.get(field) != b.get(field):
                print(f"differs: {key} {field}: {a.get(field)!r} -> {b.get(field)!r}")
                diffs += 1
    extra = sorted(set(after) - set(before), key=str)
    if extra:
        print(f"{len(extra)} runs only in the second report (not compared)")
    print(f"{len(before)} runs compared on {', '.join(FIELDS)}: {diffs} differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
