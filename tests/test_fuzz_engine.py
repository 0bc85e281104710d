"""Property-based fuzzing of :class:`~llamaspec.engine.Engine` (Hypothesis) on the tiny random models.

Each example is a mix of requests (text or token prompts: empty, repetitive, up to and past the context, with
special-token markers and lone surrogates; ``n_predict`` 0 / 1 / -1 / large / invalid; greedy or sampled with
top-k/p, min-p, seeds, penalties, logit biases and grammars (also ones that end where the tiny models have no
end token); stop strings, also ones that span tokens; one invalid field now and then; per-request speculative
settings; a cancel at a random step; a pinned slot), submitted at random steps to one engine of each spec type
(none, draft-simple, ngram-simple, ngram-mod with a prompt cache, auto) with 2 or 3 slots, and driven by
``engine.step()`` with a step budget. Properties:

* ``submit`` raises :class:`UsageError` exactly for the invalid requests and nothing else ever escapes;
* every request ends within the budget (no hang), with stop / length / abort (error: never, on these
  models; it would carry its message), a stop only at one of its stop strings (none of which is in the text)
  or at its grammar's end;
* a greedy request gives the tokens of the same request run alone on a plain engine (a cancelled one a prefix
  of them), up to a near-tie (``helpers.divergence_is_near_tie``);
* afterwards every slot is free, no sequence is left in memory (but a prompt cache) and a further request
  gives its usual output.

The in-suite run is bounded (``FUZZ_EXAMPLES`` examples, a few seconds); ``LLAMASPEC_FUZZ_EXAMPLES=N`` (or
``scripts/fuzz.py``) runs more.
"""
from __future__ import annotations

import dataclasses
import os

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from llamaspec import _llama as L  # noqa: E402
from llamaspec.engine import Engine, FinishReason, SlotState  # noqa: E402
from llamaspec.errors import UsageError  # noqa: E402
from llamaspec.params import RequestSpec, SpecParams  # noqa: E402
from llamaspec.options import RequestOptions

from helpers import EXACT, divergence_is_near_tie  # noqa: E402

#: examples per property: a fixed, derandomized set in the suite; ``LLAMASPEC_FUZZ_EXAMPLES=N``: N random ones
FUZZ_EXAMPLES = int(os.environ.get("LLAMASPEC_FUZZ_EXAMPLES", "120"))
FIXED = "LLAMASPEC_FUZZ_EXAMPLES" not in os.environ
N_VOCAB, N_CTX, N_BATCH = 64, 256, 32  # the tiny models' vocabulary and training context
#: spec type -> (slots, uses the draft model, prompt cache)
KINDS = {"none": (2, False, False), "draft-simple": (3, True, False), "ngram-simple": (2, False, False),
         "ngram-mod": (3, False, True), "auto": (2, True, False)}
#: what the fuzz run exercised, over all examples (test_fuzz_exercised_the_paths checks it)
SEEN = {"examples": 0, "drafted": 0, "accepted": 0, "cancelled": 0, "stopped": 0, "grammar_end": 0, "rejected": 0,
        "greedy": 0}


def _spec(kind: str) -> SpecParams:
    p = SpecParams()
    if kind != "none":
        p.add_types(kind)
    p.draft.n_max = 4
    p.draft_adaptive = False  # tiny models: the adaptive length would stop drafting
    p.ngram_simple.size_n, p.ngram_simple.size_m = 2, 8  # short n-grams: random prompts repeat them
    p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 4, 2, 8
    return p


@pytest.fixture(scope="module")
def engines(tiny_model):
    built: dict[str, Engine] = {}

    def get(kind: str) -> Engine:
        if kind not in built:
            n_par, draft, cache = KINDS[kind]
            built[kind] = Engine(tiny_model("llama"), draft=tiny_model("llama-draft") if draft else None,
                                 spec=_spec(kind), n_ctx=N_CTX, n_parallel=n_par, n_batch=N_BATCH, n_threads=1,
                                 cache_prompt=cache, **EXACT)
        return built[kind]

    yield get
    for e in built.values():
        e.close()


@pytest.fixture(scope="module")
def alone(tiny_model):
    """``alone(tokens, n_predict, sampling, stop)`` -> (tokens, text, finish reason) of that request run by itself
    on a one-slot plain engine (cached)."""
    eng = Engine(tiny_model("llama"), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1, **EXACT)
    cache: dict = {}

    def get(tokens, n_predict, sampling, stop):
        key = (tuple(tokens), n_predict, repr(sampling), tuple(stop))
        if key not in cache:
            r = eng.generate(list(tokens), n_predict=n_predict, sampling=sampling, stop=stop)
            cache[key] = (r.tokens, r.text, r.finish_reason)
        return cache[key]

    yield get
    eng.close()


