"""ngram-cache (spec §4.11): thresholds, cache levels, QUIRKs and fixes, the cache file format."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_cache import (
    NgramCache,
    build_cache,
    cache_draft,
    cache_from_bytes,
    cache_stats,
    cache_to_bytes,
    cache_update,
    load_cache,
    merge_cache,
    save_cache,
)
from llamaspec.errors import UsageError
from llamaspec.params import NgramCacheParams



def K(tokens) -> tuple:
    """The 4-slot key of an n-gram of 1..4 tokens (unused slots -1)."""
    t = tuple(int(x) for x in tokens)
    assert 1 <= len(t) <= 4
    return t + (-1,) * (4 - len(t))


# ------------------------------------------------------------------------------------ literal reference
def ref_update(cache, tokens, nnew):
    for size in range(1, 5):
        for i in range(max(len(tokens) - nnew, size), len(tokens)):
            key = tuple(tokens[i - size: i]) + (-1,) * (4 - size)
            part = cache.setdefault(key, {})
            part[tokens[i]] = part.get(tokens[i], 0) + 1


def ref_draft(inp, n_draft, context, dynamic, static):
    lax = ((2, 2, 1, 1), (66, 50, 50, 50))
    strict = ((4, 3, 2, 2), (75, 66, 66, 66))
    if len(inp) < 2:
        return []
    draft = [inp[-1]]
    while len(draft) - 1 < n_draft:
        seq = list(inp) + draft[1:]
        part_s = static.get(tuple(seq[-2:]) + (-1, -1), {})
        tok = None
        for cache, (min_sample, min_percent) in ((context, lax), (dynamic, strict)):
            for size in range(4, 0, -1):
                if size > len(seq):
                    continue
                part = cache.get(tuple(seq[-size:]) + (-1,) * (4 - size))
                if part is None:
                    continue
                best, best_c, best_cw, total = None, 0, 0, 0
                for t, c in part.items():
                    w = 100 * part_s[t] if t in part_s else 1
                    if c * w > best_cw:
                        best, best_c, best_cw = t, c, c * w
                    total += c
                if total >= min_sample[size - 1] and 100 * best_c >= min_percent[size - 1] * total:
                    tok = best
                    break
            if tok is not None:
                break
        if tok is None:
            best, best_c, total = None, 0, 0
            for t, c in part_s.items():
                if c > best_c:
                    best, best_c = t, c
                total += c
            if total >= 2 and 100 * best_c >= 50 * total:
                tok = best
        if tok is None:
            break
        draft.append(tok)
    return draft[1:]


class RefDrafter:
    def __init__(self, n_seq, dynamic=None, static=None):
        self.context = [{} for _ in range(n_seq)]
        self.cache_size = [0] * n_seq
        self.dynamic, self.static = dynamic or {}, static or {}

    def draft(self, s, prompt, id_last):
        prompt = list(prompt)
        if self.cache_size[s] < len(prompt) + 1:
            new = prompt[self.cache_size[s]:] + [id_last]
            ref_update(self.context[s], new, len(new))
            self.cache_size[s] = len(prompt) + 1
        return ref_draft(prompt + [id_last], 8, self.context[s], self.dynamic, self.static)


def ordered(cache):
    return {k: list(v.items()) for k, v in cache.items()}


def draft(d, prompt, id_last, seq=0):
    dps = [DraftParams() for _ in range(d.n_seq)]
    dps[seq] = DraftParams(drafting=True, prompt=prompt, id_last=id_last, n_max=-1)
    d.draft(dps)
    return dps[seq].result


# ------------------------------------------------------------------------------------------- update
def test_update_counts_and_padding():
    c = {}
    cache_update(c, [1, 2, 3], 3)
    assert c == {
        K([1]): {2: 1}, K([2]): {3: 1},
        K([1, 2]): {3: 1},
    }
    c2 = {}
    cache_update(c2, [1, 2, 3, 4, 5, 6], 2)  # only n-grams ending in the last 2 tokens
    assert sorted(c2) == sorted([K([4]), K([5]), K([3, 4]), K([4, 5]), K([2, 3, 4]), K([3, 4, 5]),
                                 K([1, 2, 3, 4]), K([2, 3, 4, 5])])
    c3 = {}
    ref_update(c3, [1, 2, 3, 4, 5, 6], 2)
    assert ordered(c2) == ordered(c3)


def test_update_random_against_reference():
    rng = np.random.default_rng(3)
    for _ in range(50):
        toks = rng.integers(0, 4, int(rng.integers(0, 40))).tolist()
        nnew = int(rng.integers(0, len(toks) + 2))
        a, b = {}, {}
        cache_update(a, np.array(toks, dtype=np.int32), nnew)
        ref_update(b, toks, nnew)
        assert ordered(a) == ordered(b)


# --------------------------------------------------------------------------------------- thresholds
@pytest.mark.parametrize(
    "context,inp,expected,why",
    [
        ({K([1, 2, 3, 4]): {7: 1}}, [1, 2, 3, 4], [7], "LAX size 4: 1 sample, 100% >= 50%"),
        ({K([1, 2, 3, 4]): {7: 1, 8: 1, 9: 1}}, [1, 2, 3, 4], [], "size 4: 33% < 50% and no smaller key"),
        ({K([1, 2, 3, 4]): {7: 1, 8: 1, 9: 1}, K([3, 4]): {8: 2}}, [1, 2, 3, 4], [8],
         "falls back to the 2-gram (2 samples, 100%)"),
        ({K([4]): {7: 2, 8: 1}}, [1, 2, 3, 4], [7], "LAX size 1: 3 samples, 66.7% >= 66%"),
        ({K([4]): {7: 1}}, [1, 2, 3, 4], [], "LAX size 1 needs 2 samples"),
        ({K([4]): {7: 1, 8: 1}}, [1, 2, 3, 4], [], "LAX size 1: 50% < 66%"),
        ({K([3, 4]): {7: 1, 8: 1}}, [1, 2, 3, 4], [7], "tie (strictly greater wins): first in dict order"),
        ({K([3, 4]): {8: 1, 7: 1}}, [1, 2, 3, 4], [8], "tie, other order"),
        ({K([3, 4]): {7: 1}}, [1, 2, 3, 4], [], "LAX size 2 needs 2 samples"),
        ({K([2, 3, 4]): {7: 1}}, [1, 2, 3, 4], [7], "LAX size 3 needs 1 sample"),
    ],
)
def test_context_lax(context, inp, expected, why):
    assert cache_draft(inp, 1, context, {}, {}) == expected
    assert ref_draft(inp, 1, context, {}, {}) == expected


@pytest.mark.parametrize(
    "dynamic,expected,why",
    [
        ({K([3, 4]): {7: 2, 8: 1}}, [7], "STRICT size 2: 3 samples, 66.7% >= 66%"),
        ({K([3, 4]): {7: 2}}, [], "STRICT size 2 needs 3 samples"),
        ({K([4]): {7: 3}}, [], "STRICT size 1 needs 4 samples"),
        ({K([4]): {7: 3, 8: 1}}, [7], "STRICT size 1: 4 samples, 75%"),
        ({K([4]): {7: 5, 8: 2}}, [], "STRICT size 1: 71% < 75%"),
        ({K([1, 2, 3, 4]): {7: 2}}, [7], "STRICT size 4: 2 samples"),
        ({K([1, 2, 3, 4]): {7: 1}}, [], "STRICT size 4: 1 sample is not enough"),
    ],
)
def test_dynamic_strict(dynamic, expected, why):
    assert cache_draft([1, 2, 3, 4], 1, {}, dynamic, {}) == expected
    assert ref_draft([1, 2, 3, 4], 1, {}, dynamic, {}) == expected


def test_context_before_dynamic_before_static():
    ctx = {K([3, 4]): {5: 2}}
    dyn = {K([3, 4]): {6: 3}}
    sta = {K([3, 4]): {7: 2}}
    assert cache_draft([1, 2, 3, 4], 1, ctx, dyn, sta) == [5]
    assert cache_draft([1, 2, 3, 4], 1, {}, dyn, sta) == [6]
    assert cache_draft([1, 2, 3, 4], 1, {}, {}, sta) == [7]


def test_static_only_rule():
    assert cache_draft([3, 4], 1, {}, {}, {K([3, 4]): {7: 1, 8: 1}}) == [7]  # 2 samples, 50%
    assert cache_draft([3, 4], 1, {}, {}, {K([3, 4]): {7: 1}}) == []  # 1 sample
    assert cache_draft([3, 4], 1, {}, {}, {K([3, 4]): {7: 1, 8: 1, 9: 1}}) == []  # 33%
    assert cache_draft([3, 4], 1, {}, {}, {K([4]): {7: 5}}) == []  # only 2-gram keys of the static


def test_static_weights_the_choice():
    ctx = {K([3, 4]): {7: 2, 8: 2}}
    assert cache_draft([1, 2, 3, 4], 1, ctx, {}, {}) == [7]
    sta = {K([3, 4]): {8: 1}}
    assert cache_draft([1, 2, 3, 4], 1, ctx, {}, sta) == [8]  # 2 * 100 > 2
    # the weighted pick must still pass the threshold with its own count
    ctx2 = {K([4]): {7: 2, 8: 1}}
    assert cache_draft([1, 2, 3, 4], 1, ctx2, {}, {K([3, 4]): {8: 1}}) == []  # 8 chosen, 33% < 66%


def test_draft_length_and_short_inputs():
    ctx = {}
    cache_update(ctx, [1, 2] * 20, 40)
    assert cache_draft([1, 2, 1], 20, ctx, {}, {}) == [2, 1] * 10
    assert len(cache_draft([1, 2, 1], 8, ctx, {}, {})) == 8
    assert cache_draft([1], 8, ctx, {}, {}) == []  # len(inp) < 2
    # a 2-token input only looks at sizes <= 2 (llama.cpp would read before the buffer)
    assert cache_draft([1, 2], 1, {K([9, 1, 2]): {5: 9}, K([1, 2]): {6: 2}}, {}, {}) == [6]


# ----------------------------------------------------------------------------------------- the drafter
def test_drafter_basic():
    d = NgramCache(n_seq=2, params=NgramCacheParams())
    assert d.type == "ngram-cache" and d.n_max == 8
    hist = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]
    dps = [DraftParams(), DraftParams(drafting=True, prompt=np.array(hist, dtype=np.int32), id_last=2, n_max=3)]
    d.draft(dps)
    assert dps[0].result == [] and dps[1].result == [3, 1, 2, 3, 1, 2, 3, 1] and dps[1].probs is None
    assert d.cache_size == [0, 11] and d.context[0] == {}


def test_boundary_quirk_and_fix():
    prompt = [5, 6, 7, 8]
    for fix in (False, True):
        d = NgramCache(1, NgramCacheParams(), fix_boundary=fix)
        draft(d, prompt, 9)  # indexes 5 6 7 8 9
        draft(d, prompt + [9, 10, 11], 12)  # new tokens: 10 11 12
        ctx = d.context[0]
        # the n-grams (9) -> 10, (8, 9) -> 10, (9, 10) -> 11, ... span the boundary
        spanning = [K([9]), K([8, 9]), K([7, 8, 9]), K([9, 10]), K([6, 7, 8, 9]), K([8, 9, 10]), K([9, 10, 11])]
        assert all((k in ctx) == fix for k in spanning), fix
        assert ctx[K([10])] == {11: 1} and ctx[K([10, 11])] == {12: 1}


def test_cache_size_never_reset_quirk_and_fix():
    long = list(range(100, 130))
    short = [1, 2, 3, 1, 2, 3, 1, 2]
    d = NgramCache(1, NgramCacheParams())
    draft(d, long, 0)
    d.begin(0, short)
    assert draft(d, short, 3) == []  # cache_size 31 >= 9: the new prompt is not indexed (QUIRK)
    assert d.cache_size == [31] and K([1, 2]) not in d.context[0]
    d = NgramCache(1, NgramCacheParams(), fix_reset=True)
    draft(d, long, 0)
    d.begin(0, short)
    assert draft(d, short, 3) == [1, 2, 3, 1, 2, 3, 1, 2]
    assert K([100]) not in d.context[0]
    assert NgramCache(1, NgramCacheParams(), fix_quirks=True).fix_boundary


@pytest.mark.parametrize("fix", [False, True])
def test_begin_precompute_is_exact(fix):
    """begin() pre-indexes the prompt; the result must equal indexing in draft() in every case."""
    rng = np.random.default_rng(11 + fix)
    for trial in range(25):
        d = NgramCache(2, NgramCacheParams(), fix_boundary=fix)
        nobegin = NgramCache(2, NgramCacheParams(), fix_boundary=fix)
        r = RefDrafter(2)
        hists = [rng.integers(0, 5, int(rng.integers(0, 30))).tolist() for _ in range(2)]
        for s in range(2):
            d.begin(s, hists[s])
        for step in range(30):
            s = int(rng.integers(0, 2))
            id_last = int(rng.integers(0, 5))
            prompt = hists[s] if step % 2 else np.array(hists[s], dtype=np.int32)
            got = draft(d, prompt, id_last, seq=s)
            assert got == draft(nobegin, hists[s], id_last, seq=s), (trial, step)
            assert ordered(d.context[s]) == ordered(nobegin.context[s])
            assert d.cache_size == nobegin.cache_size
            if not fix:
                assert got == r.draft(s, hists[s], id_last)
                assert ordered(d.context[s]) == ordered(r.context[s])
            hists[s] = hists[s] + [id_last] + rng.integers(0, 5, int(rng.integers(0, 4))).tolist()
            u = rng.random()
            if u < 0.15:  # new generation: longer, shorter, or a prompt other than the one drafted
                hists[s] = hists[s][: int(rng.integers(0, len(hists[s]) + 1))] + rng.integers(0, 5, int(rng.integers(0, 20))).tolist()
                d.begin(s, hists[s])
                nobegin.begin(s, [])
            elif u < 0.2:
                d.begin(s, hists[s] + [1] * 12)  # begin sees a prompt the drafts never use


def test_random_drafts_against_reference_with_files():
    rng = np.random.default_rng(4)
    corpus = [rng.integers(0, 6, 200).tolist() for _ in range(3)]
    static = build_cache(corpus)
    dynamic = build_cache(corpus, 1, 4)
    d = NgramCache(1, NgramCacheParams())
    d.static, d.dynamic = static, dynamic
    r = RefDrafter(1, dynamic, static)
    hist = rng.integers(0, 6, 10).tolist()
    for step in range(60):
        id_last = int(rng.integers(0, 6))
        assert draft(d, hist, id_last) == r.draft(0, hist, id_last)
        hist = hist + [id_last] + rng.integers(0, 6, int(rng.integers(0, 3))).tolist()


# -------------------------------------------------------------------------------------------- files
def test_byte_layout(tmp_path):
    cache = {(5, -1, -1, -1): {7: 3, 9: 1}, (1, 2, -1, -1): {3: 1}}
    path = tmp_path / "c.bin"
    save_cache(cache, path)
    want = (struct.pack("<4ii", 5, -1, -1, -1, 2) + struct.pack("<2i", 7, 3) + struct.pack("<2i", 9, 1)
            + struct.pack("<4ii", 1, 2, -1, -1, 1) + struct.pack("<2i", 3, 1))
    assert path.read_bytes() == want
    assert len(want) == 2 * 20 + 3 * 8
    assert ordered(load_cache(path)) == ordered(cache)


def test_round_trip_random(tmp_path):
    rng = np.random.default_rng(9)
    cache = build_cache([rng.integers(-5, 1000, 500).tolist() for _ in range(4)], 1, 4)
    path = tmp_path / "r.bin"
    save_cache(cache, path)
    assert ordered(load_cache(path)) == ordered(cache)
    assert cache_stats(cache)["file_bytes"] == path.stat().st_size
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_empty_file_and_merge_of_concatenated_files(tmp_path):
    p = tmp_path / "e.bin"
    p.write_bytes(b"")
    assert load_cache(p) == {}
    a = {K([1, 2]): {3: 1}}
    b = {K([1, 2]): {3: 2, 4: 1}, K([5]): {6: 1}}
    both = cache_from_bytes(cache_to_bytes(a) + cache_to_bytes(b))
    m = {K([1, 2]): {3: 1}}
    merge_cache(m, b)
    assert both == m == {K([1, 2]): {3: 3, 4: 1}, K([5]): {6: 1}}


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\x00\x01\x02", "multiple of 4"),
        (struct.pack("<4i", 1, -1, -1, -1), "truncated record"),
        (struct.pack("<4ii", 1, -1, -1, -1, 0), "ntokens = 0"),
        (struct.pack("<4ii", 1, -1, -1, -1, -3), "ntokens = -3"),
        (struct.pack("<4ii2i", 1, -1, -1, -1, 2, 5, 1), "truncated"),
        (struct.pack("<4ii2i", 1, -1, -1, -1, 1, 5, 0), "count 0"),
    ],
)
def test_corrupt_files(tmp_path, data, match):
    p = tmp_path / "bad.bin"
    p.write_bytes(data)
    with pytest.raises(UsageError, match=match):
        load_cache(p)
    with pytest.raises(UsageError, match="bad.bin"):
        NgramCache(1, NgramCacheParams(lookup_cache_static=str(p)))


def test_missing_files(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        NgramCache(1, NgramCacheParams(lookup_cache_static=str(tmp_path / "nope.bin")))
    with pytest.raises(UsageError, match="not found"):
        NgramCache(1, NgramCacheParams(lookup_cache_dynamic=str(tmp_path / "nope.bin")))
    with pytest.raises(UsageError, match="directory"):
        load_cache(tmp_path)


def test_files_loaded_at_construction(tmp_path):
    sp, dp_ = tmp_path / "s.bin", tmp_path / "d.bin"
    save_cache({K([3, 4]): {7: 2}}, sp)
    save_cache({K([4]): {8: 4}}, dp_)
    d = NgramCache(2, NgramCacheParams(lookup_cache_static=str(sp), lookup_cache_dynamic=str(dp_)))
    assert d.static == {K([3, 4]): {7: 2}} and d.dynamic == {K([4]): {8: 4}}
    # no context key for ...4; dynamic (4) -> 8 (STRICT: 4 samples, 100%) comes before the static-only
    # try of (3, 4) -> 7; then nothing knows (4, 8) or (8)
    assert draft(d, [1, 2, 3], 4, seq=1) == [8]
    assert d.context[0] == {}


# -------------------------------------------------------------------------------------- build & stats
def test_build_cache_like_lookup_create():
    c = build_cache([[1, 2, 3, 1, 2, 4], [1, 2, 3]])
    assert c == {K([1, 2]): {3: 2, 4: 1}, K([2, 3]): {1: 1}, K([3, 1]): {2: 1}}
    c4 = build_cache([[1, 2, 3]], ngram_min=1, ngram_max=4)
    assert c4 == {K([1]): {2: 1}, K([2]): {3: 1}, K([1, 2]): {3: 1}}
    with pytest.raises(UsageError):
        build_cache([[1, 2]], 0, 2)
    with pytest.raises(UsageError):
        build_cache([[1, 2]], 3, 2)


def test_cache_stats():
    s = cache_stats({K([1, 2]): {3: 5, 4: 1}, K([5]): {6: 1}, K([1, 2, 3, 4]): {9: 2}}, top=2)
    assert s["n_keys"] == 3 and s["n_entries"] == 4 and s["total_count"] == 9
    assert s["keys_by_size"] == {1: 1, 2: 1, 3: 0, 4: 1}
    assert s["max_tokens_per_key"] == 2
    assert s["top_keys"][0] == {"key": [1, 2], "count": 6, "tokens": [(3, 5), (4, 1)]}
    assert len(s["top_keys"]) == 2


def test_file_format_docstring_examples():
    """The worked example of the cache file module (ngram_cache_io: the format split out of ngram_cache)."""
    import doctest

    from llamaspec.drafters import ngram_cache_io

    res = doctest.testmod(ngram_cache_io, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
