"""draft-eagle3 (spec §4.3) on the tiny fixtures of support.tiny_eagle: greedy speculative output equals
plain decoding, drafts are partly accepted, 1 and N slots, PART / FULL / RS targets, clear errors for bad pairs."""
from __future__ import annotations

import numpy as np
import pytest

from llamaspec.drafters.base import DraftParams
from llamaspec.engine import Engine
from llamaspec.errors import MemoryOpError, UsageError
from llamaspec.params import SpecParams
from support import tiny_eagle as te

from helpers import EXACT

PROMPTS = [[5, 9, 17, 3, 22, 40], [1, 2, 30, 31, 8], [11, 12, 50, 7, 60, 19, 4], [33, 34, 35]]
N = 40


@pytest.fixture(scope="session")
def heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle-heads")
    out = te.write_all(d)
    out["eagle3-last"] = te.write_eagle3(d / "eagle3-last.gguf", target_layers=(0, 1, 3))
    # reads layer 3 == n_layer (the nextn state, which the llama target does not write) with weight 2
    out["eagle3-last-used"] = te.write_eagle3(d / "eagle3-last-used.gguf", target_layers=(0, 1, 3),
                                              slot_weights=(1.0, 0.0, 2.0))
    return out


def spec(n_max: int = 3, types: str | None = None) -> SpecParams:
    p = SpecParams()
    p.parity = True  # llama.cpp's fixed draft length (no adaptive length): counts as llama.cpp's
    p.draft.n_max = n_max
    if types:
        p.add_types(types)
    return p


def expected(i: int) -> list[int]:
    return te.plain_continuation(PROMPTS[i][-1], N)


def test_target_is_not_degenerate(heads):
    with Engine(heads["target"], n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=N)
    assert r.tokens == expected(0)
    assert len(set(r.tokens)) == N  # a 63-cycle: no repeats within 40 tokens


@pytest.mark.parametrize("head", ["eagle3", "eagle3-own"])
@pytest.mark.parametrize("n_parallel", [1, 2])
def test_greedy_equals_plain(heads, head, n_parallel):
    with Engine(heads["target"], draft=heads[head], spec=spec(3), n_ctx=256, n_parallel=n_parallel, **EXACT) as e:
        assert e.chain.types == ["draft-eagle3"]  # inferred from the head's architecture
        rs = e.generate_many(PROMPTS[:n_parallel], n_predict=N)
        assert all(e.ctx_dft.memory.pos_max(i) == -1 for i in range(n_parallel))
    for i, r in enumerate(rs):
        assert r.tokens == expected(i)
        assert 0 < r.stats.n_accepted < r.stats.n_drafted  # partial acceptance really happened
    drafted = sum(r.stats.n_drafted for r in rs)
    accepted = sum(r.stats.n_accepted for r in rs)
    assert 0.3 <= accepted / drafted <= 0.9  # the fixture's promise


@pytest.mark.parametrize("n_rs_seq,level", [(0, "FULL"), (3, "RS")])
def test_hybrid_target(heads, n_rs_seq, level):
    with Engine(heads["target-lfm2"], draft=heads["eagle3"], spec=spec(3), n_ctx=256, n_parallel=2,
                n_rs_seq=n_rs_seq, **EXACT) as e:
        assert e.tgt_level.name == level
        rs = e.generate_many(PROMPTS[:2], n_predict=N)
        d = e.chain.impls[0]
        assert d.stateful
        state = d.get_state(0)
    for i, r in enumerate(rs):
        assert r.tokens == expected(i)
        assert 0 < r.stats.n_accepted < r.stats.n_drafted
    assert state is not None and len(state) == 4 + 4 * te.EMBD


def test_state_round_trip(heads):
    with Engine(heads["target-lfm2"], draft=heads["eagle3"], spec=spec(3), n_ctx=256, **EXACT) as e:
        d = e.chain.impls[0]
        e.generate(PROMPTS[0], n_predict=8)
        blob = d.get_state(0)
        pos, g = d.pending_pos[0], d.pending_g[0].copy()
        d.reset(0)
        assert d.get_state(0) is None
        d.set_state(0, b"\0" * 7)  # wrong size: ignored
        assert d.pending_pos[0] == -1
        d.set_state(0, blob)
        assert d.pending_pos[0] == pos and np.array_equal(d.pending_g[0], g)