# ------------------------------------------------------------------------------------------- strategies
HEX = "0123456789abcdef"  # the tiny vocabulary's pieces are token ids in hex: "a", "3f" (a stop may span two)
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "tok_1", "\n"]


def _pattern(p: list[int], n: int) -> list[int]:
    return (p * (n // len(p) + 1))[:n]


token_prompts = st.one_of(
    st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=40),  # random
    st.builds(_pattern, st.lists(st.integers(0, N_VOCAB - 1), min_size=1, max_size=6),  # repetitive: n-grams draft
              st.one_of(st.integers(1, 60), st.integers(N_CTX - 12, N_CTX - 1))),  # ... up to the context
)
text_prompts = st.one_of(
    st.text(min_size=1, max_size=80),  # any unicode
    st.lists(st.sampled_from(SPECIALS + ["hello ", "é", "\u2603"]), min_size=1, max_size=12).map("".join),
    st.integers(100, 1200).map(lambda n: "".join(HEX[(i * 7) % 16] for i in range(n))),  # long, repetitive
)
#: grammars over the hex pieces: one that ends after one token (the tiny models have no end token), bounded ones
GRAMMARS = ['root ::= "a" | "b"', "root ::= [0-9a-f]{2,12}", 'root ::= ("1" | "2" | "3f")+', 'root ::= "10" [0-9]*']
n_predicts = st.one_of(st.sampled_from([0, 1, -1, 10 ** 6]), st.integers(2, 40))
stops = st.lists(st.one_of(st.text(alphabet=HEX, min_size=1, max_size=4), st.sampled_from(["", "é", "\u2603", "zz"])),
                 max_size=3)


@st.composite
def samplings(draw) -> L.SamplingParams:
    return L.SamplingParams(
        temp=draw(st.sampled_from([0.0, 0.0, 0.7])),
        top_k=draw(st.integers(0, N_VOCAB + 2)),
        top_p=draw(st.floats(0.0, 1.0)),
        min_p=draw(st.floats(0.0, 1.0)),
        repeat_penalty=draw(st.sampled_from([1.0, 1.0, 1.1, 1.5])),
        repeat_last_n=draw(st.sampled_from([64, -1, 0, 8, N_CTX])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.5, -0.5])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])),
        seed=draw(st.one_of(st.integers(0, 0xFFFFFFFF), st.just(L.DEFAULT_SEED))),
        grammar=draw(st.sampled_from([None] * 12 + GRAMMARS)),
        logit_bias=tuple(draw(st.lists(st.tuples(st.integers(0, N_VOCAB - 1),
                                                 st.sampled_from([float("-inf"), -3.0, 2.0, 50.0])), max_size=3))),
        ignore_eos=draw(st.booleans()),
    )


specs = st.one_of(st.none(), st.builds(
    RequestSpec, n_max=st.one_of(st.none(), st.integers(0, 4)), n_min=st.one_of(st.none(), st.integers(0, 4)),
    p_min=st.one_of(st.none(), st.floats(0.0, 1.0)), verify=st.sampled_from([None, "match", "rejection"])))

#: one invalid field (``submit`` must refuse it with a UsageError): (what, value)
CORRUPTIONS = [("prompt", []), ("prompt", ""), ("prompt", [1, 2, -1]), ("prompt", [3, N_VOCAB]),
               ("prompt", [7] * N_CTX), ("prompt", [7] * (N_CTX + 5)), ("prompt", "ab\ud800cd"),
               ("prompt", "\udfff"), ("n_predict", -2), ("id_slot", -2), ("id_slot", 3),
               ("top_k", -1), ("top_p", 1.5), ("top_p", -0.1), ("min_p", 2.0), ("repeat_penalty", 0.0),
               ("repeat_penalty", -1.0), ("repeat_last_n", -2), ("repeat_last_n", N_CTX + 1), ("seed", -1),
               ("seed", 1 << 32), ("spec.n_max", -1), ("spec.n_max", 100), ("spec.n_min", -1), ("spec.p_min", 1.5),
               ("spec.p_min", -0.5), ("spec.verify", "bogus")]


@dataclasses.dataclass
class Plan:
    prompt: object  # str | list[int]
    parse_special: bool
    n_predict: int
    sampling: L.SamplingParams
    stop: list
    speculative: RequestSpec | None
    id_slot: int
    submit_at: int
    cancel_after: int | None


