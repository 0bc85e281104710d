"""ngram-mod (spec §4.10): index arithmetic, table tests, collisions, resets, and a literal port."""
from __future__ import annotations

import numpy as np

from llamaspec.drafters.base import DraftParams
from llamaspec.drafters.ngram_mod import EMPTY, TABLE_SIZE, NgramMod, mod_index, mod_index_windows
from llamaspec.params import NgramModParams


def ref_index(tokens, size=4194304):
    """Literal §4.10: 64-bit LCG over sign-extended int32 tokens, then % size."""
    r = 0
    for x in tokens:
        x64 = x if x >= 0 else x + 2**64
        r = (r * 6364136223846793005 + x64) % 2**64
    return r % size


class RefMod:
    """Slow literal port (dict table) used to check the vectorised one."""

    def __init__(self, n_seq, n, n_min, n_max, size):
        self.n, self.n_min, self.n_max, self.size = n, n_min, n_max, size
        self.table = {}
        self.used = 0
        self.i_last = [0] * n_seq
        self.n_draft_last = [0] * n_seq
        self.n_low = [0] * n_seq

    def add(self, t):
        i = ref_index(t[: self.n], self.size)
        if i not in self.table:
            self.used += 1
        self.table[i] = t[self.n]

    def get(self, t):
        return self.table.get(ref_index(t[-self.n:], self.size), -1)

    def begin(self, s, prompt):
        self.i_last[s] = 0
        self.n_draft_last[s] = 0
        if len(prompt) < self.n:
            return
        for i in range(len(prompt) - self.n):
            self.add(prompt[i: i + self.n + 1])
        self.i_last[s] = len(prompt) - self.n
        if self.used / self.size > 0.25:
            self.table, self.used = {}, 0

    def draft(self, s, prompt, id_last):
        self.n_draft_last[s] = 0
        L = len(prompt)
        if L < self.n:
            return []
        if self.i_last[s] + 32 < L:
            for i in range(self.i_last[s], L - self.n):
                self.add(prompt[i: i + self.n + 1])
            self.i_last[s] = L - self.n
        w = prompt[L - self.n + 1:] + [id_last]
        res = []
        for i in range(self.n_max):
            tok = self.get(w)
            if tok == -1:
                if i < self.n_min:
                    return []
                break
            w.append(tok)
            res.append(tok)
        self.n_draft_last[s] = len(res)
        return res

    def accept(self, s, n_acc, is_other):
        if is_other or self.n_draft_last[s] <= 0:
            return
        if n_acc / self.n_draft_last[s] < 0.25:
            self.n_low[s] += 1
            if self.n_low[s] >= 5:
                self.table, self.used = {}, 0
                self.n_low[s] = 0
                self.i_last[s] = 0
        else:
            self.n_low[s] = 0


def make(n_seq=1, size=None, **kw):
    cls = NgramMod
    if size is not None:
        cls = type("SmallMod", (NgramMod,), {"table_size": size})
    return cls(n_seq, NgramModParams(**kw))


def draft(d, prompt, id_last, seq=0):
    dps = [DraftParams() for _ in range(d.n_seq)]
    dps[seq] = DraftParams(drafting=True, prompt=prompt, id_last=id_last, n_max=-1)
    d.draft(dps)
    return dps[seq].result


def table_dict(d):
    nz = np.flatnonzero(d.table != EMPTY)
    return {int(i): int(d.table[i]) for i in nz}


# ------------------------------------------------------------------------------------------------ index
def test_index_constants():
    assert TABLE_SIZE == 4194304
    assert mod_index([5]) == 5
    assert mod_index([1, 0]) == 6364136223846793005 % 4194304
    assert mod_index([-1]) == ref_index([-1]) == (2**64 - 1) % 4194304
    rng = np.random.default_rng(0)
    for _ in range(50):
        w = rng.integers(-2**31, 2**31, int(rng.integers(1, 40))).tolist()
        assert mod_index(w) == ref_index(w)


def test_index_vectorised_matches_scalar():
    rng = np.random.default_rng(1)
    arr = rng.integers(-2**31, 2**31, 400, dtype=np.int64).astype(np.int32)
    for n in (1, 3, 24, 100):
        got = mod_index_windows(arr, 5, 200, n)
        assert got.tolist() == [ref_index(arr[i: i + n].tolist()) for i in range(5, 205)]
    assert mod_index_windows(arr, 0, 10, 4, size=97).tolist() == [ref_index(arr[i: i + 4].tolist(), 97) for i in range(10)]


