"""``--spec-type auto`` and llamaspec's own ``ngram-lookup`` drafter (issue 12 items 3 and 4).

Pure parts first (the index against a plain scan, the length / gating maths with fake costs), then the
engine on tiny models (greedy output equals plain; auto drafts with n-grams on copy text and stays quiet
where nothing matches), then the CLI default.
"""
from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from llamaspec import catch_up
from llamaspec.cli.main import main
from llamaspec.auto import AUTO_NGRAM_K_START, AutoChain, GatedDrafter, SlotGate
from llamaspec.drafters.base import DraftParams, Drafter
from llamaspec.drafters.ngram_lookup import NgramLookup, NgramLookupParams, best_length_table, default_verify_cost
from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.params import SpecParams, SpecType

from helpers import EXACT


def lookup_draft(seq: list[int], key_max: int, n: int) -> list[int]:
    """Reference of the drafter's lookup (a plain scan): the longest suffix of ``seq`` of at most ``key_max``
    tokens that occurred before, at its most recent place, and ``n`` tokens of what followed it (overlapping
    copy)."""
    L = len(seq)
    best_e, best_k = -1, 0
    for k in range(1, min(key_max, L - 1) + 1):
        suf = list(seq[L - k:])
        e = next((e for e in range(L - 2, k - 2, -1) if list(seq[e - k + 1: e + 1]) == suf), -1)
        if e < 0:
            break
        best_e, best_k = e, k
    if best_k == 0:
        return []
    out = list(seq)
    src = best_e + 1
    for _ in range(n):
        out.append(out[src])
        src += 1
    return out[L:]


def expected_len(p1: float, q: float, k: int) -> float:
    """``E(k) = 1 + p1 (1 + q + ... + q^(k-1))``, tokens per round with a draft of k tokens."""
    if k <= 0:
        return 1.0
    if q >= 1.0:
        return 1.0 + p1 * k
    return 1.0 + p1 * (1.0 - q ** k) / (1.0 - q)


def best_length(p1: float, q: float, k_max: int, verify_cost, floor: float = 1.0) -> int:
    """Reference of ``best_length_table``: the ``k`` in ``0..k_max`` with the most ``expected_len`` per unit of
    ``verify_cost(k)``, above ``floor`` (0: do not draft)."""
    best_k, best = 0, max(floor, 1.0 / max(verify_cost(0), 1e-9))
    for k in range(1, k_max + 1):
        val = expected_len(p1, q, k) / max(verify_cost(k), 1e-9)
        if val > best * (1 + 1e-6):
            best_k, best = k, val
    return best_k


def fixed(n_max: int = 12, key_max: int = 4) -> NgramLookupParams:
    return NgramLookupParams(n_max=n_max, key_max=key_max, adaptive=False)


def one_draft(d: NgramLookup, hist: list[int], id_last: int, n_max: int) -> list[int]:
    dp = DraftParams(drafting=True, n_max=n_max, prompt=tuple(hist), id_last=id_last)
    d.draft([dp])
    return dp.result


