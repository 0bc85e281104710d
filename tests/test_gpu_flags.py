"""GPU offload and threads (issue 9, item 7): Engine / CLI values reach llama.cpp's model and context params.

This machine has a CPU-only llama.cpp: the tests check what is *passed* to llama.cpp (the model params
struct handed to ``llama_model_load_from_file``, the context params handed to ``llama_init_from_model``,
``llama_n_threads``/``llama_n_threads_batch`` read back from the context) and that a GPU setting such as
``-ngl 99`` still runs (llama.cpp ignores it without a GPU backend). Actual offload is untested here.
"""
from __future__ import annotations

import doctest
import json
import logging
import math

import pytest
from click.testing import CliRunner
from llama_cpp import llama_cpp as native

from llamaspec.cli.main import main
from llamaspec import _llama as L
from llamaspec._llama import model as model_mod
from llamaspec.engine import Engine
from llamaspec.errors import UsageError

MAX_DEV = int(native.llama_max_devices())


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture
def loads(monkeypatch):
    """Every ``llama_model_load_from_file`` call: the params llama.cpp received (read during the call)."""
    seen: list[dict] = []
    real = native.llama_model_load_from_file

    def spy(path, params):
        ts = params.tensor_split
        seen.append({
            "path": path.decode(),
            "n_gpu_layers": params.n_gpu_layers,
            "main_gpu": params.main_gpu,
            "split_mode": params.split_mode,
            "tensor_split": [ts[i] for i in range(MAX_DEV)] if ts else None,
        })
        return real(path, params)

    monkeypatch.setattr(native, "llama_model_load_from_file", spy)
    return seen


@pytest.fixture
def contexts(monkeypatch):
    """Every ``llama_init_from_model`` call: ``(n_threads, n_threads_batch)`` of the context params."""
    seen: list[tuple[int, int]] = []
    real = native.llama_init_from_model

    def spy(model, cparams):
        seen.append((cparams.n_threads, cparams.n_threads_batch))
        return real(model, cparams)

    monkeypatch.setattr(native, "llama_init_from_model", spy)
    return seen


def _threads(ctx: L.Context) -> tuple[int, int]:
    return int(native.llama_n_threads(ctx.ptr)), int(native.llama_n_threads_batch(ctx.ptr))


# -------------------------------------------------------------------------------------------------
# Engine -> llama.cpp
# -------------------------------------------------------------------------------------------------


def test_defaults_are_llama_cpps(tiny_model, loads):
    default = native.llama_model_default_params()
    assert model_mod.N_GPU_LAYERS_DEFAULT == default.n_gpu_layers == -1  # this llama.cpp: negative = all layers
    with Engine(str(tiny_model("llama")), draft=str(tiny_model("llama-draft")), n_ctx=64) as eng:
        assert len(loads) == 2
        for rec in loads:
            assert rec["n_gpu_layers"] == default.n_gpu_layers
            assert rec["main_gpu"] == default.main_gpu and rec["split_mode"] == default.split_mode
            assert rec["tensor_split"] is None
        n = L.default_threads()
        assert _threads(eng.ctx) == (n, n) and _threads(eng.ctx_dft) == (n, n)


def test_engine_values_reach_model_params(tiny_model, loads):
    with Engine(str(tiny_model("llama")), draft=str(tiny_model("llama-draft")), n_ctx=64, n_gpu_layers=99,
                n_gpu_layers_draft=7, main_gpu=1, split_mode="row", tensor_split=[3, 1]) as eng:
        tgt, dft = loads
        assert tgt["path"].endswith("llama.gguf") and dft["path"].endswith("llama-draft.gguf")
        assert tgt["n_gpu_layers"] == 99 and dft["n_gpu_layers"] == 7
        want_ts = [3.0, 1.0] + [0.0] * (MAX_DEV - 2)  # the array llama.cpp reads is alive and zero-padded
        for rec in (tgt, dft):  # the draft shares the target's placement (as llama.cpp's server does)
            assert rec["main_gpu"] == 1 and rec["split_mode"] == native.LLAMA_SPLIT_MODE_ROW
            assert rec["tensor_split"] == want_ts
        assert (eng.model.n_gpu_layers, eng.model.split_mode, eng.model.tensor_split) == (99, "row", (3.0, 1.0))
        assert eng.model_dft.n_gpu_layers == 7


