"""llama-cpp-python compatibility (llamaspec.compat): ``llamaspec.Llama`` against ``llama_cpp.Llama``, and
``llamaspec.DraftModel`` inside ``llama_cpp.Llama``.

Tiny random models (fast, every run) check shapes, arguments, the seed chain and greedy equality with and
without drafts; real models (``real`` marker) check a llama-cpp-python user's program and the Gemma pair.
``llama_cpp.Llama`` is built with :func:`llamaspec._llama.lcp.load_llama` (ggml's AMX kernels crash here).
"""
from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from llamaspec import _llama as L
from llamaspec._llama.lcp import load_llama, prompt_lookup_decoding
from llamaspec.compat import CompatError, CompatWarning, DraftModel, Llama

from helpers import real_model

KW = dict(n_ctx=256, verbose=False, n_threads=1)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [10, 20, 30, 40, 10, 20, 30]]
TIE_TOL = 0.25


def text(resp) -> str:
    return resp["choices"][0]["text"]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return str(tiny_model("llama")), str(tiny_model("llama-draft"))


@pytest.fixture(scope="module")
def tiny_plain(tiny):
    ref = load_llama(tiny[0], **KW)
    out = [text(ref(p, max_tokens=32, temperature=0)) for p in PROMPTS]
    ref.close()
    return out


# -- import and arguments ---------------------------------------------------------------------------

