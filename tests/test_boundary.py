"""The ctypes boundary (llamaspec._llama) on tiny models: return codes, output-limit guard, state."""
from __future__ import annotations

import ctypes
import gc
import threading
import weakref

import numpy as np
import pytest
from llama_cpp import llama_cpp as native

from llamaspec import _llama as L
from llamaspec._llama import ext
from llamaspec.chat import apply_chat_template
from llamaspec.errors import (
    ContextError,
    DecodeError,
    LlamaSpecError,
    ModelFormatError,
    OutputLimitError,
    SamplerError,
    StateError,
    UsageError,
)
from llamaspec.options import RequestOptions


@pytest.fixture(scope="module")
def llama(tiny_model):
    with L.Model(tiny_model("llama")) as m:
        yield m


def test_model_metadata(llama):
    assert llama.arch == "llama"
    assert llama.n_layer == 2 and llama.n_embd == 64
    assert llama.vocab.n_tokens == 64
    assert not llama.is_recurrent and not llama.is_hybrid
    assert llama.meta("general.architecture") == "llama"
    assert llama.meta("no.such.key") is None
    assert "llama.block_count" in _meta_keys(llama)


def _meta_keys(model) -> set[str]:
    """Every metadata key llama.cpp reports for ``model`` (``llama_model_meta_key_by_index``)."""
    ptr = model.live_ptr()
    buf = ctypes.create_string_buffer(256)
    return {buf.value.decode("utf-8", "replace") for i in range(int(native.llama_model_meta_count(ptr)))
            if native.llama_model_meta_key_by_index(ptr, i, buf, len(buf)) >= 0}


def test_recurrent_flags(tiny_model):
    with L.Model(tiny_model("mamba")) as m:
        assert m.is_recurrent and not m.is_hybrid
    with L.Model(tiny_model("lfm2")) as m:
        assert m.is_hybrid


def test_missing_file(tmp_path):
    with pytest.raises(ModelFormatError, match="not found"):
        L.Model(tmp_path / "nope.gguf")


def test_not_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        L.Model(p)


def test_truncated(tmp_path, tiny_model):
    data = tiny_model("llama").read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match="corrupted or incomplete|failed to load"):
        L.Model(p)


def test_output_limit_guard_prevents_abort(llama):
    # llama.cpp would SIGABRT here (spec §5.2); the boundary raises instead and the process survives
    with L.Context(llama, n_ctx=64, n_batch=16, n_outputs_max=2) as ctx:
        assert ctx.n_outputs_max == 2
        with pytest.raises(OutputLimitError):
            ctx.decode([L.Row(5 + i, i, 0, True) for i in range(4)])
        ctx.decode([L.Row(5 + i, i, 0, i >= 2) for i in range(4)])  # 2 outputs: fine
        assert ctx.memory.pos_max(0) == 3


def test_n_seq_max_above_outputs_refused(llama):
    with pytest.raises(ContextError, match="n_outputs_max"):
        L.Context(llama, n_ctx=64, n_seq_max=4, n_outputs_max=2)


def test_zero_outputs_max_means_n_batch(llama):
    with L.Context(llama, n_ctx=64, n_batch=8, n_outputs_max=0) as ctx:
        assert ctx.n_outputs_max == 8


def test_decode_errors(llama):
    with L.Context(llama, n_ctx=64, n_batch=4) as ctx:
        with pytest.raises(DecodeError, match="invalid token"):
            ctx.decode([L.Row(64, 0, 0, True)])
        with pytest.raises(DecodeError, match="invalid sequence id"):
            ctx.decode([L.Row(1, 0, 1, True)])
        with pytest.raises(OutputLimitError, match="n_batch=4: raise the batch size .*--batch-size"):
            ctx.decode([L.Row(1, i, 0, False) for i in range(5)])
        with pytest.raises(DecodeError, match="no logits"):
            ctx.decode([L.Row(1, 0, 0, False)])
            ctx.logits(0)


def test_context_full_is_an_error(llama):
    with L.Context(llama, n_ctx=16, n_batch=64) as ctx:
        n = ctx.n_ctx  # llama.cpp pads small contexts
        ctx.decode_tokens([5 + i % 50 for i in range(n)], 0, 0)
        with pytest.raises(DecodeError, match="context full"):
            ctx.decode([L.Row(7, n, 0, True)])
        assert ctx.memory.pos_max(0) == n - 1  # the failed decode left memory as it was