# ------------------------------------------------------------------------------------------ begin/draft
def test_worked_example_and_params():
    d = make(n_match=2, n_min=1, n_max=4)
    assert d.type == "ngram-mod" and d.n_max == 4
    d.begin(0, [1, 2, 3, 4, 1, 2])
    assert d.used == 4 and d.i_last == [4]
    assert table_dict(d) == {ref_index(w): v for w, v in (([1, 2], 3), ([2, 3], 4), ([3, 4], 1), ([4, 1], 2))}
    assert draft(d, [1, 2, 3, 4, 1, 2], 3) == [4, 1, 2, 3]
    assert d.n_draft_last == [4]


def test_defaults():
    d = NgramMod(n_seq=2, params=NgramModParams())
    assert (d.n_match, d.n_min, d.n_max) == (24, 48, 64)
    assert d.table.dtype == np.int32 and d.table.size == 4194304 and d.table.nbytes == 16 * 2**20


def test_begin_short_prompt_and_overwrite():
    d = make(n_match=2, n_min=0, n_max=4)
    d.begin(0, [7])
    assert d.used == 0 and d.i_last == [0]
    d.begin(0, [1, 2, 3, 1, 2, 4])  # window (1, 2) -> 3 then -> 4: the later add overwrites
    assert d.used == 3
    assert int(d.table[ref_index([1, 2])]) == 4


def test_n_min_and_n_max_cutoffs():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    # from (1, 2): 3 4 5 6 7 8 1 2 3 ... loops forever; n_max caps it
    d = make(n_match=2, n_min=0, n_max=5)
    d.begin(0, prompt)
    assert draft(d, prompt, 2) == [3, 4, 5, 6, 7]
    # window (8, 9) unknown immediately: with n_min 0 -> empty result, with n_min 1 -> empty too
    p2 = [1, 2, 3, 4, 5, 6, 7, 8]
    d = make(n_match=2, n_min=3, n_max=8)
    d.begin(0, p2)
    # from (6, 7): 8, then (7, 8) unknown -> 1 token < n_min 3 -> no draft at all
    assert draft(d, p2[:6], 7) == []
    assert d.n_draft_last == [0]
    # from (4, 5): 6 7 8 then (7, 8) unknown: 3 tokens >= n_min -> kept
    assert draft(d, p2[:4], 5) == [6, 7, 8]


def test_dp_n_max_not_applied():
    d = make(n_match=2, n_min=0, n_max=5)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    d.begin(0, prompt)
    dps = [DraftParams(drafting=True, prompt=prompt, id_last=2, n_max=2)]
    d.draft(dps)
    assert dps[0].result == [3, 4, 5, 6, 7] and dps[0].probs is None  # the chain truncates
    assert d.n_draft_last == [5]


def test_chunked_indexing_threshold():
    n = 2
    d = make(n_match=n, n_min=0, n_max=1)
    base = list(range(100, 110))  # 10 tokens, i_last = 8
    d.begin(0, base)
    assert d.i_last == [8]
    grown = base + list(range(200, 230))  # L = 40 = i_last + 32: not indexed yet
    assert draft(d, grown, 999) == [] and d.i_last == [8]
    assert int(d.table[ref_index([200, 201])]) == EMPTY
    grown = grown + [230]  # L = 41 > i_last + 32: windows i in [8, 39) are added
    draft(d, grown, 999)
    assert d.i_last == [39]
    assert int(d.table[ref_index([200, 201])]) == 202
    assert int(d.table[ref_index([228, 229])]) == 230
    assert int(d.table[ref_index([229, 230])]) == EMPTY  # window 39 needs the token after it


def test_collision_returns_foreign_token():
    # windows differing by 2^22 in one token share an index: no key verification
    n = 3
    a = [5, 6, 7]
    b = [5, 6, 7 + 4194304]
    assert mod_index(a) == mod_index(b)
    d = make(n_match=n, n_min=1, n_max=1)
    d.begin(0, a + [42])
    assert draft(d, [9, 5, 6], 7 + 4194304) == [42]  # [5, 6, 7+2^22] was never seen
    # also with -1 vs 2^22 - 1 (sign extension keeps the low bits)
    assert mod_index([1, -1]) == mod_index([1, 4194303])


def test_collision_in_a_small_table():
    d = make(size=16, n_match=1, n_min=1, n_max=1)
    d.begin(0, [3, 30])  # window (3) -> 30 at index 3
    assert draft(d, [0], 19) == [30]  # 19 % 16 == 3


def test_occupancy_reset_in_begin():
    d = make(size=64, n_match=1, n_min=0, n_max=4)
    d.begin(0, list(range(17)))  # 16 windows -> used 16 = 0.25 of 64: kept
    assert d.used == 16
    d.reset()
    d.begin(0, list(range(18)))  # 17 > 0.25 * 64: reset after adding, i_last kept
    assert d.used == 0 and not np.any(d.table != EMPTY) and d.i_last == [17]


