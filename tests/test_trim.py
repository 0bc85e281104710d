"""Trimmed draft vocabularies (llamaspec.models.trim) and their run-time rows (drafters.vocab_slots)."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from llamaspec import _llama as L
from llamaspec.drafters.draft_model import DraftSimple, _id_maps
from llamaspec.drafters.vocab_slots import VocabSlots
from llamaspec.engine import Engine
from llamaspec.errors import FetchError, VocabMismatchError
from llamaspec.models import trim
from llamaspec.params import TRIM_KEEP, SpecParams

from helpers import EXACT

PROMPT = [1, 5, 9, 13, 22, 7, 60, 61, 62]
N = 40
KEEP = np.arange(0, 48)  # ids 48..63 are not kept: they can only enter through run-time rows


def spec(n_max: int = 4, vocab: int | None = 0) -> SpecParams:
    p = SpecParams()
    p.add_types("draft-simple")
    p.draft.n_max = n_max
    p.draft_adaptive = False  # tiny models: the adaptive length would stop drafting
    p.draft.vocab = vocab
    return p


@pytest.fixture(scope="module")
def trimmed(tiny_model, tmp_path_factory):
    """``llama`` (the target itself as its draft) and ``llama-draft``, each trimmed to ids 0..47 + 16 free rows."""
    d = tmp_path_factory.mktemp("trim")
    out = {}
    for kind in ("llama", "llama-draft"):
        src = d / f"{kind}.gguf"
        shutil.copy(tiny_model(kind), src)
        dest = d / f"{kind}.trim.gguf"
        trim.trim_vocab_gguf(src, dest, KEEP, n_slots=16)
        out[kind] = dest
    return out


def _logits(model: L.Model, tokens: list[int]) -> np.ndarray:
    ctx = L.Context(model, L.ContextParams(n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=1, n_threads=1))
    try:
        ctx.decode([L.Row(t, i, 0, i == len(tokens) - 1) for i, t in enumerate(tokens)])
        return ctx.logits(len(tokens) - 1).copy()
    finally:
        ctx.close()


def test_trimmed_file_layout(trimmed, tiny_model):
    ids = trim.source_ids(trimmed["llama"])
    assert ids.tolist() == KEEP.tolist() + [-1] * 16
    m = L.Model(trimmed["llama"], vocab_only=True)
    try:
        assert m.vocab.n_tokens == 64 and m.meta(trim.SOURCE_N_KEY) == "64"
        assert m.vocab.get_text(3) == L.Model(tiny_model("llama"), vocab_only=True).vocab.get_text(3)
    finally:
        m.close()
    assert trim.is_trimmed(trimmed["llama"]) and not trim.is_trimmed(tiny_model("llama"))
    with pytest.raises(FetchError, match="already trimmed"):
        trim.trim_vocab_gguf(trimmed["llama"], trimmed["llama"].with_suffix(".x"), KEEP)
    with pytest.raises(FetchError, match="ascending"):
        trim.trim_vocab_gguf(tiny_model("llama"), trimmed["llama"].with_suffix(".y"), np.array([5, 3]))


def test_runtime_rows_give_the_source_logits(trimmed, tiny_model):
    """Kept tokens score as in the whole draft; a token given a run-time row scores exactly as its source
    row, both as output (its logit) and as input (the logits after reading it)."""
    full = L.Model(tiny_model("llama"))
    tm = L.Model(trimmed["llama"], use_mmap=False)
    try:
        to_tgt, to_dft, unk = _id_maps(full, tm)
        slots = VocabSlots.open(tm, to_tgt, to_dft)
        assert slots is not None and slots.n_slots == 16
        ref = _logits(full, PROMPT[:6])
        got = _logits(tm, [int(to_dft[t]) for t in PROMPT[:6]])
        np.testing.assert_allclose(got[:48], ref[:48], rtol=1e-5, atol=1e-5)
        assert slots.ensure([60, 61, 62, 5])  # 5 is kept: no row for it
        assert slots.n_assigned == 3 and all(to_dft[t] >= 48 for t in (60, 61, 62)) and to_dft[5] == 5
        got = _logits(tm, [int(to_dft[t]) for t in PROMPT])
        ref = _logits(full, PROMPT)
        for t in (60, 61, 62):
            assert got[to_dft[t]] == pytest.approx(ref[t], abs=1e-5)
        np.testing.assert_allclose(got[:48], ref[:48], rtol=1e-5, atol=1e-5)
        assert not slots.ensure([60, 61])  # already there
    finally:
        tm.close()
        full.close()


def test_least_recently_used_row_is_reused(tiny_model, tmp_path):
    dest = tmp_path / "four.gguf"
    trim.trim_vocab_gguf(tiny_model("llama"), dest, KEEP, n_slots=4)
    full = L.Model(tiny_model("llama"), vocab_only=True)
    tm = L.Model(dest, use_mmap=False)
    try:
        to_tgt, to_dft, _ = _id_maps(full, tm)
        slots = VocabSlots.open(tm, to_tgt, to_dft)
        assert slots.ensure([48, 49, 50, 51])
        assert not slots.ensure([48, 1])  # 48 is now the most recent; nothing new
        row49 = int(to_dft[49])
        assert slots.ensure([52])
        assert to_dft[49] == -1 and to_dft[52] == row49 and to_tgt[row49] == 52  # 49 was the least recent
        assert slots.ensure([53, 54, 55, 56, 57])  # more than the rows: the first 4 of the batch get them
        assert sorted(int(to_tgt[r]) for r in range(48, 52)) == [53, 54, 55, 56] and to_dft[57] == -1
    finally:
        tm.close()
        full.close()


def test_greedy_output_equals_plain_with_a_trimmed_draft(trimmed, tiny_model):
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        ref = e.generate(PROMPT, n_predict=N).tokens
    for kind in ("llama", "llama-draft"):
        with Engine(tiny_model("llama"), draft=trimmed[kind], spec=spec(), n_ctx=256, **EXACT) as e:
            r = e.generate(PROMPT, n_predict=N)
            d = e.chain.impls[0]
            assert isinstance(d, DraftSimple) and d.vocab_slots is not None
            assert d.vocab_slots.n_assigned >= 3  # the prompt's 60, 61, 62 at least
            assert not e.model_dft.use_mmap
        assert r.tokens == ref
        assert r.stats.n_drafted > 0 and r.stats.n_accepted > 0


def test_a_trimmed_draft_of_the_target_accepts_what_it_can_propose(trimmed, tiny_model):
    """The target as its own (trimmed) draft: a draft is rejected only where the target's token had no row."""
    with Engine(tiny_model("llama"), draft=tiny_model("llama"), spec=spec(), n_ctx=256, **EXACT) as e:
        whole = e.generate(PROMPT, n_predict=N)
    with Engine(tiny_model("llama"), draft=trimmed["llama"], spec=spec(), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPT, n_predict=N)
    assert whole.stats.n_accepted == whole.stats.n_drafted
    assert r.tokens == whole.tokens
    # a token is without a row only until it is first met (prompt or output): each such token rejects at
    # most one draft, which wastes at most n_max drafted tokens
    misses = len({t for t in r.tokens if t >= 48} - set(PROMPT))
    assert r.stats.n_drafted - r.stats.n_accepted <= misses * 4
    assert r.stats.n_accepted > 0


