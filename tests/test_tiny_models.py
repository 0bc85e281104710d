"""The tiny test-model generator: files, determinism, and the llama.cpp behaviour other tests rely on."""
from __future__ import annotations

import ctypes
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import gguf
import numpy as np
import pytest

import llama_cpp as L

from llamaspec.testing import tiny_models as tm

DECODERS = ("llama", "llama-draft", "llama-incompat", "gemma3", "mamba", "mamba-draft", "lfm2", "lfm2-draft", "qwen35")
DRAFT_HEADS = ("eagle3", "dflash")
PROMPT = [1, 2, 3]


# ---------------------------------------------------------------------------------------------------
# low-level helpers


@L.llama_log_callback
def _quiet_log(level, text, user_data):  # noqa: ARG001
    pass


@pytest.fixture(scope="module", autouse=True)
def _quiet_llama() -> Iterator[None]:
    """Silence llama.cpp's own logging here (context-creation failures are expected in some tests)."""
    L.llama_backend_init()
    L.llama_log_set(_quiet_log, ctypes.c_void_p(0))
    yield
    from llama_cpp import _logger

    L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@contextmanager
def load_model(path: Path, *, load_mtp: bool = False):
    mp = L.llama_model_default_params()
    mp.load_mtp = load_mtp
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    try:
        yield model
    finally:
        L.llama_model_free(model)


@contextmanager
def new_context(model, **params):
    """A context with n_ctx 256 and 2 threads (+ any params); yields None if creation failed."""
    cp = L.llama_context_default_params()
    cp.n_ctx = 256
    cp.n_threads = cp.n_threads_batch = 2
    for k, v in params.items():
        setattr(cp, k, v)
    ctx = L.llama_init_from_model(model, cp)
    try:
        yield ctx or None
    finally:
        if ctx:
            L.llama_free(ctx)


