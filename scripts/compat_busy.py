"""``llamaspec.Llama`` with a draft against ``llama_cpp.Llama`` plain, interleaved, with N busy-loop processes
beside them (issue 33's third target; 0 = a quiet machine).

    python scripts/compat_busy.py [--load 1] [--repeats 2] [-n 96]

Both load Gemma-3-270M F32 with their defaults (llama_cpp.Llama: n_threads = cpus // 2, n_threads_batch = cpus;
llamaspec.Llama: threads chosen per decode), llamaspec.Llama with Gemma-3-270M Q4_K_M as ``draft_model``. Every
prompt runs on both back to back, in alternating order; greedy (temperature 0). Prints the wall time per call,
the ratio of the totals and whether the texts are equal. ``--draft-adapter`` adds a third: ``llama_cpp.Llama``
with ``llamaspec.DraftModel`` (the same Q4_K_M draft) in its own ``draft_model`` hook.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

PROMPTS = ["def fibonacci(n):", "Write a short story about a lighthouse keeper.",
           "List the planets of the solar system with one fact each.", "Explain how a hash map works."]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--load", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-n", type=int, default=96)
    ap.add_argument("--draft-adapter", action="store_true", help="also llama_cpp.Llama + llamaspec.DraftModel")
    args = ap.parse_args()

    import llama_cpp

    import llamaspec
    from llamaspec import models

    tgt, dft = str(models.resolve_model("gemma3-270m-f32")), str(models.resolve_model("gemma3-270m-q4km"))
    ref = llama_cpp.Llama(model_path=tgt, n_ctx=1024, verbose=False)
    ours = llamaspec.Llama(model_path=tgt, n_ctx=1024, draft_model=dft, verbose=False)
    llms = {"llama_cpp": ref, "llamaspec": ours}
    if args.draft_adapter:
        llms["DraftModel"] = llama_cpp.Llama(model_path=tgt, n_ctx=1024, verbose=False,
                                             draft_model=llamaspec.DraftModel(dft))
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    tot = {k: 0.0 for k in llms}
    same = {k: 0 for k in llms}
    try:
        for rep in range(args.repeats):
            for p in PROMPTS:
                order = list(llms.items())
                texts = {}
                for name, llm in (order if rep % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    out = llm.create_completion(p, max_tokens=args.n, temperature=0.0)
                    dt = time.perf_counter() - t0
                    tot[name] += dt
                    texts[name] = out["choices"][0]["text"]
                    print(f"{name:10} {dt:6.2f} s  {p[:40]!r}", flush=True)
                for k in llms:
                    same[k] += texts["llama_cpp"] == texts[k]
    finally:
        for b in busy:
            b.kill()
    n = args.repeats * len(PROMPTS)
    print(f"load {args.load} busy: llama_cpp.Llama plain {tot['llama_cpp']:.1f} s, llamaspec.Llama + draft "
          f"{tot['llamaspec']:.1f} s: x{tot['llama_cpp'] / tot['llamaspec']:.2f} of llama_cpp.Llama's speed; "
          f"texts equal {same['llamaspec']}/{n}")
    if "DraftModel" in tot:
        print(f"load {args.load} busy: llama_cpp.Llama + llamaspec.DraftModel {tot['DraftModel']:.1f} s: "
              f"x{tot['llama_cpp'] / tot['DraftModel']:.2f} of llama_cpp.Llama's speed; texts equal {same['DraftModel']}/{n}")


if __name__ == "__main__":
    main()
