"""ngram-simple (spec §4.7): table tests on hand-built histories and a check against a literal port."""
from __future__ import annotations

import numpy as np
import pytest

from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_simple import NgramSimple, simple_draft
from llamaspec.params import NgramMapParams


def ref_simple(prompt, id_last, n, m):
    """Literal reading of §4.7 (slow, for comparison)."""
    prompt = list(prompt)
    L = len(prompt)
    if L <= n + m + 1:
        return []
    pattern = prompt[L - n + 1: L] + [id_last]
    for j in range(L - n - 1, 0, -1):
        if prompt[j: j + n] == pattern:
            copy = min(m, L - (j + n))
            if copy < n:
                return []
            return prompt[j + n: j + n + copy]
    return []


# (prompt, id_last, n, m, expected, why)
CASES = [
    ([9, 1, 2, 3, 4, 5, 6, 1], 2, 2, 3, [3, 4, 5], "match at j=1, copy m=3"),
    ([9, 1, 2, 3, 4, 5, 6, 1], 7, 2, 3, [], "no match"),
    ([9, 1, 2, 3, 4, 5], 2, 2, 3, [], "L = 6 = n+m+1 -> too short"),
    ([9, 1, 2, 3, 4, 5, 1], 2, 2, 3, [3, 4, 5], "L = 7 = n+m+2 -> allowed"),
    ([1, 2, 3, 4, 5, 6, 7, 1], 2, 2, 3, [], "index 0 never matches"),
    ([9, 1, 2, 3, 8, 1, 2, 4, 5, 6, 7, 1], 2, 2, 3, [4, 5, 6], "latest match (j=5) wins over j=1"),
    ([9, 8, 7, 6, 5, 1, 2, 3, 4, 1], 2, 2, 4, [3, 4, 1], "copy limited by the history (3 < m=4)"),
    ([9, 1, 2, 3, 4, 5, 6, 1, 2, 3, 1], 2, 3, 2, [], "m < n: copy <= m < n, never drafts (QUIRK)"),
    ([9, 5, 1, 2, 3, 4, 5, 6, 5, 1, 2, 7, 5], 1, 3, 2, [], "latest match leaves 1 token (< n): empty, earlier match ignored (QUIRK)"),
]


@pytest.mark.parametrize("prompt,id_last,n,m,expected,why", CASES, ids=[c[-1] for c in CASES])
def test_table(prompt, id_last, n, m, expected, why):
    assert simple_draft(prompt, id_last, n, m) == expected
    assert ref_simple(prompt, id_last, n, m) == expected
    assert simple_draft(np.array(prompt, dtype=np.int32), id_last, n, m) == expected


def test_short_copy_quirk_and_fix():
    # n=3: the latest match of [5, 6, 7] is at j=9, leaving 2 tokens (< n); an earlier one at j=1
    prompt = [0, 5, 6, 7, 1, 2, 3, 4, 8, 5, 6, 7, 5, 6]
    assert simple_draft(prompt, 7, 3, 4) == []
    assert simple_draft(prompt, 7, 3, 4, fix_short_match=True) == [1, 2, 3, 4]
    d = NgramSimple(1, NgramMapParams(size_n=3, size_m=4), fix_short_match=True)
    dp = DraftParams(drafting=True, prompt=prompt, id_last=7)
    d.draft([dp])
    assert dp.result == [1, 2, 3, 4]
    assert NgramSimple(1, NgramMapParams(), fix_quirks=True).fix_short_match


def test_random_against_reference():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n = int(rng.integers(1, 5))
        m = int(rng.integers(1, 7))
        L = int(rng.integers(0, 60))
        prompt = rng.integers(0, 3, L).tolist()
        id_last = int(rng.integers(0, 3))
        assert simple_draft(prompt, id_last, n, m) == ref_simple(prompt, id_last, n, m), (prompt, id_last, n, m)


def test_long_history_chunked_search():
    # the latest match lies far back (exercises the growing backward chunks)
    rng = np.random.default_rng(2)
    prompt = [int(x) for x in rng.integers(100, 30000, 5000)]
    prompt[10:22] = list(range(1, 13))
    id_last = prompt[21]
    prompt[-11:] = list(range(1, 12))
    assert simple_draft(prompt, id_last, 12, 48) == prompt[22:70] == ref_simple(prompt, id_last, 12, 48)


def test_drafter_protocol():
    p = NgramMapParams(size_n=2, size_m=3)
    d = NgramSimple(n_seq=2, params=p)
    assert d.type == "ngram-simple" and d.n_max == 3
    prompt = [9, 1, 2, 3, 4, 5, 6, 1]
    d.begin(0, prompt)
    dps = [DraftParams(), DraftParams(drafting=True, prompt=np.array(prompt, dtype=np.int32), id_last=2, n_max=1)]
    d.draft(dps)
    assert dps[0].result == []
    assert dps[1].result == [3, 4, 5]  # dp.n_max is the chain's business
    assert all(type(t) is int for t in dps[1].result)
    assert dps[1].probs is None
    d.accept(1, 2, False)
    assert d.stats.n_call_draft == 0  # the chain owns the stats


@pytest.mark.parametrize("mod", ["_ngram_util", "ngram_simple", "ngram_map", "ngram_mod", "ngram_cache"])
def test_docstring_examples(mod):
    """The worked examples in the n-gram drafter modules' docstrings."""
    import doctest
    import importlib

    m = importlib.import_module(f"llamaspec.drafters.{mod}")
    res = doctest.testmod(m, optionflags=doctest.ELLIPSIS)
    assert res.failed == 0 and res.attempted > 0
