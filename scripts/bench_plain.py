#!/usr/bin/env python3
"""Plain greedy generation: llamaspec's engine vs llama-cpp-python's ``Llama``, same model, same prompt.

Runs are interleaved (A B A B ...) in one process so that machine noise hits both alike; the report gives
the median decode tokens/s of each, their ratio, and whether the token streams were identical.

    python scripts/bench_plain.py -m gemma3-270m-f32 -n 256 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default="gemma3-270m-f32")
    ap.add_argument("-p", "--prompt", default="def fibonacci(n):")
    ap.add_argument("-n", "--n-predict", type=int, default=256)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    from llama_cpp import Llama

    from llamaspec import _llama as llama
    from llamaspec.engine import Engine
    from llamaspec.models import resolve_model

    path = str(resolve_model(a.model))
    threads = a.threads or llama.default_threads()
    eng = Engine(path, n_ctx=a.ctx_size, n_threads=threads)
    llm = Llama(path, n_ctx=a.ctx_size, n_threads=threads, n_threads_batch=threads, verbose=False)
    toks = eng.tokenize(a.prompt)

    def run_llamaspec():
        r = eng.generate(toks, n_predict=a.n_predict)
        return r.tokens, r.stats.decode_tokens_per_second

    def run_llama():
        llm.reset()
        out, t_first = [], None
        for t in llm.generate(toks, temp=0.0, top_k=1, reset=True):
            if t_first is None:
                t_first = time.perf_counter()
            if llm.token_eos() == t:
                break
            out.append(t)
            if len(out) == a.n_predict:
                break
        dt = time.perf_counter() - t_first
        return out, (len(out) - 1) / dt if dt > 0 else 0.0

    res = {"llamaspec": [], "llama-cpp-python": []}
    streams = {}
    run_llamaspec(), run_llama()  # warm-up
    for i in range(a.repeats):
        for name, fn in (("llamaspec", run_llamaspec), ("llama-cpp-python", run_llama)):
            tokens, tps = fn()
            res[name].append(tps)
            streams[name] = tokens
            print(f"repeat {i + 1}/{a.repeats} {name:17s} {tps:8.2f} tok/s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {
        "model": a.model, "prompt": a.prompt, "n_predict": a.n_predict, "threads": threads, "repeats": a.repeats,
        "decode_tokens_per_second": {k: {"median": round(med[k], 3), "min": round(min(v), 3), "max": round(max(v), 3)}
                                     for k, v in res.items()},
        "ratio_llamaspec_over_llama_cpp_python": round(med["llamaspec"] / med["llama-cpp-python"], 4),
        "identical_tokens": streams["llamaspec"] == streams["llama-cpp-python"],
        "n_tokens": len(streams["llamaspec"]),
    }
    print(json.dumps(out, indent=2))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=2)
    eng.close()
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