# -- the index ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_index_equals_plain_scan(seed):
    """Built at once, or grown token by token: the draft is the reference scan's (longest suffix, most recent
    place, overlapping copy)."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 40])
    seq = [rng.randrange(vocab) for _ in range(rng.randrange(20, 120))]
    grown = NgramLookup(1, fixed())
    grown.begin(0, seq[:5])
    for L in range(6, len(seq)):
        hist, id_last = seq[: L - 1], seq[L - 1]
        want = lookup_draft(seq[:L], 4, 12)
        assert one_draft(grown, hist, id_last, 12) == want, (seed, L)
        fresh = NgramLookup(1, fixed())
        fresh.begin(0, hist)
        assert one_draft(fresh, hist, id_last, 12) == want, (seed, L)


def test_index_rebuilds_when_history_changes():
    d = NgramLookup(1, fixed())
    d.begin(0, [1, 2, 3, 4, 1, 2])
    assert one_draft(d, [1, 2, 3, 4, 1, 2], 3, 3) == [4, 1, 2]
    # another request in the same slot without begin (e.g. after a reset): the index follows the history
    assert one_draft(d, [9, 8, 7, 9], 8, 3) == [7, 9, 8]


def test_no_match_and_caps():
    d = NgramLookup(1, fixed(n_max=5))
    d.begin(0, [1, 2, 3])
    assert one_draft(d, [1, 2, 3], 4, 5) == []            # 4 never occurred
    assert d.skips["no-match"] == 1
    assert one_draft(d, [1, 2, 3, 1], 2, 2) == [3, 1]      # dp.n_max caps the draft
    assert len(one_draft(d, [1, 1, 1, 1], 1, 50)) == 5     # the drafter's own n_max caps it too


# -- the maths ------------------------------------------------------------------------------------------

def test_expected_len_and_best_length():
    assert expected_len(1.0, 1.0, 5) == 6.0
    assert (expected_len(0.5, 1.0, 4), expected_len(1.0, 0.5, 2), expected_len(0.9, 0.9, 0)) == (3.0, 2.5, 1.0)
    flat = lambda k: 1.0 + 0.01 * k  # noqa: E731 - a GPU-like flat verify cost: long drafts pay early
    steep = lambda k: 1.0 + 0.5 * k  # noqa: E731 - every row costs half a decode: only sure drafts pay
    assert best_length(0.9, 0.95, 32, flat) == 32
    assert best_length(0.3, 0.5, 32, steep) == 0
    assert 0 < best_length(0.95, 0.9, 32, steep) < 8
    # a floor (the draft model's measured gain) raises the bar
    assert best_length(0.5, 0.7, 16, default_verify_cost) > 0
    assert best_length(0.5, 0.7, 16, default_verify_cost, floor=2.0) == 0
    assert lookup_draft([1, 2, 3, 9, 1, 2], 3, 3) == [3, 9, 1] and lookup_draft([1, 2, 3], 3, 3) == []


@pytest.mark.parametrize("cost", [default_verify_cost, lambda k: 1.0 + 0.01 * k, lambda k: 1.0 + 0.5 * k])
def test_best_length_table_equals_reference(cost):
    vt = [cost(k) for k in range(33)]
    for p in (0.1, 0.3, 0.6, 0.9):
        for q in (0.3, 0.7, 0.95, 1.0):
            for floor in (1.0, 2.0):
                assert best_length_table(p, q, vt, 32, floor) == best_length(p, q, 32, cost, floor), (p, q, floor)


def test_lookup_learns_to_stop_and_explores():
    """Every draft rejected: after a few rounds the drafter stops drafting that kind of match, and now and
    then tries a short draft to look again."""
    p = NgramLookupParams(n_max=16, key_max=4, explore_every=8)
    d = NgramLookup(1, p)
    hist = [1, 2, 3, 4, 5, 6, 7] * 4
    d.begin(0, hist)
    sizes = []
    for _ in range(80):
        r = one_draft(d, hist, 1, 16)
        sizes.append(len(r))
        d.accept(0, 0, False)
    assert sizes[0] > 0
    assert sizes[-40:].count(0) >= 36              # mostly off
    assert 0 < max(sizes[-40:]) <= 2               # the exploration drafts are short
    assert d.skips["not-paying"] > 0 and d.n_explore > 0
    tries = [i for i, n in enumerate(sizes) if n and i > sizes.index(0)]  # the looks after it stopped
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]   # failed looks: the next one waits longer


def test_lookup_drafts_long_while_the_copy_runs():
    d = NgramLookup(1, NgramLookupParams(n_max=32, key_max=8))
    text = list(range(100, 300))
    hist, id_last = text + text[:10], text[10]
    d.begin(0, hist)
    lens = []
    while len(hist) + 34 < 2 * len(text):
        r = one_draft(d, hist, id_last, 32)
        assert r == text[len(hist) - len(text) + 1:][:len(r)]
        lens.append(len(r))
        d.accept(0, len(r), False)  # all accepted; the target's own token follows
        hist = hist + [id_last] + r
        id_last = text[len(hist) - len(text)]
    assert lens[0] > 0 and lens[-1] >= 16


def test_lookup_slow_start():
    """``k_start``: a slot's first draft is short; each draft accepted whole doubles the limit, one that loses
    more than half halves it (not below k_start); a new request starts short again."""
    d = NgramLookup(1, NgramLookupParams(n_max=32, key_max=8, k_start=4))
    text = list(range(100, 400))
    hist, id_last = text + text[:10], text[10]
    d.begin(0, hist)
    lens = []
    for _ in range(4):
        r = one_draft(d, hist, id_last, 32)
        lens.append(len(r))
        d.accept(0, len(r), False)
        hist = hist + [id_last] + r
        id_last = text[len(hist) - len(text)]
    assert lens == [4, 8, 16, 32]
    r = one_draft(d, hist, id_last, 32)
    d.accept(0, 3, False)  # lost more than half
    assert len(r) == 32 and d._slots[0].k_lim == 16
    d.begin(0, hist)
    assert len(one_draft(d, hist, id_last, 32)) == 4
    assert len(one_draft(NgramLookup(1, NgramLookupParams(n_max=32, key_max=8)), hist, id_last, 32)) > 4  # k_start 0: no limit


# -- the gate -------------------------------------------------------------------------------------------

class FakeDraft(Drafter):
    """Drafts ``k`` tokens for every asking slot (what they are does not matter to the gate)."""

    type = "draft-simple"

    def __init__(self, n_seq: int, k: int = 3):
        super().__init__(n_seq)
        self.n_max = k
        self.asked = 0

    def draft(self, params):
        for dp in params:
            if dp.drafting:
                self.asked += 1
                dp.result.extend([7] * self.n_max)


def run_gate(n_accepted: int, rounds: int, verify_ms: dict[int, float], draft_ms: float = 0.0):
    """The auto chain with a fake drafter: every round it drafts, the target "accepts" ``n_accepted``."""
    inner = FakeDraft(1)
    lookup = NgramLookup(1, NgramLookupParams())
    chain = AutoChain(lookup, inner, 1)
    gated = chain.gated
    assert isinstance(gated, GatedDrafter) and chain.impls == [lookup, gated]
    for rows, ms in verify_ms.items():
        chain.cost.add_decode(rows, ms)
    drafted = []
    for _ in range(rounds):
        dp = chain.dparams[0]
        dp.drafting, dp.n_max, dp.prompt, dp.id_last, dp.result = True, 8, (1, 2, 3), 4, []
        chain.draft()
        inner.stats.t_draft_us += int(draft_ms * 1e3 * len(dp.result))
        if dp.result and gated._step_ms:  # the step's time as if drafting took draft_ms per token
            gated._step_ms[-1] = draft_ms
        drafted.append(len(dp.result))
        if dp.result:  # the engine tells the chain only about rounds with a draft
            chain.accept(0, min(n_accepted, len(dp.result)))
    return gated, drafted


def test_gate_passes_the_draft_models_catch_up_time_on():
    """The engine prices a draft without the time the draft model spent catching its context up; behind the
    auto gate that time is the inner drafter's, and the chain resets it for each draft."""

    class CatchingUp(FakeDraft):
        def draft(self, params):
            self.catch_up_ms = 40.0
            super().draft(params)

    inner = CatchingUp(1)
    chain = AutoChain(NgramLookup(1, NgramLookupParams()), inner, 1)
    dp = chain.dparams[0]
    dp.drafting, dp.n_max, dp.prompt, dp.id_last, dp.result = True, 8, (1, 2, 3), 4, []
    chain.draft()
    assert dp.result and chain.catch_up_ms() == 40.0
    inner.draft = lambda params: FakeDraft.draft(inner, params)  # a draft that needs no catching up
    dp.drafting, dp.result = True, []
    chain.draft()
    assert dp.result and chain.catch_up_ms() == 0.0