def test_low_acceptance_reset():
    d = make(n_seq=2, n_match=2, n_min=0, n_max=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1]
    d.begin(0, prompt)
    d.begin(1, prompt)
    for k in range(4):
        assert draft(d, prompt, 2) == [3, 4, 5, 6]
        d.accept(0, 0, False)  # 0/4 < 0.25
        d.accept(0, 4, True)   # other impl: ignored
    assert d.n_low[0] == 4
    draft(d, prompt, 2)
    d.accept(0, 1, False)  # 1/4 = 0.25: not low -> counter back to 0
    assert d.n_low[0] == 0
    for k in range(5):
        draft(d, prompt, 2)
        d.accept(0, 0, False)
    assert d.used == 0 and d.n_low[0] == 0 and d.i_last == [0, 7]  # shared table gone, seq 1 keeps i_last
    assert draft(d, prompt, 2, seq=1) == []  # seq 1 does not re-index (i_last 7 + 32 >= 9)
    assert draft(d, prompt, 2) == []  # nor seq 0: i_last 0 + 32 >= 9 (short history)


def test_reset_then_reindex_long_history():
    d = make(n_match=2, n_min=0, n_max=2)
    prompt = list(range(50))
    d.begin(0, prompt)
    for _ in range(5):
        assert draft(d, prompt, 49) == []  # (48, 49) unknown -> empty: n_draft_last 0, accept ignored
        d.accept(0, 0, False)
    assert d.used == 48
    for _ in range(5):
        assert draft(d, prompt[:10], 10) == [11, 12]
        d.accept(0, 0, False)
    assert d.used == 0 and d.i_last == [0]
    hist = prompt + [9]
    assert draft(d, hist, 10) == [11, 12]  # 0 + 32 < 51: the whole history is re-added
    assert d.i_last == [49] and d.used == 49


def test_accept_without_draft_is_ignored():
    d = make(n_match=2, n_min=0, n_max=2)
    for _ in range(10):
        d.accept(0, 0, False)
    assert d.n_low == [0]


def test_table_shared_between_seqs_and_memory():
    d = NgramMod(n_seq=1000, params=NgramModParams(n_match=2, n_min=0, n_max=3))
    d.begin(0, [1, 2, 3, 4, 5])
    assert draft(d, [7, 1], 2, seq=999) == [3, 4, 5]
    assert d.table.nbytes == 16 * 2**20   # one table for every sequence: its size does not grow with n_seq
    assert NgramMod(n_seq=1, params=NgramModParams(n_match=2, n_min=0, n_max=3)).table.nbytes == d.table.nbytes


def test_brief_usage():
    prompt = list(range(1000, 1100)) * 2
    d = NgramMod(n_seq=2, params=NgramModParams())
    d.begin(0, prompt)
    x = 1000  # the loop goes on
    dps = [DraftParams(), DraftParams(drafting=True, prompt=prompt, id_last=x, n_max=-1)]
    d.draft(dps)
    assert dps[1].result == list(range(1001, 1065))


# ------------------------------------------------------------------------------------ against the port
def test_random_sessions_against_reference():
    rng = np.random.default_rng(5)
    for trial in range(30):
        size = int(rng.choice([64, 256, 4096]))
        n = int(rng.integers(1, 5))
        n_min = int(rng.integers(0, 4))
        n_max = int(rng.integers(1, 8))
        n_seq = 2
        d = make(n_seq=n_seq, size=size, n_match=n, n_min=n_min, n_max=n_max)
        r = RefMod(n_seq, n, n_min, n_max, size)
        vocab = int(rng.integers(2, 40))
        # tokens may be negative (sign extension) but never -1, which would read as an empty entry
        tok = lambda k: [t if t != -1 else -2 for t in rng.integers(-3, vocab, k).tolist()]  # noqa: E731
        hists = [tok(int(rng.integers(0, 60))) for _ in range(n_seq)]
        for s in range(n_seq):
            d.begin(s, hists[s])
            r.begin(s, hists[s])
        for step in range(60):
            s = int(rng.integers(0, n_seq))
            id_last = tok(1)[0]
            prompt = hists[s] if step % 2 else np.array(hists[s], dtype=np.int32)
            got = draft(d, prompt, id_last, seq=s)
            assert got == r.draft(s, hists[s], id_last), (trial, step)
            n_acc = int(rng.integers(0, len(got) + 1))
            d.accept(s, n_acc, False)
            r.accept(s, n_acc, False)
            assert (d.used, d.i_last, d.n_draft_last, d.n_low) == (r.used, r.i_last, r.n_draft_last, r.n_low)
            assert table_dict(d) == r.table
            hists[s] = hists[s] + [id_last] + tok(int(rng.integers(0, 40)))
            if rng.random() < 0.1:
                hists[s] = hists[s][: int(rng.integers(0, len(hists[s]) + 1))]
                d.begin(s, hists[s])
                r.begin(s, hists[s])
