"""Recovery after a load stops (issue 33): how many rounds until speculation is back to its quiet-machine rate.

    python scripts/recovery.py [--load 2] [--rounds-loaded 96] [-n 1024]

One Engine with the defaults (Gemma-3-270M F32 + its Q4_K_M draft) generates a long text; N busy-loop processes
run beside it for the first ``--rounds-loaded`` rounds and are then stopped. Every round's tokens and time are
kept. The quiet rate is the median tokens/s of 8-round windows over the last third of the run; the recovery is the
first round after the stop from which the 8-round window reaches 90% of it. The referee's state and the target's
thread choice are printed around the stop.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=2)
    ap.add_argument("--rounds-loaded", type=int, default=96)
    ap.add_argument("-n", type=int, default=1024)
    ap.add_argument("--prompt", default="Write a long, detailed tutorial on binary search trees in Python, with code.")
    args = ap.parse_args()

    from llamaspec import models
    from llamaspec.engine import Engine

    tgt, dft = models.resolve_model("gemma3-270m-f32"), models.resolve_model("gemma3-270m-q4km")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    rounds: list[tuple[float, int, str, int]] = []  # (t, tokens, referee state, target threads at 1 row)
    with Engine(str(tgt), draft=str(dft), n_ctx=2048) as eng:
        last = [time.perf_counter()]

        def on_chunk(ch) -> None:
            nonlocal busy
            now = time.perf_counter()
            thr = eng.ctx.threads.choice(1) if eng.ctx.threads is not None else 0
            rounds.append((now - last[0], len(ch.tokens), eng.referee.state if eng.referee else "-", thr))
            last[0] = now
            if busy and len(rounds) == args.rounds_loaded:
                for p in busy:
                    p.terminate()
                for p in busy:
                    p.wait()
                busy = []

        try:
            eng.generate(args.prompt, n_predict=args.n, on_chunk=on_chunk)
        finally:
            for p in busy:
                p.kill()
    stop = args.rounds_loaded
    win = 8
    rate = [sum(n for _, n, _, _ in rounds[i:i + win]) / sum(t for t, _, _, _ in rounds[i:i + win])
            for i in range(len(rounds) - win + 1)]
    tail = rate[len(rate) * 2 // 3:]
    quiet = statistics.median(tail) if tail else 0.0
    loaded = statistics.median(rate[: max(stop - win, 1)]) if stop > win else 0.0
    back = next((i - stop for i in range(stop, len(rate)) if rate[i] >= 0.9 * quiet), None)
    print(f"rounds {len(rounds)}; tokens/s under load (8-round windows, median) {loaded:.1f}, quiet {quiet:.1f}")
    print(f"back to 90% of the quiet rate {back} rounds after the load stopped" if back is not None else
          "never back to 90% of the quiet rate")
    for i in range(max(0, stop - 4), min(len(rounds), stop + 40)):
        t, n, st, thr = rounds[i]
        print(f"  round {i - stop:+4d}: {n} tokens in {t * 1e3:6.1f} ms, referee {st}, target threads {thr}")


if __name__ == "__main__":
    main()