def test_a_step_that_only_caught_up_is_not_recorded_as_a_drafting_step():
    """A drafter that caught its context up and could time no drafting step of its own (``last_step_ms`` None)
    records no step: its whole time priced the draft at 8 one-row target decodes once (a 98-token prompt caught
    up with a one-token draft), so no draft length paid and the request never drafted again. A drafter that
    times nothing and caught nothing up still records its time per step."""

    class Untimed(FakeDraft):
        last_step_ms = None

        def __init__(self, n_seq, catch_up):
            super().__init__(n_seq, k=1)
            self.catch_up = catch_up

        def draft(self, params):
            self.catch_up_ms = self.catch_up
            super().draft(params)

    for catch_up, recorded in ((300.0, 0), (0.0, 1)):
        chain = AutoChain(NgramLookup(1, NgramLookupParams()), Untimed(1, catch_up), 1)
        dp = chain.dparams[0]
        dp.drafting, dp.n_max, dp.prompt, dp.id_last, dp.result = True, 8, (1, 2, 3), 4, []
        chain.draft()
        assert dp.result == [7] and len(chain.gated._step_ms) == recorded, catch_up


def test_gate_switches_a_losing_drafter_off_and_retries():
    gated, drafted = run_gate(0, 60, {1: 10.0, 4: 16.0})
    assert gated.n_gate_off >= 1
    first_off = drafted.index(0)
    assert 3 <= first_off <= 5                     # judged after min_rounds
    assert drafted[first_off: first_off + 8] == [0] * 8
    assert drafted[first_off + 8] == 3             # retried after the back-off
    assert drafted.count(0) > 40                   # and the back-off grows
    assert gated.n_gated == drafted.count(0)


