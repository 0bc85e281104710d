"""pytest plugin: run llama-cpp-python 0.3.36's own tests (an unmodified copy, see setup.sh) offline, against local
GGUFs, with ``llama_cpp.Llama`` or with ``llamaspec.Llama`` in its place.

Load with ``PYTHONPATH=<this folder> pytest -p lcp_local_models ...`` (run.sh does it). What it does:

* ``huggingface_hub.hf_hub_download`` (the tests' only hub access; patched before the test modules import it)
  returns a local GGUF for the (repo, file) pairs below: a model from llamaspec's models.toml, or for the
  recurrent and hybrid cases a tiny random-weight model of that kind (``tiny:mamba``, ``tiny:lfm2``: those tests
  only compare a model with itself), and SKIPs the test for the others. Environment variables override each
  substitute with a path, a models.toml name or ``tiny:KIND`` (empty: skip).
* ``LCPTEST_IMPL=llamaspec`` (or ``--lcp-impl llamaspec``): after collection, every test module's global
  ``llama_cpp`` is replaced by a module proxy whose ``Llama`` is ``llamaspec.Llama`` and whose every other name
  is llama-cpp-python's own (``LlamaGrammar``, ``LogitsProcessorList``, ``LlamaRAMCache`` ...). The default,
  ``llama_cpp``, runs the tests as they are: the reference.
* ``LCPTEST_DRAFT`` (llamaspec only): the ``draft_model`` every ``llamaspec.Llama`` gets unless the test gives one:
  a GGUF path or models.toml name, ``self`` (the target's own file: every draft accepted) or ``prompt-lookup``
  (llama-cpp-python's ``LlamaPromptLookupDecoding``), so the same tests run through the speculative path.
* ``LCPTEST_REPORT=FILE``: every test's outcome as JSON (``{nodeid: {"outcome": ..., "reason": ...}}``), for
  compare.py.
* llama-cpp-python's ``Llama`` loads without llama.cpp's extra weight buffers where llamaspec's models do (a CPU
  that advertises AMX without supporting it: see llamaspec/_llama/cpu_features.py), so a quantized model does not
  SIGILL the run; the tests' code is untouched.
"""
from __future__ import annotations

import json
import os
import types

import pytest

SUBSTITUTES = {
    # (repo_id, filename): (environment variable, default models.toml name or None = skip)
    ("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf"): ("LCPTEST_MODEL_REAL", "gemma3-270m-f32"),
    ("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf"): ("LCPTEST_MODEL_TRANSFORMER", "smollm2-135m-q4_1"),
    ("CompendiumLabs/bge-small-en-v1.5-gguf", "bge-small-en-v1.5-q4_k_m.gguf"): ("LCPTEST_MODEL_EMBEDDING", None),
    ("QuantFactory/mamba-130m-hf-GGUF", "mamba-130m-hf.Q2_K.gguf"): ("LCPTEST_MODEL_RECURRENT", "tiny:mamba"),
    ("tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF", "Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf"):
        ("LCPTEST_MODEL_HYBRID", "tiny:lfm2"),
}
#: ``tiny:KIND``: llamaspec's deterministic tiny random-weight model of that kind (llamaspec.testing.tiny_models),
#: written once into the work folder, with a BOS it adds and an EOS (the tests build prompts that need both)
TINY_VOCAB = dict(bos_token_id=1, eos_token_id=63, add_bos_token=True)
#: tests a tiny substitute cannot serve: their premise is "The quick brown fox" and "The slow brown fox" starting
#: with the same token, and the tiny tokenizer (5-byte chunks, never a BOS) splits "The q" / "The s"
TINY_SKIP = ("test_recurrent_model_prompt_cache_reset", "test_hybrid_model_prompt_cache_reset")

_resolved: dict[tuple[str, str], "str | None"] = {}


def _tiny(kind: str) -> str:
    from llamaspec.testing.tiny_models import write_model

    work = os.environ.get("LCPTEST_WORK", os.path.expanduser("~/.cache/llamaspec-lcp-tests"))
    path = os.path.join(work, "tiny", f"{kind}.gguf")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + f".{os.getpid()}.tmp"
        write_model(kind, tmp, **TINY_VOCAB)
        os.replace(tmp, path)
    return path


def _local(value: "str | None") -> "str | None":
    if not value:
        return None
    if value.startswith("tiny:"):
        return _tiny(value[len("tiny:"):])
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        return path
    from llamaspec import models

    return str(models.resolve_model(value))


def local_model(repo_id: str, filename: str) -> "str | None":
    key = (repo_id, filename)
    if key not in _resolved:
        env, default = SUBSTITUTES.get(key, (None, None))
        _resolved[key] = _local(os.environ.get(env, default) if env else None)
    return _resolved[key]


