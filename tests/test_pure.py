"""Pure functions: no llama.cpp involved."""
from __future__ import annotations

import pytest

from llamaspec._llama import SamplingParams, chunks, output_limits
from llamaspec.errors import UsageError
from llamaspec.probe import expected_speedup, recommend_draft_length, relative_verify_cost
from llamaspec.text import TextStream
from llamaspec.vocab import check_vocab_compat, incompatibility_message, is_compatible


@pytest.mark.parametrize(
    "n_batch,n_parallel,n_draft,expected",
    [
        (512, 1, 0, (1, 1)),
        (512, 1, 3, (4, 4)),
        (512, 4, 3, (16, 4)),
        (8, 4, 16, (8, 8)),
        (512, 2, -5, (2, 1)),  # negative drafts count as 0
    ],
)
def test_output_limits(n_batch, n_parallel, n_draft, expected):
    assert output_limits(n_batch, n_parallel, n_draft) == expected


@pytest.mark.parametrize(
    "seq,size,expected",
    [
        ([1, 2, 3, 4, 5], 2, [[1, 2], [3, 4], [5]]),
        ([1, 2, 3, 4], 2, [[1, 2], [3, 4]]),
        ([1, 2, 3], 8, [[1, 2, 3]]),
        ([1, 2, 3], 1, [[1], [2], [3]]),
        ([], 4, []),
        ((7, 8, 9), 2, [(7, 8), (9,)]),  # slices keep the sequence type
        ("abcde", 3, ["abc", "de"]),
    ],
)
def test_chunks(seq, size, expected):
    assert list(chunks(seq, size)) == expected


@pytest.mark.parametrize("size", [0, -1])
def test_chunks_size_checked_eagerly(size):
    with pytest.raises(ValueError, match="chunk size must be >= 1"):
        chunks([1, 2, 3], size)  # raises at the call, not at the first next()


class TestTextStream:
    def test_plain(self):
        s = TextStream()
        assert s.feed(b"Hel") + s.feed(b"lo") + s.flush() == "Hello"

    def test_split_utf8(self):
        s = TextStream()
        e = "é".encode()
        assert s.feed(e[:1]) == ""
        assert s.feed(e[1:]) == "é"

    def test_stop_string_across_tokens(self):
        s = TextStream(stop=["END"])
        out = s.feed(b"abc E") + s.feed(b"N")
        assert out == "abc "  # "EN" held back
        assert s.feed(b"D tail") == ""
        assert s.stopped and s.text == "abc " and s.stop_string == "END"

    def test_false_alarm_released(self):
        s = TextStream(stop=["END"])
        assert s.feed(b"E") == ""
        assert s.feed(b"x") == "Ex"
        assert s.flush() == ""

    def test_earliest_stop_wins(self):
        s = TextStream(stop=["b", "a"])
        s.feed(b"xxab")
        assert s.text == "xx" and s.stop_string == "a"


class _V:
    def __init__(self, n=100, vtype=1, bos=1, eos=2, add_bos=True, add_eos=False, texts=None):
        self.type, self.n_tokens, self.bos, self.eos = vtype, n, bos, eos
        self.add_bos, self.add_eos = add_bos, add_eos
        self.texts = texts or {}

    def get_text(self, t):
        return self.texts.get(t, b"t%d" % t)


class TestVocabRules:
    def test_compatible(self):
        assert is_compatible(check_vocab_compat(_V(), _V(n=228)))  # size difference 128 is allowed

    @pytest.mark.parametrize(
        "dft,rule",
        [
            (_V(vtype=2), "type"),
            (_V(add_bos=False), "bos"),
            (_V(bos=7), "bos"),
            (_V(add_eos=True), "eos"),
            (_V(n=229), "size"),
            (_V(texts={50: b"other"}), "text"),
        ],
    )
    def test_each_rule(self, dft, rule):
        res = check_vocab_compat(_V(), dft)
        assert [r.rule for r in res if not r.ok] == [rule]
        assert rule in incompatibility_message(res)

    def test_ids_below_5_not_compared(self):
        assert is_compatible(check_vocab_compat(_V(), _V(texts={4: b"x"})))

    def test_eos_ids_ignored_without_add_eos(self):
        assert is_compatible(check_vocab_compat(_V(), _V(eos=9)))


class TestSpeedupFormula:
    def test_no_draft_is_one(self):
        assert expected_speedup(0.7, 0, 0.3, 1.0) == pytest.approx(1.0)

    def test_known_value(self):
        # a=0.8, k=4, free draft, flat verify cost: (1-0.8^5)/0.2 = 3.3616
        assert expected_speedup(0.8, 4, 0.0, 1.0) == pytest.approx(3.3616)

    def test_perfect_acceptance(self):
        assert expected_speedup(1.0, 3, 0.0, 1.0) == pytest.approx(4.0)

    def test_relative_verify_cost_interpolates(self):
        curve = {1: 10.0, 2: 12.0, 4: 16.0}
        assert relative_verify_cost(curve, 3) == pytest.approx(1.4)
        assert relative_verify_cost(curve, 6) == pytest.approx(2.0)  # linear extrapolation

    def test_recommendation_grows_with_acceptance(self):
        curve = {1: 10.0, 2: 10.5, 4: 11.0, 8: 12.0, 16: 16.0}
        ks = [recommend_draft_length(a, 0.3, curve)[0] for a in (0.3, 0.6, 0.9)]
        assert ks == sorted(ks) and ks[-1] > ks[0]

    def test_expensive_draft_not_recommended(self):
        assert recommend_draft_length(0.3, 2.0, {1: 1.0, 16: 16.0}) == (0, 1.0)


class TestSamplingParams:
    @pytest.mark.parametrize(
        "kw",
        [dict(top_k=-1), dict(top_p=1.5), dict(min_p=-0.1), dict(repeat_penalty=0.0), dict(seed=2**32), dict(temp=float("nan"))],
    )
    def test_invalid(self, kw):
        with pytest.raises(UsageError):
            SamplingParams(**kw).validate()

    def test_greedy(self):
        assert SamplingParams(temp=0).greedy and not SamplingParams(temp=0.5).greedy
