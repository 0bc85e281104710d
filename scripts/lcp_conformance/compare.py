"""Compare two runs of llama-cpp-python's tests (JSON reports written by lcp_local_models.py): the reference
(``llama_cpp.Llama``) and the candidate (``llamaspec.Llama``). Prints both counts, then every test whose outcome
differs, and the tests that fail in both (model-dependent ones from model_dependent.txt apart).
Exit status 1 when a test that passes with the reference does not pass with the candidate.

usage: python compare.py REFERENCE.json CANDIDATE.json [--labels A B]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))


def model_dependent() -> dict[str, str]:
    out = {}
    with open(os.path.join(HERE, "model_dependent.txt")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                nid, _, why = line.partition("#")
                out[nid.strip()] = why.strip()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("reference")
    ap.add_argument("candidate")
    ap.add_argument("--labels", nargs=2, default=("llama_cpp.Llama", "llamaspec.Llama"))
    a = ap.parse_args(argv)
    ref, cand = (json.load(open(p)) for p in (a.reference, a.candidate))
    known = model_dependent()
    la, lb = a.labels
    for label, rep in ((la, ref), (lb, cand)):
        c = Counter(v["outcome"] for v in rep.values())
        counted = sum(1 for k, v in rep.items() if v["outcome"] == "passed" and k not in known)
        print(f"{label:>18}: {c['passed']} passed, {c['failed'] + c['error']} failed, {c['skipped']} skipped "
              f"({counted} passed of the tests that count)")
    regress, gain, both, other = [], [], [], []
    for nid in sorted(set(ref) | set(cand)):
        r, c = ref.get(nid, {"outcome": "absent"}), cand.get(nid, {"outcome": "absent"})
        if r["outcome"] == "passed" and c["outcome"] != "passed":
            regress.append((nid, r, c))
        elif c["outcome"] == "passed" and r["outcome"] != "passed":
            gain.append((nid, r, c))
        elif r["outcome"] in ("failed", "error") and c["outcome"] in ("failed", "error"):
            both.append((nid, r, c))
        elif r["outcome"] != c["outcome"]:
            other.append((nid, r, c))
    print(f"\npass with {la}, not with {lb}: {len(regress)}")
    for nid, r, c in regress:
        print(f"  {nid}: {c['outcome']} at {c.get('where') or '?'}: {c.get('reason', '')}")
    if gain:
        print(f"\npass with {lb}, not with {la}: {len(gain)}")
        for nid, r, c in gain:
            print(f"  {nid}: {la} {r['outcome']} at {r.get('where') or '?'}: {r.get('reason', '')}")
    if other:
        print("\nother differences (skips):")
        for nid, r, c in other:
            print(f"  {nid}: {r['outcome']} -> {c['outcome']}: {c.get('reason') or r.get('reason', '')}")
    if both:
        print("\nfail with both:")
        for nid, r, c in both:
            same = "same line" if r.get("where") == c.get("where") else f"{lb} at {c.get('where')}"
            tag = f"model-dependent: {known[nid]}" if nid in known else "NOT in model_dependent.txt"
            print(f"  {nid}: at {r.get('where') or '?'} ({same}): {r.get('reason', '')}\n      [{tag}]")
    return 1 if regress else 0


if __name__ == "__main__":
    sys.exit(main())