@pytest.mark.parametrize("mode", ["none", "layer", "row"])
def test_split_modes_load_on_cpu(tiny_model, loads, mode):
    with L.Model(tiny_model("llama"), split_mode=mode, n_gpu_layers=99) as m:
        assert m.split_mode == mode and loads[-1]["split_mode"] == model_mod.SPLIT_MODES[mode]


def test_threads_reach_contexts(tiny_model):
    with Engine(str(tiny_model("llama")), draft=str(tiny_model("llama-draft")), n_ctx=64, n_threads=2,
                n_threads_batch=3, n_threads_draft=1) as eng:
        assert _threads(eng.ctx) == (2, 3)
        # llama.cpp: -td for the draft's generation; its batch threads (-tbd) default to the target's -tb
        assert _threads(eng.ctx_dft) == (1, 3)
    with Engine(str(tiny_model("llama")), draft=str(tiny_model("llama-draft")), n_ctx=64, n_threads=2) as eng:
        assert _threads(eng.ctx) == (2, 2) and _threads(eng.ctx_dft) == (2, 2)  # -tb and -td default to -t


def test_loaded_model_ignores_offload(tiny_model, loads, caplog):
    with L.Model(tiny_model("llama"), n_gpu_layers=0) as m:
        loads.clear()
        with caplog.at_level(logging.WARNING, logger="llamaspec"):
            with Engine(m, n_ctx=64, n_gpu_layers=99, n_threads=2) as eng:
                assert _threads(eng.ctx) == (2, 2)  # threads are context settings: they still apply
        assert loads == [] and m.n_gpu_layers == 0
        assert "already loaded" in caplog.text


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(n_gpu_layers=-2), "n_gpu_layers (-ngl) must be >= 0"),
        (dict(n_gpu_layers_draft=-5), "n_gpu_layers_draft (-ngld) must be >= 0"),
        (dict(n_gpu_layers=1.5), "n_gpu_layers (-ngl) must be an integer"),
        (dict(split_mode="rows"), "unknown split mode 'rows'"),
        (dict(tensor_split=[]), "tensor_split (-ts) is empty"),
        (dict(tensor_split=[1.0] * (MAX_DEV + 1)), f"at most {MAX_DEV} devices"),
        (dict(tensor_split=[1, -1]), "finite numbers >= 0"),
        (dict(tensor_split=[1, math.nan]), "finite numbers >= 0"),
        (dict(tensor_split="3,1"), "must be a list of proportions"),
        (dict(main_gpu=-1), "main_gpu (-mg) must be a GPU index"),
        (dict(main_gpu=MAX_DEV), "main_gpu (-mg) must be a GPU index"),
        (dict(n_threads=0), "n_threads (-t) must be an integer >= 1"),
        (dict(n_threads_batch=-1), "n_threads_batch (-tb) must be an integer >= 1"),
        (dict(n_threads_draft=0), "n_threads_draft (-td) must be an integer >= 1"),
    ],
)
def test_engine_rejects_bad_values_before_loading(tiny_model, loads, kw, msg):
    with pytest.raises(UsageError) as ei:
        Engine(str(tiny_model("llama")), n_ctx=64, **kw)
    assert msg in str(ei.value) and "\n" not in str(ei.value)
    assert loads == []  # nothing was loaded


def test_model_rejects_bad_values(tiny_model):
    with pytest.raises(UsageError, match="split mode"):
        L.Model(tiny_model("llama"), split_mode="diagonal")


def test_negative_one_and_max_entries_are_accepted(tiny_model, loads):
    with L.Model(tiny_model("llama"), n_gpu_layers=-1, tensor_split=[1.0] * MAX_DEV, main_gpu=MAX_DEV - 1):
        assert loads[-1]["n_gpu_layers"] == -1 and loads[-1]["tensor_split"] == [1.0] * MAX_DEV