def test_logits_view_and_chunked_prompt(llama):
    toks = [5 + (i * 7) % 50 for i in range(20)]
    with L.Context(llama, n_ctx=64, n_batch=8) as a, L.Context(llama, n_ctx=64, n_batch=32) as b:
        a.decode_tokens(toks, 0, 0)
        b.decode_tokens(toks, 0, 0)
        la = a.logits((len(toks) - 1) % 8).copy()
        lb = b.logits(len(toks) - 1).copy()
        assert la.shape == (64,) and np.allclose(la, lb, atol=1e-2)


def test_seq_rm_returns_bool(tiny_model):
    with L.Model(tiny_model("mamba")) as m, L.Context(m, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7, 8], 0, 0)
        assert ctx.memory.seq_rm(0, 2, -1) is False  # recurrent: partial removal refused
        assert ctx.memory.pos_max(0) == 3  # untouched
        assert ctx.memory.seq_rm(0, 4, -1) is True  # nothing to remove
        assert ctx.memory.seq_rm(0, 0, -1) is True  # whole sequence
        assert ctx.memory.pos_max(0) == -1


@pytest.mark.parametrize("kind", ["llama", "mamba", "lfm2", "gemma3"])
def test_state_round_trip(tiny_model, kind):
    """Save after a prefix, decode more, restore: the next logits equal those right after the prefix."""
    with L.Model(tiny_model(kind)) as m, L.Context(m, n_ctx=64, n_batch=16) as ctx:
        prefix = [5, 9, 13, 17, 21]
        ctx.decode_tokens(prefix, 0, 0)
        flags = L.STATE_FLAGS_PARTIAL_ONLY
        data = ctx.state_seq_get(0, flags)
        assert len(data) == ctx.state_seq_size(0, flags) > 0
        # change the state: decode two more tokens
        ctx.decode_tokens([30, 31], len(prefix), 0)
        # restore; for KV caches drop the extra positions too (what a FULL/PART rollback does)
        ctx.state_seq_set(0, data, flags)
        assert ctx.memory.seq_rm(0, len(prefix), -1)
        assert ctx.memory.pos_max(0) == len(prefix) - 1
        # decoding the last prefix token again at its position must reproduce... use the next token instead
        ctx.decode([L.Row(30, len(prefix), 0, True)])
        after_restore = ctx.logits(0).copy()
    with L.Model(tiny_model(kind)) as m, L.Context(m, n_ctx=64, n_batch=16) as ctx:
        ctx.decode_tokens(prefix + [30], 0, 0)
        fresh = ctx.logits(len(prefix)).copy()
    assert np.allclose(after_restore, fresh, atol=2e-2), np.abs(after_restore - fresh).max()


