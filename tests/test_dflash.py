"""draft-dflash / draft-dspark (spec §4.5 / §4.6) on the tiny fixtures of support.tiny_eagle: greedy
speculative output equals plain decoding, drafts partly accepted, 1 and N slots, PART / FULL / RS targets, the
n_max / n_min clamps, DSpark's confidence rule, clear errors for bad pairs."""
from __future__ import annotations

import logging

import pytest

from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.params import SpecParams
from support import tiny_eagle as te

from helpers import EXACT

PROMPTS = [[5, 9, 17, 3, 22, 40], [1, 2, 30, 31, 8], [11, 12, 50, 7, 60, 19, 4], [33, 34, 35, 36]]
N = 40


@pytest.fixture(scope="session")
def heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash-heads")
    out = te.write_all(d)
    out["dflash-last"] = te.write_dflash(d / "dflash-last.gguf", target_layers=(1, 3))
    out["dspark-bonus"] = te.write_dspark(d / "dspark-bonus.gguf", sample_from_anchor=False)
    return out


def spec(n_max: int = 3, types: str | None = None, **draft) -> SpecParams:
    p = SpecParams()
    p.parity = True  # llama.cpp's fixed draft length (no adaptive length): counts as llama.cpp's
    p.draft.n_max = n_max
    for k, v in draft.items():
        setattr(p.draft, k, v)
    if types:
        p.add_types(types)
    return p


def expected(i: int) -> list[int]:
    return te.plain_continuation(PROMPTS[i][-1], N)


def _check(rs, n):
    for i, r in enumerate(rs):
        assert r.tokens == expected(i)
        assert 0 < r.stats.n_accepted < r.stats.n_drafted  # partial acceptance really happened
    drafted = sum(r.stats.n_drafted for r in rs)
    accepted = sum(r.stats.n_accepted for r in rs)
    assert 0.3 <= accepted / drafted <= 0.9  # the fixture's promise


@pytest.mark.parametrize("head,kind", [("dflash", "draft-dflash"), ("dspark", "draft-dspark")])
@pytest.mark.parametrize("n_parallel", [1, 3])
def test_greedy_equals_plain(heads, head, kind, n_parallel):
    with Engine(heads["target"], draft=heads[head], spec=spec(3), n_ctx=256, n_parallel=n_parallel, **EXACT) as e:
        assert e.chain.types == [kind]  # inferred from the GGUF (markov_w1 -> dspark)
        rs = e.generate_many(PROMPTS[:n_parallel], n_predict=N)
        assert all(e.ctx_dft.memory.pos_max(i) == -1 for i in range(n_parallel))
    _check(rs, n_parallel)


@pytest.mark.parametrize("n_rs_seq,level", [(0, "FULL"), (3, "RS")])
def test_hybrid_target(heads, n_rs_seq, level):
    with Engine(heads["target-lfm2"], draft=heads["dflash"], spec=spec(3), n_ctx=256, n_parallel=2,
                n_rs_seq=n_rs_seq, **EXACT) as e:
        assert e.tgt_level.name == level
        rs = e.generate_many(PROMPTS[:2], n_predict=N)
    _check(rs, 2)


def test_clamps(heads, caplog):
    with caplog.at_level(logging.WARNING, logger="llamaspec"):
        with Engine(heads["target"], draft=heads["dflash"], spec=spec(8, n_min=6), n_ctx=256, **EXACT) as e:
            d = e.chain.impls[0]
            assert (d.n_max, d.n_min) == (3, 3)  # block size 4: at most 3 drafts, n_min clamped too
            r = e.generate(PROMPTS[0], n_predict=N)
        with Engine(heads["target"], draft=heads["dspark"], spec=spec(8), n_ctx=256, **EXACT) as e:
            assert e.chain.impls[0].n_max == 4  # DSpark sampling from the anchor: the whole block
        with Engine(heads["target"], draft=heads["dspark-bonus"], spec=spec(8), n_ctx=256, **EXACT) as e:
            assert e.chain.impls[0].n_max == 3
            r2 = e.generate(PROMPTS[0], n_predict=N)
    assert "clamped" in caplog.text
    assert r.tokens == expected(0) and r.stats.n_accepted > 0
    assert r2.tokens == expected(0) and r2.stats.n_accepted > 0


