"""draft-eagle3 (spec §4.3) on the tiny fixtures of llamaspec.testing.tiny_eagle: greedy speculative output equals
plain decoding, drafts are partly accepted, 1 and N slots, PART / FULL / RS targets, clear errors for bad pairs."""
from __future__ import annotations

import numpy as np
import pytest

from llamaspec.drafters.base import DraftParams
from llamaspec.engine import Engine
from llamaspec.errors import MemoryOpError, UsageError
from llamaspec.params import SpecParams
from llamaspec.testing import tiny_eagle as te

from helpers import EXACT

PROMPTS = [[5, 9, 17, 3, 22, 40], [1, 2, 30, 31, 8], [11, 12, 50, 7, 60, 19, 4], [33, 34, 35]]
N = 40


@pytest.fixture(scope="session")
def heads(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle-heads")
    out = te.write_all(d)
    out["eagle3-last"] = te.write_eagle3(d / "eagle3-last.gguf", target_layers=(0, 1, 3))
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
    with pytest.raises(UsageError, match="target layer 2 = n_layer"):  # a 2-layer llama
        Engine(tiny_model("llama"), draft=heads["eagle3"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="n_embd=128"):
        Engine(write_model("llama", tmp_path / "l3.gguf", n_layer=3), draft=heads["eagle3"], spec=spec(3), n_ctx=256)
    with pytest.raises(UsageError, match="nextn"):  # id 3 == n_layer on a llama target: no nextn output
        Engine(heads["target"], draft=heads["eagle3-last"], spec=spec(3), n_ctx=256)


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