def test_import_llamaspec_stays_light():
    code = ("import sys, llamaspec; assert 'llama_cpp' not in sys.modules and 'llamaspec.compat' not in sys.modules; "
            "from llamaspec import Llama, DraftModel; print(Llama.__module__, DraftModel.__module__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["llamaspec.compat.llama", "llamaspec.compat.draft"]


def test_unknown_kwargs_are_refused_by_name(tiny):
    with pytest.raises(TypeError, match=r"'n_ctxx'.*did you mean 'n_ctx'"):
        Llama(tiny[0], n_ctxx=128)
    with pytest.raises(TypeError, match="'frobnicate'"):
        Llama(tiny[0], frobnicate=True)


def test_unsupported_arguments_warn_or_refuse(tiny):
    with pytest.raises(CompatError, match="lora_path"):
        Llama(tiny[0], lora_path="adapter.gguf")
    with pytest.raises(ValueError, match="embedding"):  # CompatError is a ValueError, as llama_cpp raises
        Llama(tiny[0], embedding=True)
    with pytest.raises(ValueError, match="Model path does not exist"):
        Llama("/nonexistent/model.gguf")
    with pytest.warns(CompatWarning, match="yarn_ext_factor"):
        Llama(tiny[0], yarn_ext_factor=0.5, **KW).close()
    with pytest.warns(CompatWarning, match="type_k=8"):
        Llama(tiny[0], type_k=8, type_v=8, **KW).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Llama(tiny[0], type_k=0, type_v=0, use_mlock=False, offload_kqv=True, lora_path=None, **KW).close()
    llm = Llama(tiny[0], **KW)
    for bad in (dict(logprobs=-1), dict(suffix=3), dict(mirostat_mode=3)):
        with pytest.raises(CompatError, match=next(iter(bad)).split("_")[0]):
            llm(PROMPTS[0], max_tokens=2, **bad)
    llm.close()


def test_vocabulary_matches_llama_cpp(tiny):
    ref = load_llama(tiny[0], vocab_only=True, verbose=False)
    llm = Llama(tiny[0], vocab_only=True, verbose=False)
    for s in (b"hello world", b"tok_1 tok_2", b""):
        assert llm.tokenize(s) == ref.tokenize(s)
        assert llm.detokenize(ref.tokenize(s)) == ref.detokenize(ref.tokenize(s))
    assert (llm.n_vocab(), llm.token_bos(), llm.token_eos()) == (ref.n_vocab(), ref.token_bos(), ref.token_eos())
    with pytest.raises(CompatError, match="vocab_only"):
        llm("hello", max_tokens=2)
    llm.close()
    ref.close()


# -- completions ------------------------------------------------------------------------------------

def test_completion_dicts_and_stream_chunks(tiny):
    with Llama(tiny[0], **KW) as llm:
        r = llm(PROMPTS[0], max_tokens=12, temperature=0)
        assert r["object"] == "text_completion" and r["id"].startswith("cmpl-")
        assert set(r["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
        assert r["choices"][0]["finish_reason"] == "length"
        assert r["usage"] == {"prompt_tokens": 8, "completion_tokens": 12, "total_tokens": 20}
        assert r["llamaspec"]["n_predicted"] == 12 and r["llamaspec"]["speculative"] is False
        chunks = list(llm(PROMPTS[0], max_tokens=12, temperature=0, stream=True))
        assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
        assert "".join(text(c) for c in chunks) == text(r)
        assert "llamaspec" in chunks[-1]
        # stop strings: the text ends before the first one, also in a stream
        stop = text(r)[5:7]
        s = llm(PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
        assert text(s) == text(r)[: text(r).index(stop)] and s["choices"][0]["finish_reason"] == "stop"
        st = list(llm(PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True))
        assert "".join(text(c) for c in st) == text(s) and st[-1]["choices"][0]["finish_reason"] == "stop"
        # stopping_criteria sees the history before each new token and can veto it
        seen = []

        def three(ids, logits):
            seen.append(len(ids))
            return len(ids) >= 8 + 3

        c = llm(PROMPTS[0], max_tokens=12, temperature=0, stopping_criteria=three)
        assert c["usage"]["completion_tokens"] == 3 and c["choices"][0]["finish_reason"] == "stop"
        assert seen[:4] == [8, 9, 10, 11]
        e = llm("tok_1 tok_2", max_tokens=4, temperature=0, echo=True)
        assert text(e).startswith("tok_1 tok_2")
        with pytest.raises(ValueError, match="exceed context window"):
            llm(list(range(8)) * 40, max_tokens=4)


def _lp_close(a, b) -> None:
    """Two legacy ``logprobs`` objects: the same tokens, offsets and keys, log-probabilities to 1e-3."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert b["tokens"] == a["tokens"] and b["text_offset"] == a["text_offset"]
    assert [x is None for x in a["token_logprobs"]] == [y is None for y in b["token_logprobs"]]
    assert np.allclose([x for x in a["token_logprobs"] if x is not None],
                       [y for y in b["token_logprobs"] if y is not None], atol=1e-3)
    for x, y in zip(a["top_logprobs"], b["top_logprobs"]):
        assert (x is None) == (y is None) and (x is None or list(x) == list(y))


def test_stop_strings_equal_llama_cpp(tiny):
    """Stop strings split over tokens, inside one, two at once, one never met and one whose start ends the
    text (held back, then released): ``llama_cpp.Llama``'s text, finish_reason and logprobs, with ``echo``
    and in a stream (joined). The tiny vocabulary's pieces are hex numbers ('20', '27', '30', ...)."""
    ref = load_llama(tiny[0], logits_all=True, **KW)
    llm = Llama(tiny[0], **KW)
    try:
        for prompt in (PROMPTS[0], "1a2b3c"):
            full = text(ref(prompt, max_tokens=16, temperature=0))
            stops = [full[3:5], full[7:10], [full[12:14], full[6:8]], "zz", full[-1] + "zz", full[:1]]
            for stop in stops:
                # (echo with logprobs and a stop string met: llama-cpp-python lists the prompt's logprobs one
                # row off and leaves the last token out, having no row for it; not compared)
                for kw in (dict(), dict(logprobs=2), dict(echo=isinstance(prompt, str))):
                    a = ref(prompt, max_tokens=16, temperature=0, stop=stop, **kw)["choices"][0]
                    b = llm(prompt, max_tokens=16, temperature=0, stop=stop, **kw)["choices"][0]
                    assert (b["text"], b["finish_reason"]) == (a["text"], a["finish_reason"]), (prompt, stop, kw)
                    _lp_close(a["logprobs"], b["logprobs"])
                    st = [c["choices"][0] for c in llm(prompt, max_tokens=16, temperature=0, stop=stop, stream=True,
                                                       **kw)]
                    assert "".join(c["text"] for c in st) == a["text"] and st[-1]["finish_reason"] == a["finish_reason"]
                    if kw.get("logprobs") is not None:
                        got = [c["logprobs"] for c in st if c["logprobs"]]
                        assert sum((g["tokens"] for g in got), []) == b["logprobs"]["tokens"]
                        assert sum((g["text_offset"] for g in got), []) == b["logprobs"]["text_offset"]
    finally:
        llm.close()
        ref.close()


def test_stop_strings_are_the_engines(tiny, monkeypatch):
    """The engine applies ``stop``; compat reads its text and finish, and runs no second stop-string machine:
    each generated token's piece goes through one TextStream once."""
    from llamaspec.text import TextStream

    fed = []
    feed = TextStream.feed
    monkeypatch.setattr(TextStream, "feed", lambda self, piece: fed.append(piece) or feed(self, piece))
    with Llama(tiny[0], draft_model=tiny[1], **KW) as llm:
        full = text(llm(PROMPTS[0], max_tokens=16, temperature=0))
        for stream in (False, True):
            fed.clear()
            out = list(llm(PROMPTS[0], max_tokens=16, temperature=0, stop=full[7:10], stream=True)) if stream \
                else [llm(PROMPTS[0], max_tokens=16, temperature=0, stop=full[7:10])]
            n = len(llm._last_tokens[1])
            assert "".join(text(c) for c in out) == full[:7] and out[-1]["choices"][0]["finish_reason"] == "stop"
            assert len(fed) == n and b"".join(fed).decode().startswith(full[:7])


def test_sampled_outputs_follow_llama_cpp_seed_chain(tiny):
    """Same constructor seed, same calls: the same sampled text (the same chain, the same random numbers)."""
    ref = load_llama(tiny[0], seed=1234, **KW)
    llm = Llama(tiny[0], seed=1234, **KW)
    for kw in (dict(), dict(seed=7), dict(temperature=1.3, top_k=0), dict()):
        assert text(llm(PROMPTS[0], max_tokens=16, **kw)) == text(ref(PROMPTS[0], max_tokens=16, **kw)), kw
    ref.close()
    llm.close()


@pytest.mark.parametrize("draft", ["model", "prompt-lookup"])
def test_greedy_with_a_draft_equals_llama_cpp_plain(tiny, tiny_plain, draft):
    dm = tiny[1] if draft == "model" else prompt_lookup_decoding(5)
    with Llama(tiny[0], draft_model=dm, **KW) as llm:
        res = [llm(p, max_tokens=32, temperature=0) for p in PROMPTS]
    assert [text(r) for r in res] == tiny_plain
    assert all(r["llamaspec"]["speculative"] for r in res)
    assert sum(r["llamaspec"]["n_drafted"] for r in res) > 0


# -- DraftModel -------------------------------------------------------------------------------------

def test_llama_cpp_with_draft_model_equals_plain(tiny, tiny_plain):
    dm = DraftModel(tiny[1], num_pred_tokens=6, n_threads=1)
    ref = load_llama(tiny[0], draft_model=dm, **KW)
    assert [text(ref(p, max_tokens=32, temperature=0)) for p in PROMPTS] == tiny_plain
    assert dm.stats["n_drafted"] > 0 and dm.stats["n_trimmed"] > 0
    # trimmed, not re-decoded: every history token is decoded once, drafted ones at most once more
    assert dm.stats["n_decoded"] < sum(len(p) for p in PROMPTS) + 64 + dm.stats["n_drafted"]
    ref.close()
    dm.close()


@pytest.mark.parametrize("kind", ["llama-draft", "mamba-draft"])  # mamba: a memory that cannot trim starts over
def test_draft_model_keeps_its_memory_in_step(tiny_model, kind):
    """Drafts from the incremental memory equal a fresh draft model's for the same history, whatever part of
    the previous draft the history accepted (and after a new, unrelated history)."""
    kw = dict(num_pred_tokens=5, adaptive=False, n_threads=1, referee=False)
    dm = DraftModel(str(tiny_model(kind)), **kw)
    fresh = DraftModel(str(tiny_model(kind)), **kw)
    rng = np.random.default_rng(0)
    hist = [int(t) for t in rng.integers(0, 64, 12)]
    for i in range(16):
        d = dm(np.array(hist, dtype=np.intc)).tolist()
        fresh.reset()
        assert d == fresh(np.array(hist, dtype=np.intc)).tolist(), i
        a = int(rng.integers(0, len(d) + 1))
        hist = hist + d[:a] + [int(rng.integers(0, 64))] if i != 8 else [3, 1, 4, 1, 5]
    assert dm.stats["n_accepted"] > 0 and dm.stats["n_trimmed"] > 0
    dm.close()
    fresh.close()


def test_draft_model_decodes_once_per_drafted_token(tiny, monkeypatch):
    """A call costs one draft decode per drafted token: the last drafted token, accepted but never decoded, rides
    with the target's next token in the first drafting step (draft-simple's catching up)."""
    dm = DraftModel(tiny[1], num_pred_tokens=4, adaptive=False, n_threads=1)
    calls = []
    for name in ("decode", "decode_next"):
        real = getattr(L.Context, name)
        monkeypatch.setattr(L.Context, name, lambda self, *a, _real=real, **k:
                            (self is dm._ctx and calls.append(1)) or _real(self, *a, **k))
    hist = [1, 2, 3, 4, 5]
    for i in range(3):
        calls.clear()
        d = dm(np.array(hist, dtype=np.intc)).tolist()
        assert len(calls) == len(d) == 4, i
        hist = hist + d + [7]  # all accepted, then the target's own token
    assert dm.stats["n_accepted"] == 8 and dm.stats["n_trimmed"] == 0
    dm.close()


def test_catching_up_in_the_first_step_is_not_priced_as_drafting(tiny, monkeypatch):
    """A new prompt (or the rounds after plain ones) rides whole with the first drafting step; that step's time
    is catching up but for one drafting step, which ``catch_up_ms`` says (the engine's cost model prices a draft
    without it). On a fake clock: a decode costs 1 ms plus 1 ms per row."""
    import llamaspec.drafters.draft_model as dmod

    dm = DraftModel(tiny[1], num_pred_tokens=4, adaptive=False, n_threads=1, referee=False)
    now = [0.0]
    monkeypatch.setattr(dmod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0] / 1e3)}))

    def costs(n_rows):
        now[0] += 1.0 + n_rows

    for name, rows in (("decode", lambda a: len(a[0])), ("decode_next", lambda a: len(a[0]))):
        real = getattr(L.Context, name)
        monkeypatch.setattr(L.Context, name, lambda self, *a, _real=real, _rows=rows, **k:
                            (self is dm._ctx and costs(_rows(a))) or _real(self, *a, **k))
    hist = list(range(1, 41))  # 39 prompt tokens to catch up, then the last token
    assert len(dm(np.array(hist, dtype=np.intc))) == 4
    ds = dm._drafter
    assert ds.last_step_ms == pytest.approx(2.0)       # the later steps: one row each
    assert ds.catch_up_ms == pytest.approx((1.0 + 40) - 2.0)  # the first step less one drafting step
    dm.close()


