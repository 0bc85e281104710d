"""Adaptive draft length against fixed n_max, interleaved in one process (A B B A per prompt).

    python scripts/bench_adaptive.py                       # Gemma-3-270M F32 + Q4_K_M, n_max 8, greedy
    python scripts/bench_adaptive.py --pair smollm2-135m --n-max 6 -n 128 --repeats 3

Prints decode tokens/s per mode and prompt, the median ratio adaptive / fixed, and whether the greedy outputs
are identical. Both modes use the default fast path (draft-KV reuse); --parity measures llama.cpp's behaviour.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec.bench.prompts import load_prompts  # noqa: E402
from llamaspec.engine import Engine  # noqa: E402
from llamaspec.params import SpecParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="gemma3-270m")
    ap.add_argument("--n-max", type=int, default=8)
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=6, help="how many of the bench prompts (mixed kinds)")
    ap.add_argument("--parity", action="store_true")
    args = ap.parse_args()

    from llamaspec.models import load_registry, resolve_model

    pair = load_registry().pair(args.pair)
    target, draft = resolve_model(pair.target), resolve_model(pair.draft)
    prompts = load_prompts()[: args.prompts]
    engines = {}
    for mode in ("fixed", "adaptive"):
        sp = SpecParams()
        sp.draft.n_max = args.n_max
        sp.parity = args.parity
        sp.draft_adaptive = mode == "adaptive"
        engines[mode] = Engine(target, draft=draft, spec=sp, n_ctx=2048)
    tps: dict[str, list[float]] = {"fixed": [], "adaptive": []}
    same = 0
    try:
        for p in prompts:
            toks = {}
            for r in range(args.repeats):
                for mode in (("fixed", "adaptive") if r % 2 == 0 else ("adaptive", "fixed")):
                    res = engines[mode].generate(p.text, n_predict=args.n_predict)
                    tps[mode].append(res.stats.decode_tokens_per_second)
                    toks[mode] = res.tokens
                    print(f"{p.id:28s} {mode:8s} {res.stats.decode_tokens_per_second:6.1f} tok/s  acceptance "
                          f"{res.stats.acceptance_rate:.3f}  mean len {res.stats.mean_accepted_length:.2f}", flush=True)
            same += toks["fixed"] == toks["adaptive"]
    finally:
        for e in engines.values():
            e.close()
    ratios = [a / f for a, f in zip(tps["adaptive"], tps["fixed"]) if f > 0]
    print(f"median tok/s: fixed {statistics.median(tps['fixed']):.1f}, adaptive {statistics.median(tps['adaptive']):.1f}; "
          f"adaptive / fixed: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"identical outputs on {same}/{len(prompts)} prompts")


if __name__ == "__main__":
    main()