def test_gate_starts_fresh_for_a_new_request():
    gated, drafted = run_gate(0, 6, {1: 10.0, 4: 16.0})
    assert drafted[-1] == 0 and gated.gates[0].off_rounds > 0
    gated.begin(0, [1, 2, 3])
    assert gated.gates[0].off_rounds == 0 and gated.gates[0].n_rounds == 0


def test_gate_expected_gain_before_a_slot_measures():
    """A new request's slot has no measure of its own: the floor the n-gram draft must beat is the drafter's
    gain over every slot so far (not 1, which any n-gram draft beats), and 1 while it is switched off."""
    gated, _ = run_gate(3, 30, {1: 10.0, 4: 12.0}, draft_ms=1.0)
    own = gated.expected_gain(0)
    gated.begin(0, [1, 2, 3])
    assert gated.gates[0].n_rounds == 0
    assert gated.expected_gain(0) == pytest.approx(gated.overall.gain(gated.round_cost)) and gated.expected_gain(0) > 1.5
    assert abs(gated.expected_gain(0) - own) < 0.5
    gated.gates[0].off_rounds = 4
    assert gated.expected_gain(0) == 1.0
    fresh, _ = run_gate(3, 0, {1: 10.0, 4: 12.0})
    assert fresh.expected_gain(0) == 1.0   # nothing measured yet


def test_gate_keeps_a_paying_drafter():
    gated, drafted = run_gate(3, 30, {1: 10.0, 4: 12.0}, draft_ms=1.0)
    assert gated.n_gate_off == 0 and all(n == 3 for n in drafted)
    assert gated.last_gain > 1.5


def test_gate_counts_draft_cost():
    """Accepting everything is still a loss when drafting costs more than it saves."""
    gated, _ = run_gate(3, 30, {1: 10.0, 4: 12.0}, draft_ms=12.0)
    assert gated.n_gate_off >= 1


def test_slot_gate():
    g = SlotGate()
    for _ in range(3):
        g.record(4.0, 3)
    assert g.gain(lambda k: 1.5) > 2 and not g.should_stop(3, 0.03, lambda k: 1.5)


def test_gate_back_off_is_bounded():
    """A drafter that keeps losing is retried at least every ``backoff_max`` (32) rounds: when the slow
    window ends, it is back within that many rounds."""
    gated, drafted = run_gate(0, 200, {1: 10.0, 4: 16.0})
    runs, n = [], 0
    for k in drafted:
        if k == 0:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    assert max(runs) == 32 and len(runs) >= 4