def test_doctests():
    import llamaspec.cli.device_options

    for mod in (model_mod, llamaspec.cli.device_options):
        assert doctest.testmod(mod).failed == 0


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------


def test_ngl_99_on_cpu_build_gives_the_same_greedy_output(tiny_model):
    base = ["generate", "tok_5 tok_9", "-m", str(tiny_model("llama")), "-n", "16", "--temp", "0", "-q", "-c", "128"]
    a = run(*base)
    b = run(*base, "-ngl", "99", "-sm", "layer", "-ts", "3,1", "-mg", "0", "-t", "2", "-tb", "2")
    c = run(*base, "-ngl", "all")
    assert a.exit_code == b.exit_code == c.exit_code == 0, (a.output, b.output, c.output)
    assert a.stdout and a.stdout == b.stdout == c.stdout


def test_ngl_with_draft_model_same_greedy_output(tiny_model):
    base = ["generate", "tok_5 tok_9", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")),
            "-n", "16", "--temp", "0", "-q", "-c", "128"]
    a = run(*base)
    b = run(*base, "-ngl", "99", "-ngld", "99", "-t", "2", "-td", "1")
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    assert a.stdout and a.stdout == b.stdout


def test_generate_flags_reach_llama_cpp(tiny_model, loads, contexts):
    r = run("generate", "tok_5", "-m", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")), "-n", "4",
            "--temp", "0", "-q", "-c", "128", "-ngl", "5", "-ngld", "3", "-mg", "1", "-sm", "none", "-ts", "1/2",
            "-t", "2", "-tb", "3", "-td", "1")
    assert r.exit_code == 0, r.output
    tgt, dft = loads
    assert (tgt["n_gpu_layers"], dft["n_gpu_layers"]) == (5, 3)
    for rec in (tgt, dft):
        assert rec["main_gpu"] == 1 and rec["split_mode"] == native.LLAMA_SPLIT_MODE_NONE
        assert rec["tensor_split"][:3] == [1.0, 2.0, 0.0]
    assert (2, 3) in contexts and (1, 3) in contexts  # target (-t, -tb), draft (-td, target's -tb)


def test_probe_flags_reach_llama_cpp(tiny_model, loads, contexts):
    r = run("probe", str(tiny_model("llama")), "-md", str(tiny_model("llama-draft")), "--json", "--no-bench",
            "-ngl", "4", "-ngld", "2", "-sm", "row", "-t", "2", "-tb", "3", "-td", "1")
    assert r.exit_code == 0, r.output
    assert [x["n_gpu_layers"] for x in loads] == [4, 2]
    assert all(x["split_mode"] == native.LLAMA_SPLIT_MODE_ROW for x in loads)
    assert set(contexts) == {(2, 3), (1, 3)}  # target scratch contexts, draft scratch contexts
    assert json.loads(r.stdout)["target"]["level"] == "PART"


def test_bench_flags_reach_llamaspec_engine(loads, contexts, tmp_path):
    out = tmp_path / "r.json"
    r = run("bench", "--quick", "--engines", "llamaspec", "--modes", "plain,draft-simple", "--no-costs", "--no-warmup",
            "--no-progress", "--limit", "1", "-n", "4", "-ngl", "99", "-t", "2", "-tb", "3", "-td", "1",
            "--json", str(out))
    assert r.exit_code == 0, r.output
    assert [x["n_gpu_layers"] for x in loads[:2]] == [99, 99]  # target, draft (-ngld defaults to -ngl here)
    assert (2, 3) in contexts and (1, 3) in contexts  # target (-t, -tb) and draft (-td, -tb) contexts
    s = json.loads(out.read_text())["settings"]
    assert (s["threads"], s["threads_batch"], s["threads_draft"]) == (2, 3, 1)
    assert (s["n_gpu_layers"], s["n_gpu_layers_draft"]) == (99, 99)