def test_state_load_size_mismatch(llama):
    with L.Context(llama, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        data = ctx.state_seq_get(0)
        with pytest.raises(StateError):
            ctx.state_seq_set(0, data[: len(data) // 2])


def test_sampler_clone_and_copy_restore_rng(llama):
    with L.Context(llama, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        s = L.Sampler.from_params(llama.vocab, L.SamplingParams(temp=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=42))
        saved = s.clone()
        first = [s.sample(ctx, 2) for _ in range(20)]
        s.copy_from(saved)
        again = [s.sample(ctx, 2) for _ in range(20)]
        assert first == again
        assert len(set(first)) > 1  # really random, not greedy
        s.close(), saved.close()


def test_greedy_sampler_is_argmax(llama):
    with L.Context(llama, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        with L.Sampler.from_params(llama.vocab, L.SamplingParams(temp=0)) as s:
            assert s.sample(ctx, 2) == int(np.argmax(ctx.logits(2)))


def test_bad_grammar(llama):
    with pytest.raises(SamplerError, match="grammar"):
        L.Sampler.from_params(llama.vocab, L.SamplingParams(grammar="root ::= ("))


def test_target_layer_ids(tiny_model):
    with L.Model(tiny_model("eagle3")) as m:
        assert ext.model_target_layer_ids(m) == [0, 1, 2]


def test_log_routed_to_logging(tiny_model, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="llamaspec.llama_cpp"):
        with L.Model(tiny_model("llama")):
            pass
    assert any("llama" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------
# lifetime: no reference cycles, native frees in a safe order, use after close raises
# ---------------------------------------------------------------------------------------------------


@pytest.fixture
def native_frees(monkeypatch):
    """Record the order of ``llama_free`` / ``llama_model_free`` calls (the real frees still run)."""
    gc.collect()  # earlier tests' garbage must not show up here
    calls: list[str] = []
    for name in ("llama_free", "llama_model_free"):
        real = getattr(native, name)

        def wrapper(ptr, _real=real, _name=name):
            calls.append(_name)
            return _real(ptr)

        monkeypatch.setattr(native, name, wrapper)
    return calls


def test_dropped_without_close_no_cycle(tiny_model, native_frees):
    """Model <-> Vocab and Context <-> Memory hold each other weakly: dropping the last reference frees
    both at once (no gc needed), the context before the model."""
    model = L.Model(tiny_model("llama"))
    ctx = L.Context(model, n_ctx=64)
    ctx.decode_tokens([5, 6, 7], 0, 0)
    refs = [weakref.ref(x) for x in (model, model.vocab, ctx, ctx.memory)]
    gc.disable()
    try:
        del model, ctx
        assert [r() for r in refs] == [None] * 4  # refcounting alone freed them: no cycle
        assert native_frees == ["llama_free", "llama_model_free"]
    finally:
        gc.enable()


def test_cyclic_garbage_frees_context_first(tiny_model, native_frees):
    """Held by a cycle, model and context are finalized by the gc in any order: the model's native free
    still waits for the context."""
    holder: list = []
    holder.append(holder)
    model = L.Model(tiny_model("llama"))
    holder += [model, L.Context(model, n_ctx=64), L.Context(model, n_ctx=64)]
    del model
    del holder
    gc.collect()
    assert native_frees == ["llama_free", "llama_free", "llama_model_free"]


def test_model_close_waits_for_its_contexts(tiny_model, native_frees):
    model = L.Model(tiny_model("llama"))
    ctx = L.Context(model, n_ctx=64)
    model.close()
    assert native_frees == []  # deferred: the context still uses the native model
    with pytest.raises(LlamaSpecError, match="is closed"):
        model.vocab.tokenize("hi")
    with pytest.raises(LlamaSpecError, match="is closed"):
        L.Context(model, n_ctx=64)
    ctx.decode_tokens([5, 6, 7], 0, 0)  # the context itself still works
    ctx.close()
    assert native_frees == ["llama_free", "llama_model_free"]
    model.close(), ctx.close()  # idempotent
    assert native_frees == ["llama_free", "llama_model_free"]


def test_grammar_sampler_keeps_its_model(tiny_model, native_frees):
    model = L.Model(tiny_model("llama"))
    s = L.Sampler.from_params(model.vocab, L.SamplingParams(temp=0, grammar='root ::= "a"'))
    model.close()
    assert native_frees == []
    clone = s.clone()
    s.close()
    assert native_frees == []
    clone.close()
    assert native_frees == ["llama_model_free"]


def test_context_use_after_close_raises(llama):
    ctx = L.Context(llama, n_ctx=64)
    ctx.decode_tokens([5, 6, 7], 0, 0)
    data = ctx.state_seq_get(0)
    memory = ctx.memory
    ctx.close()
    for call in (
        lambda: ctx.decode([L.Row(5, 3, 0, True)]),
        lambda: ctx.decode([]),
        lambda: ctx.decode_tokens([5], 3, 0),
        lambda: ctx.logits(2),
        lambda: ctx.state_seq_size(0),
        lambda: ctx.state_seq_get(0),
        lambda: ctx.state_seq_set(0, data),
        lambda: ctx.synchronize(),
        lambda: memory.pos_max(0),
        lambda: memory.pos_min(0),
        lambda: memory.seq_rm(0, 0, -1),
        lambda: memory.clear(),
    ):
        with pytest.raises(LlamaSpecError, match="is closed"):
            call()
    assert not ctx.ptr  # closed contexts stay falsy for `if ctx.ptr` checks


def test_memory_of_a_dropped_context_raises(llama):
    ctx = L.Context(llama, n_ctx=64)
    memory = ctx.memory
    del ctx
    with pytest.raises(LlamaSpecError, match="is closed"):
        memory.pos_max(0)


def test_vocab_use_after_close_raises(tiny_model):
    model = L.Model(tiny_model("llama"))
    vocab = model.vocab
    model.close()
    for call in (
        lambda: vocab.tokenize("hello"),
        lambda: vocab.token_to_piece(5),
        lambda: vocab.detokenize([5, 6]),
        lambda: vocab.is_eog(5),
        lambda: vocab.get_text(5),
        lambda: vocab.suppress_tokens,
        lambda: model.meta("general.architecture"),
        lambda: ext.model_target_layer_ids(model),
    ):
        with pytest.raises(LlamaSpecError, match="is closed"):
            call()
    model = None  # a vocabulary whose model is gone raises too
    with pytest.raises(LlamaSpecError, match="is closed"):
        vocab.tokenize("hello")


def test_sampler_use_after_close_raises(llama):
    with L.Context(llama, n_ctx=64) as ctx:
        ctx.decode_tokens([5, 6, 7], 0, 0)
        s = L.Sampler.from_params(llama.vocab, L.SamplingParams(temp=0))
        s.close()
        for call in (lambda: s.sample(ctx, 2), lambda: L.Candidates(llama.vocab.n_tokens).apply(s), lambda: s.accept(5),
                     lambda: s.clone()):
            with pytest.raises(LlamaSpecError, match="sampler is closed"):
                call()
        with L.Sampler.from_params(llama.vocab, L.SamplingParams(temp=0)) as live:
            ctx2 = L.Context(llama, n_ctx=64)
            ctx2.close()
            with pytest.raises(LlamaSpecError, match="is closed"):
                live.sample(ctx2, 0)


def test_sample_row_without_logits_raises(llama):
    """llama_sampler_sample asserts (aborts the process) on a row without logits: the boundary raises."""
    with L.Context(llama, n_ctx=64) as ctx, L.Sampler.from_params(llama.vocab, L.SamplingParams(temp=0)) as s:
        ctx.decode([L.Row(5, 0, 0, False), L.Row(6, 1, 0, True)])
        for idx in (0, 2, 99):  # no output flag / past the batch
            with pytest.raises(DecodeError, match=f"no logits for batch row {idx}"):
                s.sample(ctx, idx)
        assert s.sample(ctx, 1) == int(np.argmax(ctx.logits(1)))  # the sampler is still usable


def test_detokenize_from_two_threads(llama):
    vocab = llama.vocab
    expected = [vocab.token_to_piece(t, special=True) for t in range(vocab.n_tokens)]
    mismatches: list[tuple[int, bytes]] = []

    def work(offset: int) -> None:
        for i in range(3000):
            t = (i * 7 + offset) % vocab.n_tokens
            piece = vocab.token_to_piece(t, special=True)
            if piece != expected[t]:
                mismatches.append((t, piece))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not mismatches


def test_tokenize_lone_surrogate_is_a_usage_error(llama, tiny_model):
    """Found by tests/test_fuzz_engine.py: a lone surrogate (what a JSON ``"\\ud800"`` escape decodes to)
    escaped ``tokenize`` and ``Engine.submit`` as a bare ``UnicodeEncodeError``."""
    from llamaspec.engine import Engine

    with pytest.raises(UsageError, match=r"lone surrogate '\\ud800' at character 2"):
        llama.vocab.tokenize("ab\ud800cd")
    assert llama.vocab.tokenize("ab\U0001f600cd")  # a proper pair (one astral character) is fine
    with Engine(tiny_model("llama"), n_ctx=64) as e:
        with pytest.raises(UsageError, match="lone surrogate"):
            e.submit("x\udfff", RequestOptions(n_predict=1))
        assert e.generate("xy", n_predict=2).tokens  # the engine goes on


# ---------------------------------------------------------------------------------------------------
# chat templates (llamaspec.chat)
# ---------------------------------------------------------------------------------------------------

MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_chat_builtin_template(llama):
    out = apply_chat_template(llama, MSGS, template="chatml")
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not apply_chat_template(llama, MSGS, template="chatml", add_assistant=False).endswith("assistant\n")


def test_chat_jinja_fallback(llama):
    tmpl = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    assert apply_chat_template(llama, MSGS, template=tmpl) == "[system]Be brief.[user]Hi[assistant]"
    assert apply_chat_template(llama, MSGS, template=tmpl, add_assistant=False) == "[system]Be brief.[user]Hi"


def test_chat_errors(llama):
    if llama.chat_template() is None:
        with pytest.raises(UsageError, match="no chat template"):
            apply_chat_template(llama, MSGS)
    with pytest.raises(UsageError, match="could not apply the chat template"):
        apply_chat_template(llama, MSGS, template="{% for m in messages %}")


def test_a_native_error_quotes_its_own_threads_log_lines(llama):
    """llama.cpp's log is process-wide: a line another thread logged (a failed slot restore) never ends up in
    this thread's error, and this call's own line does (issue 36)."""
    from llamaspec._llama import log
    from llamaspec._llama.sampler import SamplingParams

    other = "llama_state_seq_set_data: error loading state: unexpectedly reached end of buffer /srv/slots/x"
    t = threading.Thread(target=lambda: log._router.feed(4, other + "\n"))
    t.start()
    t.join()
    with pytest.raises(SamplerError) as ei:
        L.Sampler.grammar_only(llama.vocab, SamplingParams(grammar='root ::= a\na ::= root "x"'))
    assert "left recursion" in str(ei.value) and "slots" not in str(ei.value)
    log._router.feed(4, "an earlier error of this thread\n")  # forgotten before the next native call
    with pytest.raises(SamplerError) as ei:
        L.Sampler.grammar_only(llama.vocab, SamplingParams(grammar='root ::= a\na ::= root "x"'))
    assert "earlier" not in str(ei.value)
