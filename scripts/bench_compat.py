#!/usr/bin/env python3
"""llama-cpp-python's ``Llama`` API four ways, greedy, same prompts, runs interleaved in one process:

* ``llama_cpp``             ``llama_cpp.Llama(target)``, no draft (the baseline)
* ``llama_cpp+lookup``      ``llama_cpp.Llama(target, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10))``
* ``llama_cpp+DraftModel``  ``llama_cpp.Llama(target, draft_model=llamaspec.DraftModel(draft))``
* ``llamaspec.Llama``       ``llamaspec.Llama(target, draft_model=draft)`` (llamaspec's engine, its defaults)

Each run is one ``llm(prompt, max_tokens=N, temperature=0)`` call; tokens/s = completion tokens / wall time of
the call (prompt included: the prompts are short and every variant keeps its prompt cache between repeats).
Every variant's text is compared with the baseline's. Order: for each repeat, for each prompt, the variants
in turn (rotated each repeat), so machine noise hits all alike; medians are reported.

    python scripts/bench_compat.py --pair gemma3-270m -n 128 --repeats 3 --json docs/benchmarks/compat.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(n: int) -> list[dict]:
    lines = (ROOT / "llamaspec" / "bench" / "prompts.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()][:n]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="gemma3-270m", help="a pair from models.toml")
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=3, help="how many of llamaspec/bench/prompts.jsonl")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)

    import llamaspec
    from llamaspec._llama.lcp import load_llama, prompt_lookup_decoding
    from llamaspec.models import resolve_pair

    target, draft = (str(p) for p in resolve_pair(a.pair))
    kw = dict(n_ctx=a.ctx_size, n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    dm = llamaspec.DraftModel(draft, n_threads=a.threads)
    variants = {
        "llama_cpp": load_llama(target, **kw),
        "llama_cpp+lookup": load_llama(target, draft_model=prompt_lookup_decoding(10), **kw),
        "llama_cpp+DraftModel": load_llama(target, draft_model=dm, **kw),
        "llamaspec.Llama": llamaspec.Llama(target, draft_model=draft, **kw),
    }
    ps = prompts(a.prompts)
    names = list(variants)
    tps: dict[str, list[float]] = {k: [] for k in names}
    texts: dict[tuple[str, str], str] = {}
    same: dict[str, list[bool]] = {k: [] for k in names}
    accept: list[float] = []
    for w in ps[:1]:  # warm-up: one short run each
        for k in names:
            variants[k](w["prompt"], max_tokens=8, temperature=0)
    for rep in range(a.repeats):
        order = names[rep % len(names):] + names[: rep % len(names)]
        for p in ps:
            for k in order:
                t0 = time.perf_counter()
                r = variants[k](p["prompt"], max_tokens=a.max_tokens, temperature=0)
                dt = time.perf_counter() - t0
                n = r["usage"]["completion_tokens"]
                tps[k].append(n / dt)
                texts.setdefault((k, p["id"]), r["choices"][0]["text"])
                if k == "llamaspec.Llama":
                    accept.append(r["llamaspec"]["acceptance_rate"])
                print(f"rep {rep} {p['id']:<24} {k:<22} {n:4d} tok {n / dt:7.2f} tok/s", file=sys.stderr, flush=True)
    for p in ps:
        base = texts[("llama_cpp", p["id"])]
        for k in names:
            same[k].append(texts[(k, p["id"])] == base)
    med = {k: statistics.median(v) for k, v in tps.items()}
    out = {"pair": a.pair, "target": Path(target).name, "draft": Path(draft).name, "max_tokens": a.max_tokens,
           "ctx_size": a.ctx_size, "threads": a.threads, "repeats": a.repeats, "prompts": [p["id"] for p in ps],
           "median_tokens_per_second": {k: round(v, 3) for k, v in med.items()},
           "speedup_vs_llama_cpp": {k: round(v / med["llama_cpp"], 3) for k, v in med.items()},
           "greedy_text_equal_to_llama_cpp": {k: v for k, v in same.items()},
           "draft_model_adapter": {"acceptance_rate": round(dm.acceptance_rate, 4), **dm.stats},
           "llamaspec_acceptance_rate_median": round(statistics.median(accept), 4) if accept else None,
           "runs_tokens_per_second": {k: [round(x, 3) for x in v] for k, v in tps.items()}}
    print(f"\n{'variant':<22} {'tok/s (median)':>15} {'x llama_cpp':>12}  greedy text == llama_cpp")
    for k in names:
        print(f"{k:<22} {med[k]:15.2f} {med[k] / med['llama_cpp']:12.2f}  {sum(same[k])}/{len(same[k])}")
    print(f"DraftModel adapter acceptance {dm.acceptance_rate:.3f}; llamaspec.Llama acceptance (median) "
          f"{out['llamaspec_acceptance_rate_median']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    for v in variants.values():
        v.close()
    dm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
