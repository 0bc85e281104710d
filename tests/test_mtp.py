"""draft-mtp (spec §4.4) and the llama-ext bindings it needs (spec §12.2), on the agreeing tiny MTP fixtures
of :mod:`support.tiny_mtp` (qwen35 with one nextn layer: RS / FULL target; mimo2 with two: chained
heads on a PART target)."""
from __future__ import annotations

import json
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from llamaspec import _llama as L
from llamaspec._llama import ext
from llamaspec.engine import Engine
from llamaspec.errors import UsageError
from llamaspec.params import SpecParams
from support import tiny_mtp
from support.server import LLAMA_SERVER, NATIVE_BIN, llama_server, native_env

PROMPTS = ([1, 2, 3, 4], [9, 17, 33, 5, 40])
N_PREDICT = 40


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mtp")
    out = tiny_mtp.make_all(d)
    out["no-nextn"] = tiny_mtp.write_qwen35_mtp(d / "qwen35-plain.gguf", nextn=False)
    return out


def _spec(**draft) -> SpecParams:
    sp = SpecParams()
    sp.add_types("draft-mtp")
    sp.parity = True  # llama.cpp's fixed draft length (no adaptive length): counts as llama-server's
    for k, v in draft.items():
        setattr(sp.draft, k, v)
    return sp


def _run(path, spec, n_parallel=1, prompts=PROMPTS, **kw):
    with Engine(path, spec=spec, n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False, n_threads=1,
                n_parallel=n_parallel, **kw) as eng:
        res = eng.generate_many(list(prompts[:n_parallel] if n_parallel > 1 else prompts[:1]), n_predict=N_PREDICT,
                                sampling=L.SamplingParams(temp=0.0))
        return res, eng.tgt_level, eng.dft_level, eng.drafter_stats()


_plain_cache: dict = {}


def _plain(path, n_parallel):
    key = (str(path), n_parallel)
    if key not in _plain_cache:
        res, *_ = _run(path, SpecParams(), n_parallel)
        _plain_cache[key] = [r.tokens for r in res]
    return _plain_cache[key]


# -- bindings -------------------------------------------------------------------------------------------


def test_ext_binds_every_staging_function():
    assert ext.missing() == []
    syms = ext.symbols()
    assert set(syms) == set(ext.SPECS) and all(syms.values())
    ext.require("draft-mtp")
    ext.require("draft-eagle3")


def test_ext_missing_function_is_a_clear_usage_error(monkeypatch):
    monkeypatch.setitem(ext.SPECS, "llama_no_such_fn", (("llama_no_such_fn", "_Z16llama_no_such_fnv"), [], None))
    assert "llama_no_such_fn" in ext.missing()
    with pytest.raises(UsageError, match="llama_no_such_fn.*lacks it"):
        ext.fn("llama_no_such_fn")
    with pytest.raises(UsageError, match="draft-x needs llama_no_such_fn"):
        ext.require("draft-x", ["llama_no_such_fn"])


def test_ext_wrappers_guard_native_aborts(mtp_models):
    m = L.Model(mtp_models["qwen35-mtp"], load_mtp=True)
    try:
        with L.Context(m, n_ctx=64, n_batch=16) as tgt, L.Context(m, n_ctx=64, n_batch=16, ctx_type=L.CONTEXT_TYPE_MTP) as dft:
            with pytest.raises(UsageError, match="out of range"):
                ext.set_embeddings_layer_inp(tgt, m.n_layer + 1)
            with pytest.raises(UsageError, match="not extracted"):
                ext.get_embeddings_layer_inp(tgt, 1, 1)
            with pytest.raises(UsageError, match="nextn layer offset 1 out of range"):
                ext.set_nextn_layer_offset(dft, 1)
            with pytest.raises(UsageError, match="not enabled"):
                ext.get_embeddings_nextn_ith(tgt, 0)
            ext.set_embeddings_nextn(tgt, True, False)
            ext.set_embeddings_layer_inp(tgt, 2)
            tgt.decode([L.Row(t, i, 0, i == 3) for i, t in enumerate([1, 2, 3, 4])])
            h = ext.get_embeddings_nextn(tgt, 4)
            assert h.shape == (4, m.n_embd_out)
            assert (ext.get_embeddings_nextn_ith(tgt, 2) == h[2]).all()
            assert ext.get_embeddings_layer_inp(tgt, 2, 4).shape == (4, m.n_embd)
            assert ext.get_ctx_other(dft) is None  # only gemma4-assistant keeps ctx_other (spec §4.4)
            assert ext.model_target_layer_ids(m) == [] and ext.dflash_selector_top_k(m) == 0
    finally:
        m.close()


