"""The shared n-gram pool of ngram-lookup (issue 25): match, verify, eviction under the bound, tenant isolation,
and in the engine: a repeated request drafts from the pool, greedy output stays plain decoding's."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_lookup import NgramLookup
from llamaspec.drafters.ngram_pool import POOL_KEYS, SharedPool
from llamaspec.engine import Engine
from llamaspec.params import NgramLookupParams, SpecParams
from llamaspec.options import RequestOptions

from helpers import EXACT


def test_match_copy_and_extension():
    pool = SharedPool(budget=1000)
    a = pool.open("", [9, 9, 1, 2, 3, 4, 5, 6, 7, 8])
    hit = pool.lookup("", [0, 1, 2, 3, 4], 5, exclude=-1, min_m=0)
    assert hit is not None and hit[0] == a
    uid, e, m = hit
    assert m == 5 and pool.copy(uid, e, 2) == [6, 7]
    assert pool.copy(uid, e, 100) == [6, 7, 8]                  # the sequence ends: a shorter draft
    assert pool.lookup("", [0, 1, 2, 3, 4], 5, exclude=-1, min_m=5) is None   # not longer than the own match
    assert pool.lookup("", [0, 1, 2, 3, 4], 5, exclude=a, min_m=0) is None    # its own live sequence
    assert pool.lookup("", [1, 2, 3, 4, 5, 6, 7], 8, exclude=-1, min_m=0) is None  # nothing follows it


def test_keys_are_verified():
    pool = SharedPool(budget=1000)
    a = pool.open("", [1, 2, 3, 4, 5, 6])
    # a forged entry (a hash collision): every key of the query points at a place that does not match
    q = [40, 41, 42]
    for d in pool.idx:
        for h in list(d):
            d[h] = (a << 32) | 4
    assert pool.lookup("", q, 43, exclude=-1, min_m=0) is None


def test_own_live_sequence_does_not_hide_another():
    pool = SharedPool(budget=1000)
    other = pool.open("", [1, 2, 3, 4, 5, 6, 70, 71])
    pool.close(other)
    mine = pool.open("", [8, 1, 2, 3, 4, 5, 6, 9, 9])      # the most recent occurrence is the slot's own
    hit = pool.lookup("", [7, 1, 2, 3, 4, 5], 6, exclude=mine, min_m=0)
    assert hit is not None and hit[0] == other and pool.copy(hit[0], hit[1], 2) == [70, 71]


def test_eviction_keeps_memory_under_the_bound_soak():
    rng = random.Random(0)
    budget = 4000
    pool = SharedPool(budget=budget)
    live: list[int] = []
    for i in range(1000):
        uid = pool.open(f"t{i % 3}", [rng.randrange(50) for _ in range(rng.randrange(10, 300))])
        pool.extend(uid, [rng.randrange(50) for _ in range(rng.randrange(0, 40))])
        live.append(uid)
        if len(live) > 4:
            pool.close(live.pop(0))
        live_tokens = sum(len(pool.seqs[u].toks) for u in live)
        assert pool.n_finished_tokens <= budget
        assert pool.n_tokens <= budget + live_tokens
        assert pool.n_entries <= 2 * len(POOL_KEYS) * pool.n_tokens
    for u in live:
        pool.close(u)
    assert pool.n_finished_tokens <= budget and pool.n_evicted > 900
    # no index entry outlives its sequence
    for d in pool.idx + pool.idx2:
        assert all((v >> 32) in pool.seqs for v in d.values())
    assert len(pool.seqs) == len(pool.finished)


def test_lru_keeps_a_sequence_that_pays():
    pool = SharedPool(budget=30)
    a = pool.open("", list(range(10)))
    pool.close(a)
    b = pool.open("", list(range(20, 30)))
    pool.close(b)
    pool.touch(a)                                          # a draft from a paid: b goes first
    c = pool.open("", list(range(40, 55)))
    pool.close(c)
    assert a in pool.seqs and b not in pool.seqs


@pytest.mark.parametrize("shared", [False, True])
def test_tenant_isolation(shared):
    rng = random.Random(1)
    pool = SharedPool(budget=100000, shared=shared)
    text = [rng.randrange(30) for _ in range(400)]
    owners = {}
    for t in ("alice", "bob", ""):
        for _ in range(3):
            start = rng.randrange(0, 200)
            owners[pool.open(t, text[start:start + 150])] = t
    n_cross = 0
    for _ in range(2000):
        me = rng.choice(("alice", "bob", "", "eve"))
        pos = rng.randrange(5, 399)
        hit = pool.lookup(me, text[:pos], text[pos], exclude=-1, min_m=0)
        if hit is not None:
            n_cross += owners[hit[0]] != me
            assert shared or owners[hit[0]] == me
    assert (n_cross > 0) == shared


def _draft(d: NgramLookup, seq_id: int, hist: list[int], id_last: int, n_seq: int = 2) -> list[int]:
    dps = [DraftParams() for _ in range(n_seq)]
    dps[seq_id] = DraftParams(drafting=True, n_max=16, prompt=hist, id_last=id_last)
    d.draft(dps)
    return dps[seq_id].result


def test_concurrent_sequences_draft_from_each_other():
    """``n > 1`` choices: slot 1 drafts what slot 0 has already written, within one tenant only."""
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4]
    for owner1, expect in (("k1", True), ("k2", False)):
        d = NgramLookup(2, NgramLookupParams(adaptive=False, n_max=16))
        d.set_owner(0, "k1")
        d.set_owner(1, owner1)
        d.begin(0, [50, 51])
        d.begin(1, [50, 51])
        _draft(d, 0, [50, 51] + seq, 0)                      # slot 0 has written seq
        got = _draft(d, 1, [50, 51] + seq[:6], seq[6])      # slot 1 is 7 tokens in
        assert (got[:4] == seq[7:11]) == expect, got


def test_pool_counts_apart_from_own():
    d = NgramLookup(1, NgramLookupParams())
    d.begin(0, [60, 61] + list(range(40)))
    d.begin(0, [62, 63])                                  # the first request is finished
    st = d._slots[0]
    got = _draft(d, 0, [62, 63, 0, 1, 2, 3, 4, 5], 6, n_seq=1)
    assert got[:3] == [7, 8, 9] and d.pool.cur[0].last_uid > 0
    d.accept(0, 0, False)                                 # a pool draft that failed
    assert sum(st.counts.p1_n) == 0 and sum(d.pool.cur[0].counts.p1_n) == 1.0   # the own counts are untouched


def test_pool_off():
    d = NgramLookup(1, NgramLookupParams(pool_tokens=0))
    assert d.pool is None
    d.begin(0, [60, 61] + list(range(40)))
    d.begin(0, [62, 63])
    assert _draft(d, 0, [62, 63, 0, 1, 2, 3, 4, 5], 6, n_seq=1) == []


# -- in the engine ----------------------------------------------------------------------------------------
A = [5, 6, 7, 8, 9, 10, 11, 40, 41, 42, 43, 17, 18]
B = [30, 31, 32, 33, 60, 61, 3]


@pytest.fixture(scope="module")
def plain(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=512, **EXACT) as e:
        return [e.generate(p, n_predict=48).tokens for p in (A, B, A)]


def _auto(t: str = "auto", **kw) -> SpecParams:
    """``auto``; or ``ngram-lookup`` with a fixed length (its drafts then do not hang on measured timings)."""
    p = SpecParams()
    p.add_types(t)
    for k, v in kw.items():
        setattr(p.ngram_lookup, k, v)
    return p


@pytest.mark.parametrize("t", ["auto", "ngram-lookup"])
def test_repeat_drafts_from_pool_and_equals_plain(tiny_model, plain, t):
    spec = _auto() if t == "auto" else _auto(t, adaptive=False, n_max=16)
    with Engine(tiny_model("llama"), spec=spec, n_ctx=512, **EXACT) as e:
        pool = e.chain.impls[0].pool
        rs = []
        for pr in (A, B):
            rs.append(e.generate(pr, n_predict=48))
        before = pool.n_accepted
        rs.append(e.generate(A, n_predict=48))
        info = e.chain.auto_info()["ngram-lookup"] if t == "auto" else None
    assert [r.tokens for r in rs] == plain
    if t == "auto":  # auto's lengths follow measured costs (a loaded machine may say no): reported, not required
        assert info["pool_drafts"] == pool.n_drafts and info["pool_tokens"] > 0
    else:
        assert pool.n_accepted - before > 0 and rs[2].stats.n_accepted > 0


@pytest.mark.parametrize("shared", [False, True])
def test_tenants_in_the_engine(tiny_model, plain, shared):
    with Engine(tiny_model("llama"), spec=_auto("ngram-lookup", adaptive=False, n_max=16, pool_shared=shared),
                n_ctx=512, **EXACT) as e:
        pool = e.chain.impls[0].pool
        outs = [e.submit(A, RequestOptions(n_predict=48, owner="alice")).result().tokens,
                e.submit(B, RequestOptions(n_predict=48, owner="alice")).result().tokens]
        before = pool.n_drafts
        outs.append(e.submit(A, RequestOptions(n_predict=48, owner="bob")).result().tokens)
    assert outs == plain
    assert (pool.n_drafts > before) == shared


def test_pool_flags():
    from llamaspec.cli.spec_options import build_spec_params
    from llamaspec.errors import UsageError

    kw = dict(draft_model=None, spec_type=(), spec_default=False, spec_draft_n_max=None, spec_draft_n_min=None,
              spec_draft_p_min=None, spec_synth_len=None, spec_synth_rates=None, verify="match")
    p, _, _ = build_spec_params(**kw)
    assert p.ngram_lookup.pool_tokens == 262144 and not p.ngram_lookup.pool_shared
    p, _, _ = build_spec_params(**kw, spec_pool_tokens=0, spec_pool_shared=True)
    assert p.ngram_lookup.pool_tokens == 0 and p.ngram_lookup.pool_shared
    with pytest.raises(UsageError, match="spec-pool-tokens"):
        build_spec_params(**kw, spec_pool_tokens=-1)


def test_server_passes_the_key_hash_as_tenant():
    from llamaspec.server.middleware import GuardMiddleware
    from llamaspec.server.tenant import current_tenant, tenant_of

    seen = []

    async def app(scope, receive, send):
        seen.append(await asyncio.to_thread(current_tenant))   # as the worker thread that submits sees it

    state = SimpleNamespace(ready=True, config=SimpleNamespace(api_keys=["k1", "k2"]))
    guard = GuardMiddleware(app, state)

    async def call(headers):
        async def send(msg):
            pass
        await guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, None, send)

    asyncio.run(call([(b"authorization", b"Bearer k2")]))
    asyncio.run(call([(b"x-api-key", b"k1")]))
    assert seen == [tenant_of(b"k2"), tenant_of(b"k1")] and seen[0] != seen[1]
    open_guard = GuardMiddleware(app, SimpleNamespace(ready=True, config=SimpleNamespace(api_keys=[])))
    asyncio.run(open_guard({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, None, None))
    assert seen[-1] == ""


def test_a_pool_that_does_not_pay_is_switched_off():
    """Pool matches whose drafts always fail: after a few rounds the slot drafts from the pool only to look
    again now and then (the expected-gain gate of ngram-lookup, with the pool's own counts)."""
    d = NgramLookup(1, NgramLookupParams())
    d.begin(0, list(range(400)))
    d.begin(0, [1000])
    hist, n_drafts = [1000], 0
    for i in range(60):
        a = 5 * i
        hist += [a, a + 1, a + 2, a + 3]
        got = _draft(d, 0, list(hist), a + 4, n_seq=1)
        n_drafts += bool(got)
        d.accept(0, 0, False)
        hist += [a + 4, 2000 + i]
    assert d.pool.n_drafts == n_drafts and 1 <= n_drafts <= 15, n_drafts


def test_clear_forgets_everything():
    d = NgramLookup(1, NgramLookupParams())
    d.begin(0, [60, 61] + list(range(40)))
    d.begin(0, [62, 63])
    d.pool.clear()
    assert d.pool.pool.n_tokens == 0 and d.pool.pool.n_entries == 0
    assert _draft(d, 0, [62, 63, 0, 1, 2, 3, 4, 5], 6, n_seq=1) == []
    assert d.pool.pool.n_tokens == 8                     # the slot's history is live in the new pool