def test_a_one_token_draft_catches_up_apart_and_times_its_step(tiny, monkeypatch):
    """With one token to draft, the catching up does not ride with the drafting step (that would leave no step
    to time, and the engine's price of a draft came from the whole catch-up): it is decoded first, and the step
    is measured alone. Fake clock as above: a decode costs 1 ms plus 1 ms per row."""
    import llamaspec.drafters.draft_model as dmod

    dm = DraftModel(tiny[1], num_pred_tokens=1, adaptive=False, n_threads=1, referee=False)
    now = [0.0]
    monkeypatch.setattr(dmod, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: now[0] / 1e3)}))
    for name in ("decode", "decode_next"):
        real = getattr(L.Context, name)
        monkeypatch.setattr(L.Context, name, lambda self, *a, _real=real, **k:
                            (self is dm._ctx and now.__setitem__(0, now[0] + 1.0 + len(a[0]))) or _real(self, *a, **k))
    assert len(dm(np.array(list(range(1, 41)), dtype=np.intc))) == 1
    ds = dm._drafter
    assert ds.last_step_ms == pytest.approx(2.0)           # the one drafting step: one row
    assert ds.catch_up_ms == pytest.approx(1.0 + 39)       # the 39 prompt tokens, decoded apart
    dm.close()


def test_draft_model_adapts_its_length(tiny):
    dm = DraftModel(tiny[1], num_pred_tokens=8, n_min=2, n_threads=1)
    dm.n = 4
    h = [1, 2, 3, 4, 5]
    d = dm(np.array(h, dtype=np.intc)).tolist()
    assert len(d) == 4
    h = h + d + [7]  # all accepted: longer
    d = dm(np.array(h, dtype=np.intc)).tolist()
    assert dm.n == 6 and len(d) == 6
    wrong = (d[0] + 1) % 64
    dm(np.array(h + [wrong], dtype=np.intc))  # the first drafted token rejected: shorter
    assert dm.n == 5 and (dm.stats["n_accepted"], dm.stats["n_drafted"]) == (4, 4 + 6 + 5)
    dm.close()