# -- fixtures -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,n_heads", [("qwen35-mtp", 1), ("mimo2-mtp2", 2)])
def test_fixture_heads_agree_with_their_target(mtp_models, kind, n_heads):
    a = tiny_mtp.agreement(mtp_models[kind], n=48)
    assert len(a["heads"]) == n_heads
    assert all(0.3 <= s <= 0.9 for s in a["heads"]), a
    assert a["n_distinct"] >= 20, a  # not one token repeated (testing-notes §2)


# -- greedy equality ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,n_parallel,n_rs_seq,level", [
    ("qwen35-mtp", 1, None, "RS"),
    ("qwen35-mtp", 2, None, "RS"),
    ("qwen35-mtp", 1, 0, "FULL"),
    ("qwen35-mtp", 2, 1, "RS"),  # drafts longer than n_rs_seq: checkpoints, restores and replays
    ("mimo2-mtp2", 1, None, "PART"),
    ("mimo2-mtp2", 2, None, "PART"),
])
def test_greedy_speculative_equals_plain(mtp_models, kind, n_parallel, n_rs_seq, level):
    path = mtp_models[kind]
    res, tgt_level, dft_level, dstats = _run(path, _spec(n_max=3), n_parallel, n_rs_seq=n_rs_seq)
    assert tgt_level.name == level and dft_level.name == "PART"
    assert [r.tokens for r in res] == _plain(path, n_parallel)
    for r in res:
        st = r.stats
        assert len(r.tokens) == N_PREDICT
        assert 0 < st.n_accepted < st.n_drafted  # accepted and rejected drafts both happen
        assert st.n_drafted <= 3 * st.n_verif_steps
    (d,) = dstats
    assert d["type"] == "draft-mtp"
    if kind == "mimo2-mtp2":  # chained heads: n_max clamped to the number of heads
        assert max(r.stats.n_drafted / max(1, r.stats.n_verif_steps) for r in res) <= 2
        assert len(d["n_acc_tokens_per_pos"]) <= 2
    if n_rs_seq == 1:
        assert sum(r.stats.n_restores for r in res) > 0


def test_chained_heads_clamp_n_max(mtp_models):
    with Engine(mtp_models["mimo2-mtp2"], spec=_spec(n_max=5), n_ctx=128, n_batch=32, n_threads=1) as eng:
        assert eng.chain.impls[0].chain_heads and eng.chain.impls[0].n_max == 2
    with Engine(mtp_models["qwen35-mtp"], spec=_spec(n_max=5), n_ctx=128, n_batch=32, n_threads=1) as eng:
        assert not eng.chain.impls[0].chain_heads and eng.chain.impls[0].n_max == 5


def test_md_mtp_gguf_selects_draft_mtp(mtp_models):
    path = mtp_models["qwen35-mtp"]
    with Engine(path, draft=path, spec=SpecParams(parity=True), n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False, n_threads=1) as eng:
        assert eng.spec.types == ["none", "draft-mtp"] and eng.chain.types == ["draft-mtp"]
        r = eng.generate(PROMPTS[0], n_predict=N_PREDICT, sampling=L.SamplingParams(temp=0.0))
    assert r.tokens == _plain(path, 1)[0] and r.stats.n_accepted > 0


def test_separate_mtp_gguf_equals_the_built_in_head(mtp_models):
    target = mtp_models["qwen35-mtp"]
    head = tiny_mtp.write_qwen35_mtp(target.parent / "qwen35-mtp-head.gguf", mtp_only=True)
    built_in, *_ = _run(target, _spec(n_max=3))
    with Engine(target, draft=head, spec=SpecParams(parity=True), n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False, n_threads=1) as eng:
        assert eng.chain.types == ["draft-mtp"] and eng.model_dft is not eng.model
        r = eng.generate(PROMPTS[0], n_predict=N_PREDICT, sampling=L.SamplingParams(temp=0.0))
    b = built_in[0]
    assert r.tokens == b.tokens
    assert (r.stats.n_drafted, r.stats.n_accepted) == (b.stats.n_drafted, b.stats.n_accepted)


# -- errors ---------------------------------------------------------------------------------------------


