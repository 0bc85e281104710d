"""The shared n-gram pool stays under its bound over many requests (issue 25; benchmarks/pool_soak.py, the quick
version of ``python -m benchmarks.research --pool-soak``): 200 requests on the tiny model with a 600-token bound."""
from __future__ import annotations

from benchmarks.pool_soak import check_pool, pool_bytes, run_soak
from llamaspec.drafters.ngram_pool import SharedPool


def test_pool_soak_stays_under_its_bound(tiny_model):
    r = run_soak(str(tiny_model("llama")), n_requests=200, pool_tokens=600, n_parallel=4, n_predict=8, n_ctx=256,
                 threads=1, bytes_every=1, exact=True)
    assert r["ok"], r["violations"]
    assert r["n_done"] == 200 and r["n_failed"] == 0 and r["n_cancelled"] > 0
    # the bound was reached and held: finished sequences were evicted, never more than the budget kept
    assert r["end"]["n_evicted"] > 100
    assert 500 <= r["high_water"]["finished_tokens"] <= 600
    assert r["high_water"]["tokens"] <= 600 + r["live_bound_tokens"]
    assert r["high_water"]["bytes"] <= r["bytes_bound"]
    assert r["end"]["bytes_per_token"] < r["bytes_per_token_bound"]


def test_check_pool_sees_a_pool_over_its_bound():
    pool = SharedPool(budget=50)
    for i in range(10):
        pool.close(pool.open("", list(range(i * 20, i * 20 + 20))))
    assert check_pool(pool, n_parallel=1, n_ctx_seq=64) == []
    assert pool.n_finished_tokens <= 50 and pool.n_evicted == 8
    b = pool_bytes(pool)
    assert 0 < b < 40 * 700
    pool.budget = 10  # as if eviction had not run: the check must say so
    assert any("over the budget" in v for v in check_pool(pool, n_parallel=1, n_ctx_seq=64))