def test_gate_slow_window_does_not_erase_acceptance():
    """Acceptance and cost are kept apart: a drafter whose drafts are all accepted keeps its record through a
    window in which every draft step ran 20x slower (another process had the cores); once the steps are
    fast again, its gain is what it was, from the same acceptance sums."""
    gated, _ = run_gate(3, 12, {1: 10.0, 4: 12.0}, draft_ms=1.0)
    before = gated.expected_gain(0)
    tokens = gated.gates[0].tokens
    for _ in range(16):                      # a slow window: draft steps take 20 ms each
        gated._step_ms.append(20.0)
    slow = gated.expected_gain(0)
    for _ in range(16):                      # the load is gone
        gated._step_ms.append(1.0)
    assert slow < before
    assert gated.gates[0].tokens == tokens   # nothing about acceptance was touched
    assert gated.expected_gain(0) == pytest.approx(before, rel=0.05)


class Behind(FakeDraft):
    """A draft model whose context lacks ``behind[seq]`` committed tokens of each sequence."""

    def __init__(self, n_seq: int, behind: list[int]):
        super().__init__(n_seq, k=4)
        self.behind = behind
        self.asked_for: list[int] = []

    def pending(self, seq_id, pos0):
        return self.behind[seq_id]

    def draft(self, params):
        self.asked_for = [s for s, dp in enumerate(params) if dp.drafting]
        super().draft(params)


def ask_all(chain: AutoChain, n_gen: int, n_left: int = 64) -> list[int]:
    """One chain.draft() in a round of ``n_gen`` generating slots, every sequence asking; the seqs the draft
    model was asked for."""
    chain.n_gen = n_gen
    for s, dp in enumerate(chain.dparams):
        dp.drafting, dp.n_max, dp.prompt, dp.id_last, dp.result, dp.n_left = True, 8, (), 4, [], n_left
        dp.pos0 = 200
    chain.gated.inner.asked_for = []
    chain.draft()
    return chain.gated.inner.asked_for


def test_a_batch_does_not_catch_the_draft_model_up_where_it_cannot_pay():
    """Several slots generating: a slot whose draft context lacks its prompt drafts with the model only when
    the catch-up (it stalls the whole batch) costs less than what the model's drafts save over the tokens the
    request has left. (Stop 46: 8 new prompts on 8 slots under load caught up ~1,000 tokens in the first rounds,
    9 s against 12.5 s for the whole wave decoded plainly: 0.75 of llama-server.) A lone slot always catches up."""
    behind = [125] * 7 + [0]
    chain = AutoChain(NgramLookup(8, NgramLookupParams()), Behind(8, behind), 8)
    chain.cost.add_decode(1, 10.0)
    chain.cost.add_decode(16, 30.0)
    chain.cost.add_prompt(512, 512 * 5.0)           # a prompt row: 5 ms (the draft is the target's size)
    assert catch_up.row_ms(chain.gated) == 5.0
    assert ask_all(chain, 8) == [7]                 # nothing measured: the slot already caught up measures
    chain.gated.inner.behind = [125] * 8
    assert ask_all(chain, 8) == [0]                 # ... or the one with the least to catch up
    for _ in range(4):
        chain.gated.overall.record(4.0, 4)          # 3 of 4 drafted tokens accepted
    chain.gated.inner.behind = behind
    assert ask_all(chain, 8) == [7]                 # 625 ms of catch-up for ~7 ms saved over 64 tokens
    assert chain.gated.n_catch_up_skipped >= 7
    assert chain.gated.expected_gain(0) == 1.0      # the n-gram copies need only beat plain there
    assert ask_all(chain, 1) == list(range(8))      # a lone slot: its entry fee
    assert ask_all(chain, 2, n_left=10_000) == list(range(8))   # a long request pays it back
    chain.gated.inner.behind = [2] * 8              # a few tokens behind (plain rounds): not priced
    assert ask_all(chain, 8) == list(range(8))