def test_no_state_on_attention_target(heads):
    with Engine(heads["target"], draft=heads["eagle3"], spec=spec(3), n_ctx=256, **EXACT) as e:
        e.generate(PROMPTS[0], n_predict=8)
        assert e.chain.get_state(0) is None  # only recurrent / hybrid targets save it (spec §4.3)


def test_a_refused_draft_trim_is_an_error(heads, monkeypatch):
    """A draft starts by trimming the draft context back to the deferred row; a memory that refuses (a bug: a
    KV cache always can) raises MemoryOpError instead of drafting on top of stale rows."""
    with Engine(heads["target"], draft=heads["eagle3"], spec=spec(3), n_ctx=256, **EXACT) as e:
        e.generate(PROMPTS[0], n_predict=8)
        d = e.chain.impls[0]
        d.pending_pos[0] = 0
        with monkeypatch.context() as m:
            m.setattr(e.ctx_dft.memory, "seq_rm", lambda *a: False)
            with pytest.raises(MemoryOpError, match="refused"):
                d.draft([DraftParams(drafting=True, n_max=3, id_last=PROMPTS[0][0], pos0=0)])


def test_p_min_and_n_min(heads):
    sp = spec(3)
    sp.draft.n_min = 3
    with Engine(heads["target"], draft=heads["eagle3"], spec=sp, n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=N)
    assert r.tokens == expected(0)
    assert r.stats.n_drafted % 3 == 0  # shorter drafts were dropped
    sp = spec(3)
    sp.draft.p_min = 1.0  # nothing is that sure: no drafts at all
    with Engine(heads["target"], draft=heads["eagle3"], spec=sp, n_ctx=256, **EXACT) as e:
        r = e.generate(PROMPTS[0], n_predict=12)
    assert r.tokens == expected(0)[:12] and r.stats.n_drafted == 0