def greedy(llm: L.Llama, prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        out.append(tok)
        if len(out) >= n:
            break
    return out


def vocab_texts(model) -> list[bytes]:
    vocab = L.llama_model_get_vocab(model)
    return [L.llama_vocab_get_text(vocab, i) for i in range(L.llama_vocab_n_tokens(vocab))]


# ---------------------------------------------------------------------------------------------------
# the generator itself


def test_kinds_cover_the_required_models():
    required = {"llama", "gemma3", "mamba", "lfm2", "qwen35", "eagle3", "dflash", "llama-incompat",
                "llama-draft", "mamba-draft", "lfm2-draft"}
    assert required <= set(tm.KINDS)
    assert set(DECODERS) | set(DRAFT_HEADS) == set(tm.KINDS)


@pytest.mark.parametrize("kind", tm.KINDS)
def test_written_small_and_well_formed(tiny_models, kind):
    path = tiny_models[kind]
    assert path.name == f"{kind}.gguf" and path.is_file()
    assert path.stat().st_size < 1_000_000
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == tm.spec(kind).arch
    assert r.fields["tokenizer.ggml.model"].contents() == "test"
    for t in r.tensors:
        assert np.isfinite(np.asarray(t.data)).all(), t.name


@pytest.mark.parametrize("kind", tm.KINDS)
def test_deterministic(tiny_models, tmp_path, kind):
    a = tm.write_model(kind, tmp_path / "a.gguf").read_bytes()
    b = tm.write_model(kind, tmp_path / "b.gguf").read_bytes()
    assert a == b == tiny_models[kind].read_bytes() == tm.model_bytes(kind)
    assert tm.model_bytes(kind, seed=12345) != a


def test_draft_is_perturbed_copy_of_target(tiny_models):
    tgt = {t.name: np.array(t.data) for t in gguf.GGUFReader(tiny_models["llama"]).tensors}
    dft = {t.name: np.array(t.data) for t in gguf.GGUFReader(tiny_models["llama-draft"]).tensors}
    assert tgt.keys() == dft.keys()
    for name, a in tgt.items():
        b = dft[name]
        assert a.shape == b.shape
        if a.ndim >= 2:
            rel = float(np.std(b - a) / np.std(a))
            assert 0.05 < rel < 0.2, (name, rel)  # noise of 0.1 x the matrix's std
        else:
            assert np.array_equal(a, b), name


def test_make_all_leaves_identical_files_alone(tmp_path):
    first = tm.make_all(tmp_path, ["llama", "mamba"])
    mtimes = {k: p.stat().st_mtime_ns for k, p in first.items()}
    (tmp_path / "mamba.gguf").write_bytes(b"stale")
    second = tm.make_all(tmp_path, ["llama", "mamba"])
    assert second["llama"].stat().st_mtime_ns == mtimes["llama"]
    assert second["mamba"].read_bytes() == tm.model_bytes("mamba")


def test_overrides(tmp_path):
    with pytest.raises(TypeError, match="unknown override 'n_swa'"):
        tm.write_model("llama", tmp_path / "x.gguf", n_swa=8)
    with pytest.raises(KeyError, match="unknown tiny model kind"):
        tm.write_model("llama5", tmp_path / "x.gguf")
    p = tm.write_model("llama", tmp_path / "deep.gguf", n_layer=3, n_vocab=80, eos_token_id=79)
    r = gguf.GGUFReader(p)
    assert r.fields["llama.block_count"].contents() == 3
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == 80
    with load_model(p) as model:
        vocab = L.llama_model_get_vocab(model)
        assert L.llama_vocab_eos(vocab) == 79
        assert L.llama_vocab_is_eog(vocab, 79)
        assert L.llama_model_n_layer(model) == 3


def test_cli(tmp_path, capsys):
    assert tm.main([str(tmp_path), "llama", "eagle3"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eagle3.gguf", "llama.gguf"]
    assert "llama" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        tm.main([str(tmp_path), "nope"])
    assert e.value.code == 2


# ---------------------------------------------------------------------------------------------------
# loading and decoding with llama.cpp


@pytest.mark.parametrize("kind", DECODERS)
def test_loads_and_creates_context(tiny_models, kind):
    with load_model(tiny_models[kind]) as model, new_context(model) as ctx:
        assert ctx is not None
        assert L.llama_n_ctx(ctx) == 256
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        assert n_vocab == (200 if kind == "llama-incompat" else 64)


@pytest.mark.parametrize("kind", DRAFT_HEADS)
def test_draft_heads_need_a_target_context(tiny_models, kind):
    with load_model(tiny_models["qwen35"]) as target, new_context(target) as tctx, \
            load_model(tiny_models[kind]) as draft:
        assert L.llama_model_has_encoder(draft)
        with new_context(draft) as ctx:
            assert ctx is None  # no token_embd/output of its own: needs ctx_other
        with new_context(draft, ctx_other=tctx) as ctx:
            assert ctx is not None


def test_qwen35_has_mtp_context(tiny_models):
    with load_model(tiny_models["qwen35"], load_mtp=True) as model:
        assert L.llama_model_n_layer_nextn(model) == 1
        with new_context(model, n_rs_seq=4) as target, \
                new_context(model, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP) as mtp:
            assert target is not None and mtp is not None
            assert L.llama_n_rs_seq(target) == 4
    with load_model(tiny_models["llama"]) as model, new_context(model, ctx_type=L.LLAMA_CONTEXT_TYPE_MTP) as mtp:
        assert mtp is None  # no nextn layers


@pytest.mark.parametrize("kind", DECODERS)
def test_greedy_generation_is_not_degenerate(tiny_models, kind):
    llm = L.Llama(str(tiny_models[kind]), n_ctx=256, n_threads=2, verbose=False)
    try:
        out = greedy(llm, PROMPT, 20)
        assert greedy(llm, PROMPT, 20) == out  # reproducible
    finally:
        llm.close()
    assert len(out) == 20  # no EOG in the test vocabulary
    assert len(set(out)) >= 5, out


@pytest.mark.parametrize("base", ["llama", "mamba", "lfm2"])
def test_draft_agrees_sometimes(tiny_models, base):
    """Teacher-forced on the target's greedy path, the perturbed draft picks the same token some of the
    time (measured 0.3-0.55), never always."""
    tgt = L.Llama(str(tiny_models[base]), n_ctx=256, n_threads=2, verbose=False)
    dft = L.Llama(str(tiny_models[f"{base}-draft"]), n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    try:
        path = greedy(tgt, PROMPT, 40)
        dft.reset()
        dft.eval(PROMPT + path[:-1])
        rows = np.asarray(dft.scores[len(PROMPT) - 1 : len(PROMPT) - 1 + len(path)])
        agreement = float((rows.argmax(axis=1) == np.asarray(path)).mean())
    finally:
        tgt.close()
        dft.close()
    assert 0.1 <= agreement <= 0.9, agreement


def test_incompatible_vocab(tiny_models):
    with load_model(tiny_models["llama"]) as a, load_model(tiny_models["llama-incompat"]) as b, \
            load_model(tiny_models["llama-draft"]) as c:
        ta, tb, tc = vocab_texts(a), vocab_texts(b), vocab_texts(c)
        va, vb = L.llama_model_get_vocab(a), L.llama_model_get_vocab(b)
        assert L.llama_vocab_type(va) == L.llama_vocab_type(vb) == L.LLAMA_VOCAB_TYPE_TEST
        assert abs(len(ta) - len(tb)) > 128  # spec §11 rule 4 fails
        assert ta[:5] == tb[:5] and ta[5] == b"tok_5" and tb[5] == b"alt_5"  # rule 5 fails from id 5
        assert all(x != y for x, y in zip(ta[5:], tb[5:]))
        assert ta == tc  # the draft shares the target's vocabulary


def test_test_vocab_tokenization(tiny_models):
    """What the "test" tokenizer does (documented in the module docstring)."""
    with load_model(tiny_models["llama"]) as model:
        vocab = L.llama_model_get_vocab(model)
        assert L.llama_vocab_bos(vocab) == -1 and L.llama_vocab_eos(vocab) == -1
        assert not L.llama_vocab_get_add_bos(vocab) and not L.llama_vocab_get_add_eos(vocab)
        assert not any(L.llama_vocab_is_eog(vocab, t) for t in range(64))

        def tokenize(text: str) -> list[int]:
            raw = text.encode()
            buf = (L.llama_token * 64)()
            n = L.llama_tokenize(vocab, raw, len(raw), buf, 64, True, False)
            assert n >= 0
            return list(buf[:n])

        ids = tokenize("tok_3 tok_5")  # 5-byte chunks "tok_3", " tok_", "5" hashed mod n_vocab
        assert len(ids) == 3 and ids != [3, 5] and all(0 <= t < 64 for t in ids)
        assert tokenize("tok_3 tok_5") == ids
        assert tokenize("tok_3") == ids[:1]

        def piece(tok: int) -> bytes:
            buf = ctypes.create_string_buffer(16)
            n = L.llama_token_to_piece(vocab, tok, buf, 16, 0, True)
            return buf.raw[:n]

        assert [piece(t) for t in (0, 3, 10, 63)] == [b"0", b"3", b"a", b"3f"]  # the id in hex


# ---------------------------------------------------------------------------------------------------
# memory levels (what the capability probe relies on, spec §6)


@pytest.mark.parametrize(
    "kind, n_rs_seq, want_rm, want_rs",
    [
        ("llama", 0, True, 0),  # PART
        ("llama", 4, True, 0),  # n_rs_seq clamped for plain KV caches
        ("gemma3", 0, True, 0),  # PART (iSWA)
        ("mamba", 0, False, 0),  # FULL
        ("mamba", 4, False, 0),  # FULL: mamba has no rs rollback, clamped
        ("lfm2", 0, False, 0),  # FULL
        ("lfm2", 4, True, 4),  # RS: 1-token rollback within n_rs_seq
        ("qwen35", 0, False, 0),  # FULL
        ("qwen35", 4, True, 4),  # RS
    ],
)
def test_memory_levels(tiny_models, kind, n_rs_seq, want_rm, want_rs):
    with load_model(tiny_models[kind]) as model, new_context(model, n_rs_seq=n_rs_seq) as ctx:
        assert ctx is not None
        assert L.llama_n_rs_seq(ctx) == want_rs
        mem = L.llama_get_memory(ctx)
        assert mem
        tokens = (L.llama_token * 2)(0, 0)
        assert L.llama_decode(ctx, L.llama_batch_get_one(tokens, 2)) == 0
        assert L.llama_memory_seq_pos_max(mem, 0) == 1
        assert L.llama_memory_seq_rm(mem, 0, 1, -1) is want_rm
        assert L.llama_memory_seq_pos_max(mem, 0) == (0 if want_rm else 1)