def hf_hub_download(repo_id: str, filename: str, *args, **kwargs) -> str:
    path = local_model(repo_id, filename)
    if path is None:
        pytest.skip(f"offline: no local substitute for {repo_id}/{filename}")
    test = os.environ.get("PYTEST_CURRENT_TEST", "")
    if os.path.dirname(path).endswith(os.sep + "tiny") and any(t in test for t in TINY_SKIP):
        pytest.skip(f"the tiny substitute for {repo_id} has no BOS: the test's two prompts differ in their first token")
    return path


os.environ.setdefault("HF_HUB_OFFLINE", "1")
import huggingface_hub  # noqa: E402

huggingface_hub.hf_hub_download = hf_hub_download

import llama_cpp  # noqa: E402
from llamaspec._llama.lcp import llama_without_extra_buffers  # noqa: E402

llama_without_extra_buffers()
llama_cpp.llama_model_default_params = llama_cpp.llama_cpp.llama_model_default_params  # test_real_model's own use


def pytest_addoption(parser):
    parser.addoption("--lcp-impl", choices=("llama_cpp", "llamaspec"), default=None,
                     help="the Llama class under test (default: $LCPTEST_IMPL or llama_cpp)")


def _impl(config) -> str:
    return config.getoption("--lcp-impl") or os.environ.get("LCPTEST_IMPL", "llama_cpp")


def _draft_for(model_path):
    spec = os.environ.get("LCPTEST_DRAFT", "")
    if not spec:
        return None
    if spec == "self":
        return str(model_path)
    if spec == "prompt-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        return LlamaPromptLookupDecoding()
    return _local(spec)


def _llamaspec_class():
    import llamaspec

    if not os.environ.get("LCPTEST_DRAFT"):
        return llamaspec.Llama

    class Llama(llamaspec.Llama):  # the test's own arguments, plus a draft model
        def __init__(self, model_path, *args, **kwargs):
            if "draft_model" not in kwargs and not kwargs.get("vocab_only"):
                kwargs["draft_model"] = _draft_for(model_path)
            super().__init__(model_path, *args, **kwargs)

    Llama.__module__ = "llamaspec.compat.llama"
    return Llama


class _LlamaCppProxy(types.ModuleType):
    """``llama_cpp`` with another ``Llama``: every other attribute is the real module's."""

    def __getattr__(self, name):
        return getattr(llama_cpp, name)


def pytest_collection_modifyitems(config, items):
    if _impl(config) != "llamaspec":
        return
    cls = _llamaspec_class()
    proxy = _LlamaCppProxy("llama_cpp")
    proxy.Llama = cls
    for mod in {id(getattr(it, "module", None)): getattr(it, "module", None) for it in items}.values():
        if mod is None:
            continue
        if getattr(mod, "llama_cpp", None) is llama_cpp:
            mod.llama_cpp = proxy
        if getattr(mod, "Llama", None) is llama_cpp.Llama:
            mod.Llama = cls


def pytest_report_header(config):
    lines = [f"lcp_local_models: Llama = {_impl(config)}"
             + (f" (draft_model={os.environ['LCPTEST_DRAFT']})" if os.environ.get("LCPTEST_DRAFT") else "")]
    for (repo, name), (env, default) in SUBSTITUTES.items():
        lines.append(f"  {repo}/{name} -> {os.environ.get(env, default) or 'SKIP'}  (${env})")
    return lines


_outcomes: dict[str, dict] = {}


def _where(report) -> str:
    """``file:line`` of the failing line in the test file (where llama-cpp-python's test stopped)."""
    entries = getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None) or []
    where = ""
    for e in entries:
        loc = getattr(e, "reprfileloc", None)
        if loc is not None and os.path.basename(str(loc.path)).startswith("test_"):
            where = f"{os.path.basename(str(loc.path))}:{loc.lineno}"
    return where


def pytest_runtest_logreport(report):
    nid = report.nodeid
    if report.when != "call" and report.outcome == "passed":
        return
    cur = _outcomes.get(nid)
    if cur is not None and cur["outcome"] != "passed":
        return  # the first failure or skip stands (a teardown error after a failed call)
    where = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        reason = report.longrepr[2]
    elif report.outcome == "failed":
        crash = getattr(report.longrepr, "reprcrash", None)
        reason = crash.message.splitlines()[0] if crash is not None and crash.message else str(report.longrepr)[-300:]
        where = _where(report)
    else:
        reason = ""
    outcome = "error" if report.outcome == "failed" and report.when != "call" else report.outcome
    _outcomes[nid] = {"outcome": outcome, "reason": reason[:300], "where": where}


def pytest_sessionfinish(session):
    path = os.environ.get("LCPTEST_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