def drive_hook(dm, calls: int, spec_s_per_round: float, plain_s: float) -> list[int]:
    """``calls`` rounds of llama-cpp-python's loop on a fake clock: every draft is accepted whole, a round that
    drafted takes ``spec_s_per_round`` and one that did not ``plain_s``; a new request every 20 calls (the tiny
    draft's context is short). The draft lengths, per call."""
    now = [0.0]
    dm._clock = lambda: now[0]
    hist, lens = [], []
    for i in range(calls):
        if i % 20 == 0:
            hist = [1 + i % 7, 2, 3, 4, 5]
        d = dm(np.array(hist, dtype=np.intc)).tolist()
        lens.append(len(d))
        now[0] += spec_s_per_round if d else plain_s
        hist = hist + d + [7]
    return lens


def test_draft_model_drafts_nothing_while_drafting_loses(tiny):
    """A round that drafts 4 (5 tokens) but takes 8x a plain round's time delivers less: after a few rounds
    measured against plain ones the hook returns empty drafts (llama_cpp.Llama decodes plainly)."""
    dm = DraftModel(tiny[1], num_pred_tokens=4, adaptive=False, n_threads=1)
    lens = drive_hook(dm, 80, spec_s_per_round=0.08, plain_s=0.01)
    assert lens[:4] == [4] * 4                  # speculating from the start
    assert lens[-60:].count(0) == 60            # then plain (the loss was large: a long wait before a retry)
    assert dm.stats["n_plain"] == lens.count(0) and dm.referee.n_fallbacks == 1
    dm.close()


