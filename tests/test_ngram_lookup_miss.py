"""ngram-lookup's miss-streak cap (issue 25, the counting-list case of the copy-heavy set): after MISS_STREAK own
copies in a row whose first token failed in one match-length bucket, that bucket drafts at most MISS_CAP tokens
until a draft of it is accepted; the counts alone would keep pricing long drafts well (p1 cannot fall far below
its prior, q stays high)."""
from __future__ import annotations

from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_lookup import MISS_CAP, MISS_STREAK, NgramLookup, NgramLookupParams


def _drafter():
    d = NgramLookup(1, NgramLookupParams(pool_tokens=0))
    d.verify_cost = lambda k: 1.0 + 0.02 * k  # long drafts are cheap: only the streak can keep them short
    hist = list(range(100, 140)) * 2 + list(range(100, 110))  # a long earlier occurrence: a long match
    d.begin(0, hist)
    return d, hist


def _draft(d, hist) -> list[int]:
    dp = DraftParams(drafting=True, n_max=32, prompt=tuple(hist), id_last=110)
    d.draft([dp])
    return dp.result


def test_first_token_misses_cap_the_bucket_until_a_hit():
    d, hist = _drafter()
    lengths = []
    for _ in range(MISS_STREAK):
        r = _draft(d, hist)
        lengths.append(len(r))
        d.accept(0, 0, False)  # the first drafted token failed
    capped = _draft(d, hist)
    assert min(lengths) > MISS_CAP and 0 < len(capped) <= MISS_CAP
    d.accept(0, len(capped), False)  # accepted whole: the cap is lifted
    assert len(_draft(d, hist)) > MISS_CAP


def test_partial_acceptance_does_not_count_as_a_miss():
    d, hist = _drafter()
    for _ in range(2 * MISS_STREAK):
        r = _draft(d, hist)
        assert r
        d.accept(0, 1, False)  # the first token was right: a copy that ran a little, not a wrong copy
    assert d._slots[0].miss == [0] * len(d._slots[0].miss)