def test_slots_off_with_mmap_still_exact(trimmed, tiny_model):
    tm = L.Model(trimmed["llama-draft"])  # the caller's model, memory-mapped: rows cannot be written
    try:
        with Engine(tiny_model("llama"), draft=tm, spec=spec(), n_ctx=256, **EXACT) as e:
            r = e.generate(PROMPT, n_predict=N)
            assert e.chain.impls[0].vocab_slots is None
    finally:
        tm.close()
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        assert r.tokens == e.generate(PROMPT, n_predict=N).tokens


def test_trimmed_draft_of_another_vocabulary_is_refused(tiny_model, tmp_path):
    dest = tmp_path / "incompat.trim.gguf"
    trim.trim_vocab_gguf(tiny_model("llama-incompat"), dest, KEEP, n_slots=4)
    with pytest.raises(VocabMismatchError, match="text"):
        Engine(tiny_model("llama"), draft=dest, spec=spec(), n_ctx=64)


def test_choose_keep_and_when_trimming_pays(tiny_model):
    ids = trim.choose_keep(tiny_model("llama"), 10, np.array([40, 40, 40, 33, 33, 9]))
    assert ids.tolist() == sorted([40, 33, 9] + list(range(0, 7)))  # corpus by frequency, then tokenizer order
    ok, why = trim.trim_pays(tiny_model("llama-draft"))
    assert not ok and "64 tokens" in why
    ok, why = trim.trim_pays(tiny_model("llama-draft"), 32, asked=True)
    assert ok
    for kind in ("eagle3", "dflash"):
        ok, why = trim.trim_pays(tiny_model(kind), 8, asked=True)
        assert not ok and "head" in why


def test_default_and_parity():
    p = SpecParams()
    assert p.draft_vocab_keep() == (TRIM_KEEP, False)
    p.parity = True
    assert p.draft_vocab_keep() == (0, False)
    p.draft.vocab = 4096
    assert p.draft_vocab_keep() == (4096, True)