def test_draft_model_keeps_drafting_while_it_pays(tiny):
    dm = DraftModel(tiny[1], num_pred_tokens=4, adaptive=False, n_threads=1)
    lens = drive_hook(dm, 80, spec_s_per_round=0.02, plain_s=0.01)  # 5 tokens in 2x the time: 2.5x
    assert dm.referee.n_fallbacks == 0 and 1 <= lens.count(0) <= 10 and lens.count(0) == dm.stats["n_plain"]
    off = DraftModel(tiny[1], num_pred_tokens=4, adaptive=False, n_threads=1, referee=False)
    assert drive_hook(off, 80, spec_s_per_round=0.08, plain_s=0.01) == [4] * 80  # referee=False: always drafts
    dm.close()
    off.close()


# -- real models ------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def user_program(make_llm) -> dict:
    """A program written for llama-cpp-python (only how ``Llama`` is constructed is passed in)."""
    out = {}
    llm = make_llm(n_ctx=512, verbose=False)
    out["completion"] = llm("Q: What is the capital of France? A:", max_tokens=12, temperature=0,
                            stop=["\n"])["choices"][0]["text"]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    out["chat"] = llm.create_chat_completion(messages=msgs, max_tokens=12, temperature=0)["choices"][0]["message"]
    r = llm.create_chat_completion(messages=[{"role": "user", "content": "Describe a person as JSON."}],
                                   response_format={"type": "json_object", "schema": SCHEMA}, max_tokens=48,
                                   temperature=0)
    out["json"] = json.loads(r["choices"][0]["message"]["content"])
    out["stream"] = "".join(c["choices"][0]["delta"].get("content") or "" for c in llm.create_chat_completion(
        messages=msgs, max_tokens=12, temperature=0, stream=True))
    tool_llm = make_llm(n_ctx=512, verbose=False, chat_format="chatml-function-calling")
    r = tool_llm.create_chat_completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        max_tokens=32, temperature=0)
    call = r["choices"][0]["message"]["tool_calls"][0]["function"]
    out["tool"] = (call["name"], json.loads(call["arguments"]))
    return out


@pytest.mark.real
def test_a_llama_cpp_program_runs_unchanged():
    path = str(real_model("smollm2-135m-q4_1"))
    ours = user_program(lambda **kw: Llama(path, n_threads=2, **kw))
    theirs = user_program(lambda **kw: load_llama(path, n_threads=2, **kw))
    assert ours == theirs
    assert set(ours["json"]) >= {"name", "age"} and isinstance(ours["json"]["age"], int)
    assert ours["tool"][0] == "get_weather" and "city" in ours["tool"][1]
    assert ours["stream"] == ours["chat"]["content"]


def near_tie(target: str, prompt: list[int], a: list[int], b: list[int]) -> tuple[bool, str]:
    """Where ``a`` and ``b`` first differ, are both candidates within TIE_TOL of the top logit?"""
    k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None:
        return True, "prefix"
    with L.Model(target) as m, L.Context(m, n_ctx=1024) as ctx:
        toks = prompt + a[:k]
        ctx.decode_tokens(toks, 0, 0)
        lg = ctx.logits((len(toks) - 1) % ctx.n_batch).astype(np.float64)
    gap = abs(lg[a[k]] - lg[b[k]])
    return bool(gap <= TIE_TOL and lg.max() - max(lg[a[k]], lg[b[k]]) <= TIE_TOL), f"token {k}: gap {gap:.4f}"


