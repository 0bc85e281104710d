#!/usr/bin/env python3
"""Draft-KV reuse (--spec-draft-reuse-kv) vs llama.cpp's re-decode on the Gemma pair, interleaved, one process:

    python scripts/bench_reuse_kv.py
"""
import statistics

from llamaspec.engine import Engine
from llamaspec.params import SpecParams
from llamaspec.models import resolve_model
t=str(resolve_model("gemma3-270m-f32")); d=str(resolve_model("gemma3-270m-q4km"))
engines={}
for reuse in (False, True):
    sp=SpecParams(); sp.draft.n_max=8; sp.draft.reuse_kv=reuse
    engines[reuse]=Engine(t, draft=d, spec=sp, n_ctx=1024)
prompts=["Write a Python class for a binary search tree with insert, delete and search methods.\n\nclass BinarySearchTree:", "Explain in a few paragraphs how rivers shape the landscape over thousands of years."]
res={False:[],True:[]}; toks={}
for rep in range(2):
    for reuse in ((False,True) if rep%2==0 else (True,False)):
        e=engines[reuse]
        for p in prompts:
            r=e.generate(e.tokenize(p), n_predict=128)
            res[reuse].append((r.stats.decode_tokens_per_second, r.stats.n_drafted, r.stats.n_accepted))
            toks.setdefault((reuse,p),r.tokens)
for k,v in res.items():
    print("reuse" if k else "llama.cpp re-eval", "median tok/s %.2f" % statistics.median(x[0] for x in v), "drafted", sum(x[1] for x in v), "accepted", sum(x[2] for x in v))
print("same tokens:", all(toks[(False,p)]==toks[(True,p)] for p in prompts))