def test_dspark_confidence(heads):
    with Engine(heads["target"], draft=heads["dspark"], spec=spec(4), n_ctx=256, **EXACT) as e:
        full = e.generate(PROMPTS[0], n_predict=N)
    with Engine(heads["target"], draft=heads["dspark"], spec=spec(4, p_min=0.5), n_ctx=256, **EXACT) as e:
        cut = e.generate(PROMPTS[0], n_predict=N)
    assert full.tokens == cut.tokens == expected(0)
    # the confidence head ends some drafts early: fewer tokens per draft
    assert cut.stats.n_drafted / max(1, cut.stats.n_verif_steps) < full.stats.n_drafted / full.stats.n_verif_steps
    with pytest.raises(UsageError, match="no confidence head"):
        Engine(heads["target"], draft=heads["dspark-noconf"], spec=spec(4, p_min=0.5), n_ctx=256)
    with Engine(heads["target"], draft=heads["dspark-noconf"], spec=spec(4), n_ctx=256, **EXACT) as e:
        assert e.generate(PROMPTS[0], n_predict=12).tokens == expected(0)[:12]


def test_explicit_dspark_type_on_dflash_and_errors(heads, tiny_model):
    with Engine(heads["target"], draft=heads["dspark"], spec=spec(3, "draft-dflash"), n_ctx=256, **EXACT) as e:
        assert e.chain.types == ["draft-dflash"]
        assert e.generate(PROMPTS[0], n_predict=12).tokens == expected(0)[:12]
    with pytest.raises(UsageError, match="layer input"):  # id 3 == n_layer on llama: native would abort
        Engine(heads["target"], draft=heads["dflash-last"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="does not expose|layer inputs"):
        Engine(tiny_model("mamba"), draft=heads["dflash"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="head, not a standalone model"):
        Engine(heads["target"], draft=heads["dflash"], spec=spec(3, "draft-eagle3"), n_ctx=256)


def test_probe_reports_head_support(heads, tiny_model):
    from llamaspec import _llama as L
    from llamaspec.probe import heads_report

    with L.Model(heads["target"]) as t, L.Model(heads["dspark"]) as ds, L.Model(heads["eagle3"]) as e3:
        r = heads_report(t, ds)
        assert r["draft-dflash"]["supported"] and r["draft-dspark"]["supported"]
        assert not r["draft-eagle3"]["supported"] and "eagle3 head" in r["draft-eagle3"]["why"]
        assert heads_report(t, e3)["draft-eagle3"]["supported"]
    with L.Model(tiny_model("mamba")) as m, L.Model(heads["dflash"]) as d:
        r = heads_report(m, d)
        assert not r["draft-dflash"]["supported"] and "layer inputs" in r["draft-dflash"]["why"]


def test_bench_modes_for_heads():
    from llamaspec.bench.modes import parse_mode
    from llamaspec.bench.native import spec_args

    for t in ("draft-eagle3", "draft-dflash", "draft-dspark"):
        m = parse_mode(t)
        assert m.types == (t,) and m.needs_draft
        a = spec_args(m, SpecParams(), "head.gguf")
        assert a[:2] == ["--spec-type", t] and a[a.index("-md") + 1] == "head.gguf"


def test_dflash2_lattice_rule(monkeypatch):
    """The DFlash2 selector walk of spec §4.5 on a hand-made nextn row block (no fixture model exists)."""
    import numpy as np

    from llamaspec.drafters import dflash as mod
    from llamaspec.drafters.base import DraftParams

    K, width = 2, 8
    rows = np.zeros((4, width), np.float32)
    # row i: K candidate ids, then K x K scores (row `pred` of the matrix is read)
    rows[1] = [10, 11, 0.0, 5.0, 9, 9, 9, 9]  # from pred 0: scores (0, 5) -> candidate 1 = token 11
    rows[2] = [20, 21, 9, 9, 3.0, 1.0, 9, 9]  # from pred 1: scores (3, 1) -> candidate 0 = token 20
    rows[3] = [30, 31, 0.1, 0.0, 9, 9, 9, 9]  # from pred 0: (0.1, 0.0) -> a near tie: confidence ~0.52
    d = mod.DFlash.__new__(mod.DFlash)
    d.selector_top_k, d.n_embd_dec, d.ctx_dft = K, width, None
    monkeypatch.setattr(mod.ext, "get_embeddings_nextn", lambda ctx, n, w: rows[:n])
    dp = DraftParams(drafting=True)
    d._draft_lattice(dp, 0, 4, 4, 0.0)
    assert dp.result == [11, 20, 30]
    dp = DraftParams(drafting=True)
    d._draft_lattice(dp, 0, 4, 4, 0.6)
    assert dp.result == [11, 20]  # the third step's confidence is below p_min


def test_probe_with_a_head_as_draft(heads):
    from llamaspec import _llama as L
    from llamaspec.probe import probe

    with L.Model(heads["target"]) as t, L.Model(heads["dflash"]) as d:
        rep = probe(t, d, measure=False).to_dict()  # no context on the head alone (it needs ctx_other)
    assert rep["heads"]["draft-dflash"]["supported"] and "draft" not in rep