GEMMA_PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def gemma():
    target, draft = str(real_model("gemma3-270m-f32")), str(real_model("gemma3-270m-q4km"))
    ref = load_llama(target, n_ctx=256, verbose=False, n_threads=2)
    plain = ref(GEMMA_PROMPT, max_tokens=32, temperature=0)
    n_prompt = plain["usage"]["prompt_tokens"]
    seen = [int(t) for t in ref._input_ids]  # what it decoded: the prompt and all but the last new token
    ref.close()
    return target, draft, text(plain), (seen[:n_prompt], seen[n_prompt:])


@pytest.mark.real
def test_gemma_pair_greedy_equals_llama_cpp_plain(gemma):
    target, draft, plain, (prompt, plain_toks) = gemma
    with Llama(target, draft_model="gemma3-270m-q4km", n_ctx=256, verbose=False, n_threads=2) as llm:
        r = llm(GEMMA_PROMPT, max_tokens=32, temperature=0)
        spec_toks = llm.last_tokens[1]
        streamed = "".join(text(c) for c in llm(GEMMA_PROMPT, max_tokens=32, temperature=0, stream=True))
    assert r["llamaspec"]["speculative"] and r["llamaspec"]["n_accepted"] > 0
    if text(r) != plain:
        ok, why = near_tie(target, prompt, plain_toks, spec_toks)
        assert ok, why
    assert streamed == text(r)


@pytest.mark.real
def test_gemma_draft_model_inside_llama_cpp_equals_plain(gemma):
    target, draft, plain, (prompt, plain_toks) = gemma
    dm = DraftModel(draft, n_threads=2)
    ref = load_llama(target, n_ctx=256, verbose=False, n_threads=2, draft_model=dm)
    r = ref(GEMMA_PROMPT, max_tokens=32, temperature=0)
    got = [int(t) for t in ref._input_ids[len(prompt):]]  # what it decoded: all but its last token
    ref.close()
    assert dm.stats["n_accepted"] > 0 and dm.acceptance_rate > 0.3
    if text(r) != plain:
        ok, why = near_tie(target, prompt, plain_toks, got)
        assert ok, why
    dm.close()


# -- from_pretrained --------------------------------------------------------------------------------

def test_from_pretrained_downloads_through_huggingface_hub(tiny, tmp_path):
    """Against a local server that answers as the Hub does (``HF_ENDPOINT``), in a child process: the endpoint
    is read when ``huggingface_hub`` is imported."""
    pytest.importorskip("huggingface_hub")
    import os

    from fake_hub import serve

    data = Path(tiny[0]).read_bytes()
    srv, url = serve({"someone/tiny-GGUF": {"tiny-Q8_0.gguf": data, "sub/tiny-F32.gguf": data, "README.md": b"hi"}})
    code = ("import json; from llamaspec import Llama\n"
            "a = Llama.from_pretrained('someone/tiny-GGUF', '*Q8_0.gguf', n_ctx=64, verbose=False, n_threads=1)\n"
            "b = Llama.from_pretrained('someone/tiny-GGUF', 'sub/*.gguf', n_ctx=64, verbose=False, n_threads=1)\n"
            "errors = []\n"
            "for pattern in ('*.gguf', '*Q4_K_M.gguf'):\n"
            "    try: Llama.from_pretrained('someone/tiny-GGUF', pattern)\n"
            "    except ValueError as e: errors.append(str(e).splitlines()[0])\n"
            "print(json.dumps([a.model_path, b.model_path, a([1, 2, 3], max_tokens=3)['usage'], errors]))\n")
    env = dict(os.environ, HF_ENDPOINT=url, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_DISABLE_TELEMETRY="1")
    env.pop("HF_HUB_OFFLINE", None)
    try:
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 0, r.stderr[-2000:]
    a, b, usage, errors = json.loads(r.stdout.splitlines()[-1])
    assert a.endswith("tiny-Q8_0.gguf") and b.endswith("sub/tiny-F32.gguf") and str(tmp_path) in a
    assert Path(a).read_bytes() == data and usage["completion_tokens"] == 3
    assert errors == ["Multiple files found in someone/tiny-GGUF matching *.gguf",
                      "No file found in someone/tiny-GGUF that match *Q4_K_M.gguf"]