def test_bench_default_stays_on_cpu_and_native_args():
    from llamaspec.bench.native import RunSettings, common_args, draft_device_args
    from llamaspec.bench.runners import _lcp_placement
    from llamaspec.params import SpecParams

    a = common_args(RunSettings(64, 32, 4, True, 1))
    assert a[a.index("-ngl") + 1] == "0" and a[a.index("-tb") + 1] == "4" and "-sm" not in a and "-ts" not in a
    s = RunSettings(64, 32, 4, True, 1, threads_batch=6, threads_draft=2, n_gpu_layers=-1, n_gpu_layers_draft=5,
                       main_gpu=1, split_mode="row", tensor_split=(3.0, 1.0))
    a = common_args(s)
    assert [a[a.index(f) + 1] for f in ("-t", "-tb", "-ngl", "-mg", "-sm", "-ts")] == ["4", "6", "all", "1", "row", "3.0,1.0"]
    assert draft_device_args(s) == ["-ngld", "5", "-td", "2"]
    p = _lcp_placement(RunSettings(64, 32, 4, True, 1, SpecParams(), main_gpu=1, split_mode="row", tensor_split=(3.0, 1.0)))
    assert p == {"main_gpu": 1, "split_mode": native.LLAMA_SPLIT_MODE_ROW, "tensor_split": [3.0, 1.0]}


@pytest.mark.parametrize(
    "args,msg",
    [
        (["generate", "x", "-ngl", "-2"], "n_gpu_layers (-ngl) must be >= 0"),
        (["generate", "x", "-ngl", "lots"], "-ngl: expected an integer or all"),
        (["generate", "x", "-ngld", "-3"], "n_gpu_layers_draft (-ngld) must be >= 0"),
        (["generate", "x", "-sm", "rows"], "unknown split mode 'rows'"),
        (["generate", "x", "-ts", "3,x"], "-ts: expected proportions per GPU"),
        (["generate", "x", "-ts", ""], "tensor_split (-ts) is empty"),
        (["generate", "x", "-ts", ",".join(["1"] * (MAX_DEV + 1))], f"at most {MAX_DEV} devices"),
        (["generate", "x", "-ts", "1,-1"], "finite numbers >= 0"),
        (["generate", "x", "-mg", "-1"], "main_gpu (-mg) must be a GPU index"),
        (["generate", "x", "-t", "0"], "n_threads (-t) must be an integer >= 1"),
        (["generate", "x", "-tb", "abc"], "-tb: expected an integer"),
        (["generate", "x", "-td", "-4"], "n_threads_draft (-td) must be an integer >= 1"),
        (["probe", "-ngl", "-9"], "n_gpu_layers (-ngl) must be >= 0"),
        (["probe", "-sm", "diagonal"], "unknown split mode"),
        (["bench", "--quick", "-ts", "1,nan"], "finite numbers >= 0"),
        (["bench", "--quick", "-tb", "0"], "n_threads_batch (-tb) must be an integer >= 1"),
    ],
)
def test_cli_bad_values_are_one_line_exit_2(args, msg):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and "Traceback" not in r.output
    assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


@pytest.mark.skipif(bool(native.llama_supports_gpu_offload()), reason="this llama.cpp has a GPU backend")
def test_split_mode_tensor_without_gpu_is_one_line(tiny_model, loads):
    # llama.cpp cannot load with tensor parallelism and no GPU (its own error is a bare "failed to load"):
    # refused up front with the reason
    r = run("generate", "x", "-m", str(tiny_model("llama")), "-n", "2", "-sm", "tensor")
    assert r.exit_code == 2 and "Traceback" not in r.output and loads == []
    assert "no GPU backend" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_help_lists_the_flags():
    for cmd in ("generate", "probe", "bench"):
        h = run(cmd, "--help").output
        for flag in ("-ngl", "-ngld", "-mg", "-sm", "-ts", "-t,", "-tb", "-td"):
            assert flag in h, (cmd, flag)