def test_engine_trims_when_asked_and_caches(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMASPEC_CACHE", str(tmp_path))
    src = tmp_path / "draft.gguf"
    shutil.copy(tiny_model("llama-draft"), src)
    with Engine(tiny_model("llama"), draft=src, spec=spec(vocab=40), n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPT, n_predict=N)
        assert trim.is_trimmed(e.model_dft.path) and e.model_dft.vocab.n_tokens == 40
    files = list((tmp_path / "trimmed").glob("*.gguf"))
    assert len(files) == 1
    with Engine(tiny_model("llama"), n_ctx=256, **EXACT) as e:
        assert r.tokens == e.generate(PROMPT, n_predict=N).tokens
    with Engine(tiny_model("llama"), draft=src, spec=spec(vocab=40), n_ctx=256, **EXACT) as e:
        assert e.model_dft.path == files[0]  # derived once


def test_cli_flag(tiny_model, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from llamaspec.cli.main import main

    monkeypatch.setenv("LLAMASPEC_CACHE", str(tmp_path))
    args = ["generate", "tok_5 tok_9 tok_3", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")),
            "-n", "12", "--temp", "0", "-q", "--spec-type", "draft-simple"]
    bad = CliRunner().invoke(main, [*args, "--spec-draft-vocab", "100"])
    assert bad.exit_code == 2 and "--spec-draft-vocab must be 0" in bad.output and "Traceback" not in bad.output
    whole = CliRunner().invoke(main, [*args, "--spec-draft-vocab", "0"])
    asked = CliRunner().invoke(main, [*args, "--spec-draft-vocab", "256"])  # more than the 64 tokens: kept whole
    assert whole.exit_code == 0 and asked.exit_code == 0, asked.output
    assert whole.stdout == asked.stdout
    assert not (tmp_path / "trimmed").exists()


def test_unwritable_cache_falls_back_or_says_what_to_do(tiny_model, tmp_path, monkeypatch):
    """Trimming is a speed-up: a cache that cannot take the trimmed copy leaves the draft whole (a warning),
    unless the size was asked for (one clear error)."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    src = tiny_model("llama-draft")
    with pytest.raises(FetchError, match="--spec-draft-vocab 0"):
        trim.draft_path(src, 40, asked=True, cache=blocker)
    monkeypatch.setattr(trim, "trim_pays", lambda *a, **k: (True, "forced"))
    assert trim.draft_path(src, 40, asked=False, cache=blocker) == (src, False)


def test_a_recurrent_draft_with_a_trimmed_vocabulary_is_redecoded_in_its_own_ids(tiny_model, tmp_path, monkeypatch):
    """Issue 21, finding 2: a FULL (recurrent) draft memory cannot drop rejected rows, so it is reloaded from
    its checkpoint and the committed tokens are decoded again. With a trimmed vocabulary those tokens must go
    in as the draft's ids (the drafter maps them), not as the target's: every position the draft context
    holds at the end must read back, through the draft's id map, as the committed token there."""
    src = tmp_path / "lfm2.gguf"
    shutil.copy(tiny_model("lfm2"), src)
    dest = tmp_path / "lfm2.trim.gguf"
    trim.trim_vocab_gguf(src, dest, KEEP, n_slots=16)
    written: dict[int, int] = {}  # position -> draft id last decoded there (sequence 0)
    real_decode = L.Context.decode

    with Engine(tiny_model("lfm2"), n_ctx=256, **EXACT) as e:
        ref = e.generate(PROMPT, n_predict=N).tokens
    with Engine(tiny_model("lfm2"), draft=dest, spec=spec(), n_ctx=256, n_rs_seq=8, **EXACT) as e:
        assert str(e.tgt_level) == "RS" and str(e.dft_level) == "FULL"  # the path under test
        ctx_dft, d = e.ctx_dft, e.chain.impls[0]

        def recording(self, rows, *a, **k):
            if self is ctx_dft:
                for r in rows:
                    if r.seq_id == 0:
                        written[r.pos] = r.token
            return real_decode(self, rows, *a, **k)

        monkeypatch.setattr(L.Context, "decode", recording)
        r = e.generate(PROMPT, n_predict=N)
        to_tgt = d._to_tgt
    assert r.tokens == ref
    assert r.stats.n_accepted > 0 and r.stats.n_trims > 0  # drafts were partly rejected and trimmed
    committed = PROMPT + r.tokens[:-1]
    wrong = [(pos, committed[pos], int(to_tgt[tok])) for pos, tok in sorted(written.items())
             if pos < len(committed) and int(to_tgt[tok]) != committed[pos]]
    assert not wrong, f"(position, committed token, token the draft holds): {wrong[:5]}"
