"""Cost of one rejection-sampling verification against the target decode of the same rows.

    python scripts/bench_rejection_cost.py                       # Gemma-3-270M F32 + Q4_K_M, temp 0.8
    python scripts/bench_rejection_cost.py --penalty 1.1 --grammar-digits

Every round's target decode (``[sampled] + draft``, d+1 rows) and the verification that follows it are
timed separately; the report gives medians over all rounds where rejection sampling ran (rounds verified by
sample-and-match, e.g. without a draft, are left out), and the ratio verify / decode.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llamaspec import _llama as llama  # noqa: E402
from llamaspec.engine import Engine  # noqa: E402
from llamaspec.params import SpecParams  # noqa: E402
from llamaspec.verify import verifiers  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The three primary colors are",
    "Write a short story about a robot who learns to paint.",
    "List five uses of a paperclip:",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="gemma3-270m")
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--n-max", type=int, default=4)
    ap.add_argument("--temp", type=float, default=0.8)
    ap.add_argument("--penalty", type=float, default=1.0)
    args = ap.parse_args()

    from llamaspec.models import load_registry, resolve_model

    pair = load_registry().pair(args.pair)
    target, draft = resolve_model(pair.target), resolve_model(pair.draft)
    decode_ms: list[float] = []
    verify_ms: list[float] = []
    rows: list[int] = []
    last_decode = [0.0]
    real_decode = llama.Context.decode
    real_verify = verifiers.RejectionVerifier.verify

    def timed_decode(self, batch, **kw):
        t0 = time.perf_counter()
        try:
            return real_decode(self, batch, **kw)
        finally:
            last_decode[0] = (time.perf_counter() - t0) * 1e3

    def timed_verify(self, idx, draft_tokens, p_dft=None):
        t0 = time.perf_counter()
        out = real_verify(self, idx, draft_tokens, p_dft)
        if self._last_rule == "rejection":
            verify_ms.append((time.perf_counter() - t0) * 1e3)
            decode_ms.append(last_decode[0])
            rows.append(len(idx))
        return out

    llama.Context.decode = timed_decode
    verifiers.RejectionVerifier.verify = timed_verify
    sp = SpecParams()
    sp.draft.n_max = args.n_max
    with Engine(target, draft=draft, spec=sp, verify="rejection", n_ctx=2048) as eng:
        for i, p in enumerate(PROMPTS):
            eng.generate(p, n_predict=args.n_predict,
                         sampling=llama.SamplingParams(temp=args.temp, seed=i, repeat_penalty=args.penalty))
    llama.Context.decode = real_decode
    verifiers.RejectionVerifier.verify = real_verify
    if not verify_ms:
        print("no round was verified by rejection sampling")
        return
    v, d = statistics.median(verify_ms), statistics.median(decode_ms)
    ratios = [a / b for a, b in zip(verify_ms, decode_ms) if b > 0]
    print(f"{len(verify_ms)} rejection rounds, median {statistics.median(rows):.0f} rows "
          f"(target {Path(target).name}, temp {args.temp}, repeat penalty {args.penalty})")
    print(f"verify: median {v:.2f} ms (max {max(verify_ms):.2f}); target decode of the same rows: median {d:.2f} ms")
    print(f"verify / decode: median {statistics.median(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