def test_a_catch_up_is_priced_from_what_the_draft_model_measured():
    """The draft context's own catch-ups (time per row) replace the prior from the target's prompt rows."""

    class Measured(Behind):
        def draft(self, params):
            super().draft(params)
            self.catch_up_rows, self.catch_up_ms = 100, 50.0

    chain = AutoChain(NgramLookup(2, NgramLookupParams()), Measured(2, [0, 0]), 2)
    chain.cost.add_decode(1, 10.0)
    chain.cost.add_prompt(512, 512 * 5.0)
    assert catch_up.row_ms(chain.gated) == 5.0
    ask_all(chain, 2)
    assert catch_up.row_ms(chain.gated) == 0.5


# -- params ---------------------------------------------------------------------------------------------

def test_params_auto():
    p = SpecParams()
    p.add_types("auto")
    assert p.is_auto and p.enabled() == [SpecType.NGRAM_LOOKUP, SpecType.DRAFT_SIMPLE]
    assert p.n_max_of_types() == p.ngram_lookup.n_max
    with pytest.raises(UsageError, match="give it alone"):
        p.add_types("ngram-mod")
    with pytest.raises(UsageError, match="give it alone"):
        SpecParams().add_types("auto,ngram-simple")


# -- the engine ------------------------------------------------------------------------------------------

BASE = [5, 6, 7, 8, 9, 10, 11] * 4
PROMPTS = [BASE, BASE[3:] + [20, 21], [30, 31, 32, 33] * 5, [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3],
           list(range(36, 63))]


def auto() -> SpecParams:
    p = SpecParams()
    p.add_types("auto")
    return p