def _corrupt(plan: Plan, what: tuple | None) -> Plan:
    if what is None:
        return plan
    name, v = what
    if name in ("prompt", "n_predict", "id_slot"):
        setattr(plan, name, v)
    elif name.startswith("spec."):
        plan.speculative = dataclasses.replace(plan.speculative or RequestSpec(), **{name[5:]: v})
    else:
        plan.sampling = dataclasses.replace(plan.sampling, **{name: v})
    return plan


plans = st.builds(_corrupt, st.builds(
    Plan, st.one_of(token_prompts, text_prompts), st.booleans(), n_predicts, samplings(), stops, specs,
    st.one_of(st.just(-1), st.just(-1), st.integers(-1, 2)), st.integers(0, 6),
    st.one_of(st.none(), st.none(), st.integers(0, 30))),
    st.one_of(st.none(), st.none(), st.none(), st.sampled_from(CORRUPTIONS)))


# ------------------------------------------------------------------------------------------- the oracle
def invalid_reason(plan: Plan, eng: Engine) -> str | None:
    """Why ``submit`` must refuse ``plan`` (None: it must accept it); the tokens are ``plan``'s once valid."""
    if isinstance(plan.prompt, str):
        if any(0xD800 <= ord(c) <= 0xDFFF for c in plan.prompt):
            return "lone surrogate"
        tokens = eng.vocab.tokenize(plan.prompt, parse_special=plan.parse_special)
    else:
        tokens = plan.prompt
    sp, n_max = plan.sampling, (eng.chain.n_max if eng.chain is not None else 0)
    rs = plan.speculative
    checks = [
        (not tokens, "empty prompt"), (any(not 0 <= t < N_VOCAB for t in tokens), "token id"),
        (len(tokens) >= eng.n_ctx_seq, "context"), (plan.n_predict < -1, "n_predict"),
        (not -1 <= plan.id_slot < eng.n_parallel, "id_slot"),
        (rs is not None and rs.n_max is not None and not 0 <= rs.n_max <= n_max, "speculative.n_max"),
        (rs is not None and rs.n_min is not None and rs.n_min < 0, "speculative.n_min"),
        (rs is not None and rs.p_min is not None and not 0 <= rs.p_min <= 1, "speculative.p_min"),
        (rs is not None and rs.verify not in (None, "match", "rejection"), "speculative.verify"),
        (not -1 <= sp.repeat_last_n <= eng.n_ctx_seq, "repeat_last_n"),
        (sp.top_k < 0, "top-k"), (not 0 <= sp.top_p <= 1, "top-p"), (not 0 <= sp.min_p <= 1, "min-p"),
        (sp.repeat_penalty <= 0, "repeat-penalty"), (not 0 <= sp.seed <= 0xFFFFFFFF, "seed"),
    ]
    return next((why for bad, why in checks if bad), None)


def drain(eng: Engine, reqs) -> None:
    """Cancel what an example left running (it failed half-way), so that the next one starts on an idle engine."""
    for r in reqs:
        if not r.done:
            r.cancel()
    for _ in range(100):
        if not eng.scheduler.has_work():
            return
        eng.step()


def run_mix(eng: Engine, plans_: list[Plan]) -> list[tuple[Plan, object, int | None]]:
    """Submit and cancel as planned, step until every request ends; ``(plan, request, cancel step)`` each."""
    live: list[tuple[Plan, object, int | None]] = []
    try:
        _drive(eng, plans_, live)
    except BaseException:
        drain(eng, [r for _, r, _ in live])
        raise
    return live


