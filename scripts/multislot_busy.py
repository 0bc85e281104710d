"""The engine's defaults against plain decoding with several slots busy, in one process (issue 33: "llamaspec serve
at 4 and 8 clients"), without HTTP: what the referee decides per batch size, and what it costs.

    python scripts/multislot_busy.py [--load 1] [--slots 4,8] [-n 64] [--repeats 2] [--limit 8]

Two engines are loaded (Gemma-3-270M F32: with its Q4_K_M draft and the CLI's defaults, and plain), and each
round of the run gives every engine the same ``--limit`` prompts at once on ``--slots`` slots, engines alternating;
N busy-loop processes run beside the whole run. Prints aggregate generated tokens per second per engine and the
referee's per-batch-size record after each run (``Referee.info``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=1)
    ap.add_argument("--slots", default="4,8")
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--quiet-referee", action="store_true", help="do not print the referee's record")
    args = ap.parse_args()

    from llamaspec import models
    from llamaspec.bench.load import BackgroundLoad, LoadSpec
    from llamaspec.bench.prompts import load_prompts
    from llamaspec.cli.spec_options import build_spec_params
    from llamaspec.engine import Engine
    from llamaspec.params import SpecParams

    tgt, dft = str(models.resolve_model("gemma3-270m-f32")), str(models.resolve_model("gemma3-270m-q4km"))
    spec, _, _ = build_spec_params(draft_model=dft, spec_type=(), spec_default=False, spec_draft_n_max=None,
                                   spec_draft_n_min=None, spec_draft_p_min=None, spec_synth_len=None,
                                   spec_synth_rates=None, verify="match")
    prompts = [p.text for p in load_prompts()][:args.limit]
    while len(prompts) < args.limit:
        prompts = prompts + prompts[:args.limit - len(prompts)]
    results: dict[tuple[str, int], list[float]] = {}
    with BackgroundLoad(LoadSpec(busy=args.load)):
        for n_slots in [int(s) for s in args.slots.split(",")]:
            engines = {"defaults": Engine(tgt, draft=dft, spec=spec, n_parallel=n_slots, n_ctx=512 * n_slots),
                       "plain": Engine(tgt, spec=SpecParams(), n_parallel=n_slots, n_ctx=512 * n_slots)}
            try:
                for eng in engines.values():  # warm-up: one short request
                    eng.generate_many(prompts[:n_slots], n_predict=4)
                for rep in range(args.repeats):
                    for name, eng in engines.items():
                        t0 = time.perf_counter()
                        res = eng.generate_many(prompts, n_predict=args.n)
                        dt = time.perf_counter() - t0
                        n = sum(len(r.tokens) for r in res)
                        results.setdefault((name, n_slots), []).append(n / dt)
                        print(f"slots {n_slots} rep {rep} {name:8s} {n / dt:6.1f} tok/s ({n} tokens, {dt:.1f} s)",
                              flush=True)
                        if eng.referee is not None and not args.quiet_referee:
                            print("   ", json.dumps(eng.referee.info()), flush=True)
            finally:
                for eng in engines.values():
                    eng.close()
    print()
    for n_slots in sorted({k[1] for k in results}):
        d, p = statistics.median(results["defaults", n_slots]), statistics.median(results["plain", n_slots])
        print(f"slots {n_slots}: defaults {d:.1f} plain {p:.1f} tok/s  ratio {d / p:.2f}")


if __name__ == "__main__":
    main()