def test_incompatible_targets(heads, tiny_model, tmp_path):
    from llamaspec.testing.tiny_models import write_model

    with pytest.raises(UsageError, match="does not expose|layer inputs"):
        Engine(tiny_model("mamba"), draft=heads["eagle3"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="target layer 3, but .* has 2 layers"):  # id 3 > n_layer
        Engine(tiny_model("llama"), draft=heads["eagle3-last"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="n_embd=128"):  # id 2 == n_layer is no refusal: the width is
        Engine(tiny_model("llama"), draft=heads["eagle3"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="n_embd=128"):
        Engine(write_model("llama", tmp_path / "l3.gguf", n_layer=3), draft=heads["eagle3"], spec=spec(3), n_ctx=256)


@pytest.mark.parametrize("head", ["eagle3-last", "eagle3-last-used"])
def test_head_reading_n_layer_of_a_llama_target(heads, head, caplog):
    """Ids (0, 1, 3) on the 3-layer llama target: id 3 == n_layer reads the nextn state, which the llama graph
    does not write. llama.cpp runs the pair on the unwritten buffer; so do we, with one warning line.
    ``eagle3-last`` ignores that feature (fc weight 0): it drafts as well as ``eagle3``; ``eagle3-last-used``
    weighs it 2x: the stale buffer content costs acceptance (counts equal llama-server's: test_heads_native)."""
    from llamaspec import _llama as L
    from llamaspec.drafters.eagle3 import target_writes_nextn
    from llamaspec.probe import heads_report

    sp = spec(6)
    sp.draft.p_min = 0.3
    with caplog.at_level("WARNING", logger="llamaspec"):
        with Engine(heads["target"], draft=heads[head], spec=sp, n_ctx=256, n_batch=64, n_ubatch=64,
                    n_threads=1, **EXACT) as e:
            assert e.chain.types == ["draft-eagle3"]
            r = e.generate(PROMPTS[0], n_predict=N)
    lines = [m for m in caplog.messages if "n_layer (the nextn hidden state)" in m]
    assert len(lines) == 1 and "does not provide" in lines[0] and "acceptance will be low" in lines[0]
    assert r.tokens == expected(0)  # greedy output is plain decoding's, whatever the head reads
    assert r.stats.n_drafted > 0
    if head == "eagle3-last":
        assert 0.5 < r.stats.n_accepted / r.stats.n_drafted < 1  # the unread slot changes nothing
    with L.Model(heads["target"]) as t, L.Model(heads[head]) as h:
        assert target_writes_nextn(t) is False  # probed: the llama graph writes no nextn state
        rep = heads_report(t, h)["draft-eagle3"]
        assert rep["supported"] and rep["why"] is None and "does not provide" in rep["warning"]
        with L.Model(heads["eagle3"]) as h2:
            assert "warning" not in heads_report(t, h2)["draft-eagle3"]  # ids 0..2: no nextn read


def test_nextn_probe_sees_a_target_that_writes_it(tiny_model):
    """The probe asks the loaded model, not a list: qwen35 writes its nextn state, llama / lfm2 do not."""
    from llamaspec import _llama as L
    from llamaspec.drafters.eagle3 import _probe_nextn

    for kind, want in (("qwen35", True), ("llama", False), ("lfm2", False)):
        with L.Model(tiny_model(kind)) as m:
            assert _probe_nextn(m) is want, kind


def test_wrong_types_for_a_head(heads):
    with pytest.raises(UsageError, match="head, not a standalone model"):
        Engine(heads["target"], draft=heads["eagle3"], spec=spec(3, "draft-simple"), n_ctx=256)
    with pytest.raises(UsageError, match="head, not a standalone model"):
        Engine(heads["target"], draft=heads["eagle3"], spec=spec(3, "draft-dflash"), n_ctx=256)
    with pytest.raises(UsageError, match="draft head, not a standalone model"):
        Engine(heads["eagle3"], n_ctx=256)


def test_cli_generate_infers_the_head(heads, tmp_path):
    import json

    from click.testing import CliRunner

    from llamaspec.cli.main import main

    out = tmp_path / "stats.json"
    res = CliRunner().invoke(main, ["generate", "-m", str(heads["target"]), "-md", str(heads["eagle3"]), "-n", "16",
                                    "--temp", "0", "--spec-parity", "hello", "--stats-json", str(out), "-q"])
    assert res.exit_code == 0, res.output
    assert "draft-eagle3" in out.read_text()
    json.loads(out.read_text())


def test_behind_an_ngram_drafter(heads):
    """ngram-simple wins the rounds where the prompt's cycle repeats; the head still sees every batch (the bridge
    row carries its deferred position across rounds it did not draft) and drafts well afterwards."""
    prompt = [5] + te.plain_continuation(5, 70)
    prompt = prompt[:30] + [7, 8] + prompt[30:]
    with Engine(heads["target"], draft=heads["eagle3"], spec=spec(3, "ngram-simple,draft-eagle3"), n_ctx=256,
                **EXACT) as e:
        r = e.generate(prompt, n_predict=60)
        st = {d.type: d.stats for d in e.chain.impls}
    assert r.tokens == te.plain_continuation(prompt[-1], 60)
    assert set(r.stats.n_accepted_by_type) == {"ngram-simple", "draft-eagle3"}
    assert st["draft-eagle3"].n_acc_tokens > 0.5 * st["draft-eagle3"].n_gen_tokens


def test_unwritten_nextn_rows_hold_stale_outputs(heads):
    """What llama.cpp (and so the drafter) reads for id == n_layer on a llama target: the nextn rows of the
    host output buffer [logits | nextn | layer inputs], zero-filled only when the buffer grows; after a batch
    with fewer outputs the rows start lower and hold the earlier batch's logits rows (a canary for the
    pinned llama.cpp: if it ever writes or clears these rows, nextn_warning's text needs another look)."""
    from llamaspec import _llama as L
    from llamaspec._llama import ext

    V, E = te.VOCAB, te.EMBD
    assert E == 2 * V  # a nextn row spans two logits rows
    with L.Model(heads["target"]) as m, L.Context(m, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, **EXACT) as ctx:
        ext.set_embeddings_layer_inp(ctx, 0, True)
        ext.set_embeddings_nextn(ctx, True, masked=False)
        ctx.decode([L.Row(t, i, 0, i == 5) for i, t in enumerate(PROMPTS[0])])  # 1 output: buffer allocated
        assert not ext.get_embeddings_nextn(ctx, 64, E).any()
        ctx.decode([L.Row(t, 6 + i, 0, True) for i, t in enumerate([1, 2, 3, 4])])  # 4 outputs: grown, zeroed
        assert not ext.get_embeddings_nextn(ctx, 64, E).any()
        prev = [ctx.logits(i).copy() for i in range(4)]
        ctx.decode([L.Row(7, 10, 0, True)])  # 1 output: the nextn rows now start at logits row 1
        rows = ext.get_embeddings_nextn(ctx, 2, E)
    assert np.array_equal(rows[0], np.concatenate([prev[1], prev[2]]))
    assert np.array_equal(rows[1][:V], prev[3]) and not rows[1][V:].any()