def _drive(eng: Engine, plans_: list[Plan], live: list) -> None:
    todo = sorted(plans_, key=lambda p: p.submit_at)
    # every round emits >= 1 token per generating slot or decodes a prompt chunk: a generous bound
    budget = 10 + max(p.submit_at for p in plans_) + sum(N_CTX + N_CTX // N_BATCH + 4 for _ in plans_)
    step = 0
    while todo or any(not r.done for _, r, _ in live):
        while todo and todo[0].submit_at <= step:
            p = todo.pop(0)
            why = invalid_reason(p, eng)
            try:
                req = eng.submit(p.prompt, RequestOptions(
                    n_predict=p.n_predict, sampling=p.sampling, stop=p.stop, parse_special=p.parse_special,
                    speculative=p.speculative, id_slot=p.id_slot))
            except UsageError as e:
                assert why is not None, f"a valid request was refused: {e} ({p})"
                assert str(e), "a UsageError without a message"
                SEEN["rejected"] += 1
                continue
            assert why is None, f"an invalid request ({why}) was accepted: {p}"
            live.append((p, req, None if p.cancel_after is None else step + p.cancel_after))
        for p, r, at in live:
            if at == step and not r.done:
                r.cancel()
        ids = {r.id for _, r, _ in live}
        for ch in eng.step():  # nothing escapes a step
            assert ch.request_id in ids
        step += 1
        assert step <= budget, f"no end after {budget} steps: {[r for _, r, _ in live if not r.done]}"


def check_request(p: Plan, r, cancelled_at: int | None, alone, model) -> None:
    assert r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT, FinishReason.ERROR)
    if r.finish_reason is FinishReason.ERROR:
        assert r.error, "an error without a message"
        pytest.fail(f"request failed on a tiny model: {r.error} ({p})")
    if cancelled_at is None:
        assert r.finish_reason is not FinishReason.ABORT, p
    else:
        SEEN["cancelled"] += 1
    stop = [s for s in p.stop if s]
    assert not any(s in r.text for s in stop), (r.text, stop)
    if r.finish_reason is FinishReason.STOP:  # the tiny models have no end token: a stop string or a grammar's end
        if r.stop_type == "eos":
            assert r.options.sampling.grammar is not None, "an end-of-generation stop without an end token or a grammar"
            SEEN["grammar_end"] += 1
        else:
            assert r.stop_type == "word" and r.stopping_word in stop, (r.stop_type, r.stopping_word, stop)
            SEEN["stopped"] += 1
    if p.n_predict >= 0:
        assert len(r.tokens) <= p.n_predict
    if r.finish_reason is FinishReason.LENGTH:
        assert len(r.tokens) == p.n_predict or len(r.prompt_tokens) + len(r.tokens) >= N_CTX - 1, \
            (len(r.prompt_tokens), len(r.tokens), p.n_predict)
    SEEN["drafted"] += r.stats.n_drafted
    SEEN["accepted"] += r.stats.n_accepted
    if not r.options.sampling.greedy:
        return
    SEEN["greedy"] += 1
    ref_tokens, ref_text, ref_reason = alone(r.prompt_tokens, p.n_predict, r.options.sampling, p.stop)
    if cancelled_at is not None and r.finish_reason is FinishReason.ABORT:
        assert len(r.tokens) <= len(ref_tokens)
        ok, why = (True, "") if r.tokens == ref_tokens[:len(r.tokens)] else divergence_is_near_tie(
            model, r.prompt_tokens, ref_tokens, r.tokens, sampling=r.options.sampling, **EXACT)
        assert ok, f"cancelled greedy request is no prefix of its output alone: {why} ({p})"
        return
    if r.tokens != ref_tokens:
        ok, why = divergence_is_near_tie(model, r.prompt_tokens, ref_tokens, r.tokens, sampling=r.sampling,
                                         **EXACT)
        assert ok, f"greedy output differs from the request alone (plain): {why} ({p})"
        return
    assert (r.text, r.finish_reason) == (ref_text, ref_reason), p


def check_nothing_leaked(eng: Engine, kind: str, alone) -> None:
    sched = eng.scheduler
    assert not sched.has_work() and not sched.active
    assert all(s.state in (SlotState.IDLE, SlotState.DONE) and s.sampler is None for s in eng.slots)
    for s in eng.slots:
        assert eng.ctx.memory.pos_max(s.seq_id) <= len(s.cached) - 1, "a sequence was left in memory"
        if eng.ctx_dft is not None:
            assert eng.ctx_dft.memory.pos_max(s.seq_id) <= len(s.cached) - 1
    probe = [5, 9, 13, 5, 9, 13, 21]  # a further request still gives its usual output
    greedy = L.SamplingParams(temp=0.0)
    got = eng.generate(probe, n_predict=12, sampling=greedy)
    ref = alone(probe, 12, greedy, [])
    assert got.tokens == ref[0] and got.finish_reason is FinishReason.LENGTH, kind


# ------------------------------------------------------------------------------------------- the properties
@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=FIXED, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(kind=st.sampled_from(sorted(KINDS)), mix=st.lists(plans, min_size=1, max_size=5))
def test_request_mixes(engines, alone, tiny_model, kind, mix):
    eng = engines(kind)
    assert not eng.scheduler.has_work(), "an earlier example left work behind"
    live = run_mix(eng, mix)
    try:
        for p, r, at in live:
            check_request(p, r, at, alone, tiny_model("llama"))
        check_nothing_leaked(eng, kind, alone)
    finally:
        drain(eng, [r for _, r, _ in live])
    SEEN["examples"] += 1


def test_fuzz_exercised_the_paths():
    """The fuzz run above drafted, accepted, cancelled, stopped at stop strings and refused bad input: its
    properties were checked on those paths, not only on plain decoding (testing-notes.md §2)."""
    if SEEN["examples"] == 0:
        pytest.skip("test_request_mixes did not run in this session")
    assert all(SEEN[k] > 0 for k in SEEN), SEEN

