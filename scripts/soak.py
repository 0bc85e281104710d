"""Soak: many requests through one Engine; reports resident-memory growth (target: flat, under 20 MB).

    python scripts/soak.py --tiny -n 1000            # tiny random-weight llama + draft, 4 slots
    python scripts/soak.py --pair gemma3-270m -n 200 # the Gemma F32 target + Q4_K_M draft from models.toml

Requests mix greedy and sampled settings, stop strings, cancels (every 7th request is cancelled after its first
chunk) and, with --faults, a drafter that raises now and then (the request fails alone). RSS is read from
/proc/self/statm after a warm-up of 5% of the requests and at the end.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec import _llama as llama  # noqa: E402
from llamaspec.engine import Engine, FinishReason  # noqa: E402
from llamaspec.params import SpecParams  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--tiny", action="store_true", help="tiny random-weight llama target + draft")
    src.add_argument("--pair", help="a pair name from models.toml (e.g. gemma3-270m)")
    ap.add_argument("-n", "--requests", type=int, default=1000)
    ap.add_argument("-np", "--n-parallel", type=int, default=4)
    ap.add_argument("--n-predict", type=int, default=24)
    args = ap.parse_args()

    if args.tiny:
        from llamaspec.testing.tiny_models import make_all

        paths = make_all(Path(tempfile.mkdtemp(prefix="soak-")))
        target, draft = paths["llama"], paths["llama-draft"]
        prompts = [[random.Random(i).randrange(1, 64) for _ in range(4 + i % 20)] for i in range(50)]
    else:
        from llamaspec.models import load_registry, resolve_model

        pair = load_registry().pair(args.pair)
        target, draft = resolve_model(pair.target), resolve_model(pair.draft)
        prompts = [f"Question {i}: explain, step by step, how a {w} works." for i, w in
                   enumerate(["bicycle", "compiler", "river delta", "heat pump", "database index"] * 10)]
    spec = SpecParams()
    spec.draft.n_max = 4
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    with Engine(target, draft=draft, spec=spec, n_ctx=1024 if args.tiny else 2048, n_parallel=args.n_parallel) as eng:
        warm = max(1, args.requests // 20)
        base = None
        done = 0
        while done < args.requests:
            batch = []
            for _ in range(min(args.n_parallel * 2, args.requests - done)):
                i = done + len(batch)
                sp = llama.SamplingParams(temp=0.0) if i % 2 == 0 else llama.SamplingParams(temp=0.8, seed=i)
                batch.append(eng.submit(prompts[i % len(prompts)], n_predict=args.n_predict, sampling=sp,
                                        stop=["\n\n"] if i % 3 == 0 else ()))
            for j, r in enumerate(batch):
                if (done + j) % 7 == 6:
                    next(iter(r), None)
                    r.cancel()
            for r in batch:
                res = r.result()
                counts[res.finish_reason.value] = counts.get(res.finish_reason.value, 0) + 1
            done += len(batch)
            if base is None and done >= warm:
                gc.collect()
                base = rss_mb()
                print(f"after {done} requests (warm-up): RSS {base:.1f} MB", flush=True)
        gc.collect()
        end = rss_mb()
        assert all(s.state.value in ("idle", "done") for s in eng.slots)
    dt = time.perf_counter() - t0
    print(f"{args.requests} requests in {dt:.1f} s; finish reasons {counts}")
    print(f"RSS after warm-up {base:.1f} MB, at the end {end:.1f} MB: growth {end - base:+.1f} MB")
    assert FinishReason.ABORT.value in counts


if __name__ == "__main__":
    main()
