#!/usr/bin/env python
"""How much of the trace benchmark's ``n4`` choices a drafter could predict, from a choice's own text and from
its sibling choices' (no timing: what the text allows, not what a policy gets).

The ``n4`` steps of ``benchmarks/trace_sessions.py`` (one prompt, four sampled choices, their seeds and
temperature) run through one Engine (top_k 40, top_p 0.95, as the trace's requests). For every position of
every choice, the drafter guess is the token that followed the latest earlier occurrence of the last
``--order`` tokens: first in the choice's own prompt + text so far, then (``siblings``) in the other choices'
texts up to the same position (they are generated together). Printed: the share of positions guessed right
under each source, and the common prefix of each pair of choices.

    python scripts/n4_overlap.py gemma3-270m-f32 [--order 3] [-n 64]
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def guess(texts: list[list[int]], ctx: tuple[int, ...]) -> int | None:
    """The token after the latest occurrence of ``ctx`` in the first text that has one followed by a token."""
    k = len(ctx)
    for seq in texts:
        for p in range(len(seq) - k - 1, -1, -1):
            if tuple(seq[p:p + k]) == ctx:
                return seq[p + k]
    return None


def hit_rates(prompt: list[int], outs: list[list[int]], order: int) -> dict[str, tuple[int, int]]:
    """``{"own": (right, positions), "siblings": (...)}`` over every choice."""
    res = {}
    for mode in ("own", "siblings"):
        right = n = 0
        for j, out in enumerate(outs):
            for i in range(order, len(out)):
                texts = [prompt + out[:i]]
                if mode == "siblings":
                    texts += [o[:i] for k, o in enumerate(outs) if k != j]
                n += 1
                right += guess(texts, tuple(out[i - order:i])) == out[i]
        res[mode] = (right, n)
    return res


def main(argv: list[str] | None = None) -> int:
    from llamaspec import _llama as llama
    from benchmarks.trace_sessions import TRACES
    from llamaspec.cli._common import resolve_model_arg
    from llamaspec.engine import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--order", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args(argv)
    eng = Engine(resolve_model_arg(args.model, None), n_ctx=4096, n_parallel=4)
    eng.start()
    try:
        def ask(step) -> list[str]:
            prompt = eng.tokenize(step.prompts[0], add_special=True, parse_special=True)
            reqs = [eng.submit(eng.tokenize(p, add_special=True, parse_special=True), n_predict=args.n_predict,
                               sampling=llama.SamplingParams(temp=step.temp, top_k=40, top_p=0.95, seed=seed))
                    for p, seed in zip(step.prompts, step.seeds)]
            outs = [r.result().tokens for r in reqs]
            rates = hit_rates(prompt, outs, args.order)
            lcp = [next((k for k, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
                   for x, y in itertools.combinations(outs, 2)]
            print(f"{step.prompts[0][-60:]!r}")
            for mode, (right, n) in rates.items():
                print(f"  order {args.order}, {mode:8s}: {right}/{n} next tokens guessed ({right / n:.0%})")
            print(f"  common prefix of each pair of choices (tokens): {lcp}")
            return [r.text for r in reqs]

        TRACES["n4"](args.turns, ask)
    finally:
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