@pytest.fixture(scope="module")
def plain(tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        return [e.generate(p, n_predict=40).tokens for p in PROMPTS]


@pytest.mark.parametrize("with_draft,n_parallel", [(False, 1), (False, 3), (True, 3)])
def test_auto_greedy_equals_plain(tiny_model, plain, n_parallel, with_draft):
    draft = tiny_model("llama-draft") if with_draft else None
    with Engine(tiny_model("llama"), draft=draft, spec=auto(), n_ctx=256, n_parallel=n_parallel, **EXACT) as e:
        assert e.chain.types == (["ngram-lookup", "draft-simple"] if with_draft else ["ngram-lookup"])
        ngram = e.chain.impls[0]
        if with_draft:  # the n-gram draft must beat the draft model's expected gain, and starts short
            assert ngram.gain_floor == e.chain.impls[1].expected_gain and ngram.params.k_start == AUTO_NGRAM_K_START
        else:
            assert ngram.gain_floor(0) == 1.0 and ngram.params.k_start == 0
        rs = e.generate_many(PROMPTS, n_predict=40)
        stats = {d["type"]: d for d in e.drafter_stats()}
        lines = e.stats_lines()
    assert [r.tokens for r in rs] == plain
    assert stats["ngram-lookup"]["n_gen_tokens"] > 0           # the tiny model's loops are copy text
    assert stats["ngram-lookup"]["n_acc_tokens"] > 0
    assert "auto" in stats["ngram-lookup"] and lines[-1].startswith("auto: ngram-lookup")
    by_type: dict = {}
    for r in rs:
        for k, v in r.stats.n_accepted_by_type.items():
            by_type[k] = by_type.get(k, 0) + v
    assert by_type.get("ngram-lookup", 0) == stats["ngram-lookup"]["n_acc_tokens"]


def test_explicit_ngram_lookup_type(tiny_model, plain):
    p = SpecParams()
    p.add_types("ngram-lookup")
    with Engine(tiny_model("llama"), spec=p, n_ctx=256, **EXACT) as e:
        assert e.chain.types == ["ngram-lookup"] and not isinstance(e.chain, AutoChain)
        assert [e.generate(x, n_predict=40).tokens for x in PROMPTS] == plain


def test_auto_quiet_where_nothing_matches(tiny_model):
    """Fake history of distinct tokens: no lookup hits, no drafts, and the statistics say why."""
    with Engine(tiny_model("llama"), spec=auto(), n_ctx=256, **EXACT) as e:
        lookup = e.chain.impls[0]
        dp = DraftParams(drafting=True, n_max=16, prompt=tuple(range(1, 60)), id_last=62)
        lookup.begin(0, dp.prompt)
        lookup.draft([dp])
        assert dp.result == [] and lookup.skips["no-match"] == 1
        assert e.chain.auto_info()["ngram-lookup"]["no-match"] == 1


# -- the CLI -------------------------------------------------------------------------------------------

def test_cli_default_is_auto(tiny_model, tmp_path):
    base = ["generate", "tok_5 tok_6 tok_7 tok_5 tok_6 tok_7 tok_5 tok_6", "-m", str(tiny_model("llama")), "-n", "24",
            "--temp", "0", "-q"]
    out = {}
    for name, extra in (("default", []), ("parity", ["--spec-parity"]), ("none", ["--spec-type", "none"])):
        js = tmp_path / f"{name}.json"
        r = CliRunner().invoke(main, base + extra + ["--stats-json", str(js)])
        assert r.exit_code == 0, r.output
        out[name] = (r.stdout, json.loads(js.read_text()))
    assert out["default"][1]["spec_types"] == ["ngram-lookup"]
    assert out["parity"][1]["spec_types"] == [] and out["none"][1]["spec_types"] == []
    assert out["default"][0] == out["none"][0] == out["parity"][0]


def test_cli_auto_with_draft_model(tiny_model, tmp_path):
    js = tmp_path / "s.json"
    r = CliRunner().invoke(main, ["generate", "tok_5 tok_6 tok_7", "-m", str(tiny_model("llama")), "-md",
                                  str(tiny_model("llama-draft")), "-n", "16", "--temp", "0", "-q", "--stats-json", str(js)])
    assert r.exit_code == 0, r.output
    assert json.loads(js.read_text())["spec_types"] == ["ngram-lookup", "draft-simple"]


@pytest.mark.parametrize("flags,msg", [
    (["--spec-type", "auto,ngram-mod"], "give it alone"),
    (["--spec-type", "auto", "--spec-type", "ngram-simple"], "give it alone"),
    (["--spec-ngram-lookup-n-max", "5000"], "between 0 and 1024"),
])
def test_cli_bad_auto_flags(tiny_model, flags, msg):
    r = CliRunner().invoke(main, ["generate", "x", "-m", str(tiny_model("llama")), "-n", "4"] + flags)
    assert r.exit_code == 2, r.output
    assert msg in r.output and "Traceback" not in r.output


def test_a_copy_blocked_by_the_other_drafters_gain_is_scored_against_what_was_committed():
    """With a draft model in the chain a copy must beat the model's expected gain; a copy the drafter-wide prior
    says loses is not drafted, and without drafting it the request never learned how well the text copies
    itself. The blocked copy is kept as a shadow and scored against the tokens committed instead: as many
    accepted as agree with it (the target's next token included)."""
    text = list(range(100, 160))
    hist = text + text[:3]
    d = NgramLookup(1, NgramLookupParams(n_max=16))
    d.begin(0, hist)
    d.gain_floor = lambda seq_id: 50.0  # nothing beats this: every copy is blocked
    assert one_draft(d, hist[:-1], hist[-1], 16) == [] and d.n_shadow == 1
    st = d._slots[0]
    b, at, shadow = st.shadow
    assert at == len(hist) and shadow == text[3:3 + len(shadow)] and len(shadow) > 2
    before = st.counts.p1_n[b], st.counts.q_a[b]
    # the model's round: its draft of two tokens accepted, the target's correction differs from the copy
    hist += [text[3], text[4]]
    wrong = 7
    one_draft(d, hist, wrong, 16)
    assert st.counts.p1_n[b] == pytest.approx(before[0] * d.params.decay + 1.0)
    assert st.counts.q_a[b] == pytest.approx(before[1] * d.params.decay + 1.0)  # 2 accepted: 1 past the first