def test_incompatible_targets_get_one_line(mtp_models, tiny_model):
    with pytest.raises(UsageError, match="no nextn"):
        Engine(mtp_models["no-nextn"], spec=_spec(), n_ctx=64, n_threads=1)
    with pytest.raises(UsageError, match="no MTP"):
        Engine(tiny_model("llama"), spec=_spec(), n_ctx=64, n_threads=1)
    with pytest.raises(UsageError, match="supports exactly one"):
        Engine(_two_nextn_qwen35(mtp_models), spec=_spec(), n_ctx=64, n_threads=1)
    m = L.Model(mtp_models["qwen35-mtp"])  # loaded without its nextn blocks
    try:
        with pytest.raises(UsageError, match="load_mtp=True"):
            Engine(m, spec=_spec(), n_ctx=64, n_threads=1)
    finally:
        m.close()


def _two_nextn_qwen35(mtp_models) -> Path:
    from llamaspec.testing.tiny_models import write_model

    p = mtp_models["qwen35-mtp"].parent / "qwen35-2nextn.gguf"
    if not p.exists():
        write_model("qwen35", p, n_nextn=2)
    return p


def test_cli_draft_mtp_without_md(mtp_models):
    from click.testing import CliRunner

    from llamaspec.cli.main import main as cli

    r = CliRunner().invoke(cli, ["generate", "-m", str(mtp_models["qwen35-mtp"]), "--spec-type", "draft-mtp", "-n", "12",
                                 "--temp", "0", "-t", "1", "hello"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["generate", "-m", str(mtp_models["no-nextn"]), "--spec-type", "draft-mtp", "-n", "4",
                                 "hello"])
    assert r.exit_code == 2 and "no nextn" in r.output and "Traceback" not in r.output


# -- parity with native llama-server --------------------------------------------------------------------

def _server_completions(model: Path, prompts, n_predict: int, n_max: int, extra=()) -> list[dict]:
    """One llama-server with ``len(prompts)`` slots, the prompts sent concurrently; the JSON answers in order."""
    with llama_server(["-m", model, "--spec-type", "draft-mtp", "--spec-draft-n-max", n_max, "-c", 256 * len(prompts),
                       "-b", "64", "-ub", "64", "-np", len(prompts), "-kvu", "-t", "1", "-fa", "off", "-ctk", "f32",
                       "-ctv", "f32", "--no-warmup", *extra]) as srv:
        out: dict[int, dict] = {}

        def post(i: int, prompt) -> None:
            body = json.dumps({"prompt": list(prompt), "n_predict": n_predict, "temperature": 0, "cache_prompt": False,
                               "return_tokens": True}).encode()
            req = urllib.request.Request(srv.url + "/completion", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                out[i] = json.loads(r.read())

        threads = [threading.Thread(target=post, args=(i, p)) for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [out[i] for i in range(len(prompts))]


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("kind", ["qwen35-mtp", "mimo2-mtp2"])
@pytest.mark.parametrize("n_parallel", [1, 2])
def test_parity_with_llama_server(mtp_models, kind, n_parallel):
    """Greedy tokens and per-request draft_n / draft_n_accepted equal llama-server's (1 slot, and 2 slots with
    concurrent requests)."""
    path = mtp_models[kind]
    prompts = PROMPTS[:n_parallel]
    nat = _server_completions(path, prompts, N_PREDICT, 3)
    res, *_ = _run(path, _spec(n_max=3), n_parallel, prompts=prompts)
    for ours, n in zip(res, nat):
        assert ours.tokens == n["tokens"]
        t = n["timings"]
        assert (ours.stats.n_drafted, ours.stats.n_accepted) == (t.get("draft_n", 0), t.get("draft_n_accepted", 0))
        assert ours.stats.n_accepted > 0


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_parity_md_head_with_llama_server(mtp_models):
    """A separate MTP GGUF as -md: both select draft-mtp from the file and agree on tokens and counts."""
    target = mtp_models["qwen35-mtp"]
    head = tiny_mtp.write_qwen35_mtp(target.parent / "qwen35-mtp-head.gguf", mtp_only=True)
    (nat,) = _server_completions(target, PROMPTS[:1], N_PREDICT, 3, extra=["-md", str(head)])
    with Engine(target, draft=head, spec=SpecParams(parity=True), n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False,
                n_threads=1) as eng:
        r = eng.generate(PROMPTS[0], n_predict=N_PREDICT, sampling=L.SamplingParams(temp=0.0))
    t = nat["timings"]
    assert r.tokens == nat["tokens"]
    assert (r.stats.n_drafted, r.stats.n_accepted) == (t.get("draft_n", 0), t.get("draft_n_accepted", 0))


def test_bench_mode_draft_mtp_needs_no_draft_file():
    from llamaspec.bench.modes import parse_mode
    from llamaspec.bench.native import spec_args

    m = parse_mode("draft-mtp")
    assert m.types == ("draft-mtp",) and not m.needs_draft
    a = spec_args(m, SpecParams(), None)
    assert a[:2] == ["--spec-type", "draft-mtp"] and "-md" not in a and "--spec-draft-n-max" in a


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_parity_chunked_prompt_and_chain_with_llama_server(mtp_models):
    """A prompt decoded in several chunks (process() after each: pending_h carries over), draft-mtp behind
    ngram-simple in the chain."""
    path = mtp_models["qwen35-mtp"]
    prompt = [(i * 7 + 3) % 64 for i in range(40)]
    (nat,) = _server_completions(path, [prompt], N_PREDICT, 3,
                                 extra=["-b", "16", "-ub", "16", "--spec-type", "ngram-simple"])
    sp = _spec(n_max=3)
    sp.add_types("ngram-simple")
    with Engine(path, spec=sp, n_ctx=256, n_batch=16, kv_f32=True, flash_attn=False, n_threads=1) as eng:
        r = eng.generate(prompt, n_predict=N_PREDICT, sampling=L.SamplingParams(temp=0.0))
        assert eng.chain.types == ["ngram-simple", "draft-mtp"]
    t = nat["timings"]
    assert r.tokens == nat["tokens"]
    assert (r.stats.n_drafted, r.stats.n_accepted) == (t.get("draft_n", 0), t.get("draft_n_accepted", 0))
    assert r.stats.n_accepted > 0


def test_drafter_bookkeeping(mtp_models):
    """process() keeps the target's nextn rows of each sequence (verify_h) and the last as pending_h; accept(n)
    moves pending_h to row min(n, rows-1); p_min / n_min / n_max rules of §4."""
    from llamaspec.drafters.base import DraftParams
    from llamaspec.drafters.mtp import DraftMTP, mtp_context
    from llamaspec.params import DraftModelParams

    m = L.Model(mtp_models["qwen35-mtp"], load_mtp=True)
    try:
        with L.Context(m, n_ctx=128, n_batch=32, n_seq_max=2, n_outputs_max=8, kv_f32=True, n_threads=1) as tgt:
            common = dict(n_ctx=128, n_batch=32, n_seq_max=2, kv_f32=True, n_threads=1)
            with mtp_context(m, tgt, 2, common) as dft:
                d = DraftMTP(2, DraftModelParams(n_max=3), tgt, dft)
                rows = [L.Row(t, i, 0, i == 3) for i, t in enumerate([1, 2, 3, 4])]
                rows += [L.Row(t, i, 1, i == 2) for i, t in enumerate([9, 8, 7])]
                tgt.decode(rows)
                assert d.process(rows)
                h = ext.get_embeddings_nextn(tgt, len(rows))
                assert (d.verify_h[0] == h[:4]).all() and (d.verify_h[1] == h[4:]).all()
                assert (d.pending_h[0] == h[3]).all() and (d.pending_h[1] == h[6]).all()
                assert dft.memory.pos_max(0) == 3 and dft.memory.pos_max(1) == 2
                d.accept(1, 1, True)  # is_other is ignored
                assert (d.pending_h[1] == h[5]).all()
                d.accept(1, 9, False)
                assert (d.pending_h[1] == h[6]).all()
                dps = [DraftParams(drafting=True, pos0=4, id_last=5, prompt=[1, 2, 3, 4]),
                       DraftParams(drafting=True, n_max=2, pos0=3, id_last=6, prompt=[9, 8, 7])]
                d.draft(dps)
                assert len(dps[0].result) == 3 and len(dps[1].result) == 2
                for s in (0, 1):
                    dft.memory.seq_rm(s, dps[s].pos0, -1)
                dps = [DraftParams(drafting=True, pos0=4, id_last=5, p_min=1.0), DraftParams()]
                d.draft(dps)
                assert dps[0].result == []  # top p < 1: nothing drafted
                dft.memory.seq_rm(0, 4, -1)
                dps = [DraftParams(drafting=True, pos0=4, id_last=5, n_min=4), DraftParams()]
                d.draft(dps)
                assert dps[0].result == []  # shorter than n_min: cleared
    finally:
        m.close()


def test_mtp_head_file_is_refused_where_it_would_crash(mtp_models):
    """A head-only MTP GGUF has no trunk: as a target, a draft-simple draft or a probed model llama.cpp would
    crash (segfault) decoding it; each gets one line instead."""
    from llamaspec.probe import probe

    target = mtp_models["qwen35-mtp"]
    head = tiny_mtp.write_qwen35_mtp(target.parent / "qwen35-mtp-head.gguf", mtp_only=True)
    with pytest.raises(UsageError, match="MTP head without trunk"):
        Engine(head, n_ctx=64, n_threads=1)
    sp = SpecParams()
    sp.add_types("draft-simple")
    with pytest.raises(UsageError, match="runs only as draft-mtp"):
        Engine(target, draft=head, spec=sp, n_ctx=64, n_threads=1)
    with L.Model(head) as h:
        with pytest.raises(UsageError, match="MTP head without trunk"):
            probe(h, measure=False)
        with L.Model(target) as t:
            rep = probe(t, h, measure=False).to_dict()
    assert "draft" not in rep and rep["heads"]["draft-mtp"]["supported"]


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="native llama-server not built (scripts/build_llama_cpp.sh)")
def test_parity_rs_checkpoint_restore_replay_with_llama_server(mtp_models):
    """ngram-simple drafts longer than n_rs_seq (= n_max 3) from a prompt that repeats the target's own text: the RS
    target checkpoints, restores and replays, draft-mtp keeps pending_h through it; counts equal llama-server's."""
    path = mtp_models["qwen35-mtp"]
    with L.Model(path) as m:
        g = tiny_mtp.greedy(m, [1, 2, 3, 4], 60)
    prompt = [1, 2, 3, 4] + g + [1, 2, 3, 4] + g[:10]
    (nat,) = _server_completions(path, [prompt], 60, 3, extra=["--spec-type", "ngram-simple"])
    sp = _spec(n_max=3)
    sp.add_types("ngram-simple")
    with Engine(path, spec=sp, n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False, n_threads=1) as eng:
        r = eng.generate(prompt, n_predict=60, sampling=L.SamplingParams(temp=0.0))
        by_type = {d["type"]: d for d in eng.drafter_stats()}
    t = nat["timings"]
    assert r.tokens == nat["tokens"]
    assert (r.stats.n_drafted, r.stats.n_accepted) == (t.get("draft_n", 0), t.get("draft_n_accepted", 0))
    assert r.stats.n_restores > 0 and r.stats.n_replays > 0
    assert by_type["draft-mtp"]["n_acc_tokens"] > 0 and by_type["ngram-simple"]["n_acc_tokens"] > 0


@pytest.mark.skipif(not (NATIVE_BIN / "llama-speculative-simple").exists(), reason="native llama-speculative-simple not built")
@pytest.mark.parametrize("kind", ["qwen35-mtp", "mimo2-mtp2"])
def test_tokens_equal_llama_speculative_simple_up_to_n(mtp_models, kind):
    """llama-speculative-simple runs one round past -n (its counts are inflated): compare the text up to -n."""
    path = mtp_models[kind]
    out = subprocess.run(
        [str(NATIVE_BIN / "llama-speculative-simple"), "-m", str(path), "--spec-type", "draft-mtp", "--spec-draft-n-max", "3",
         "-p", "hello world", "-n", str(N_PREDICT), "-c", "256", "-b", "64", "-ub", "64", "-t", "1", "-fa", "off",
         "-ctk", "f32", "-ctv", "f32", "--temp", "0"],
        capture_output=True, text=True, env=native_env(), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    with Engine(path, spec=_spec(n_max=3), n_ctx=256, n_batch=64, kv_f32=True, flash_attn=False, n_threads=1) as eng:
        r = eng.generate("hello world", n_predict=N_PREDICT, sampling=L.SamplingParams(temp=0.0))
        pieces = [eng.vocab.token_to_piece(t).decode() for t in list(r.prompt_tokens) + list(r.tokens)]
    assert len(r.tokens) == N_PREDICT
    # native usually prints past -n, but measured on this fixture: in about half the runs its stdout stops
    # several tokens before -n (the cut varies from run to run, exit code 0); the text it does print must agree
    native, ours, prompt_text = out.stdout.strip(), "".join(pieces), "".join(pieces[: len(r.prompt_tokens)])
    assert len(native) > len(prompt_text) + 8, native
    assert ours.startswith(native) or native.startswith(ours), (native, ours)
