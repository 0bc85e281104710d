"""One runner per engine: llamaspec (in-process), native llama.cpp tools, llama-cpp-python's ``Llama``.

Every runner has the same shape: ``supports(mode)`` (None, or why not), ``prepare(mode)`` (load models,
start servers — never timed), ``run(mode, prompt, n_predict, repeat)`` -> :class:`RunResult`, ``close()``.
Models are loaded once per runner and reused by every run.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Sequence

from .. import _llama as llama
from .._llama import lcp
from .modes import Mode
from .native import (SERVER, SPEC_SIMPLE, RunSettings, Server, common_args, draft_device_args, find_tool,
                     per_pos_from_metrics, run_spec_simple_parsed, spec_args)
from .stats import RunResult

ENGINES = ("llamaspec", "native", "llama-cpp-python", "native-server")

log = logging.getLogger("llamaspec")


@dataclass(frozen=True)
class BenchPrompt:
    """A prompt as every engine sees it: the text, and its tokens (target vocabulary, BOS added, special
    tokens parsed — what ``llama-speculative-simple`` does with ``-p``)."""

    id: str
    category: str
    text: str
    tokens: tuple[int, ...]
    piece_prefix: str  # the prompt as llama-speculative-simple echoes it (pieces with special tokens)


def _lcp_placement(s: RunSettings) -> dict:
    """llama-cpp-python ``Llama`` arguments for the multi-GPU placement (only those that were set)."""
    out: dict = {}
    if s.main_gpu is not None:
        out["main_gpu"] = s.main_gpu
    if s.split_mode is not None:
        out["split_mode"] = lcp.split_mode(s.split_mode)
    if s.tensor_split is not None:
        out["tensor_split"] = list(s.tensor_split)
    return out


def prepare_prompts(model: llama.Model, prompts) -> list[BenchPrompt]:
    out = []
    for p in prompts:
        toks = model.vocab.tokenize(p.text, add_special=True, parse_special=True)
        prefix = b"".join(model.vocab.token_to_piece(t, special=True) for t in toks).decode("utf-8", "replace")
        out.append(BenchPrompt(p.id, p.category, p.text, tuple(toks), prefix))
    return out


class Runner:
    name = "?"
    has_draft = False

    def supports(self, mode: Mode) -> str | None:
        """None, or why this engine does not run ``mode`` (here: the llamaspec and native runners' reasons)."""
        if mode.kind == "lookup":
            return "prompt lookup is llama-cpp-python's drafter"
        if mode.needs_draft and not self.has_draft:
            return "no draft model (give --pair or -md)"
        return None

    def prepare(self, mode: Mode) -> None:
        pass

    def tool(self, mode: Mode) -> str:
        return "in-process"

    def run(self, mode: Mode, prompt: BenchPrompt, n_predict: int, repeat: int) -> RunResult:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _result(self, mode: Mode, prompt: BenchPrompt, repeat: int, **kw) -> RunResult:
        if mode.is_plain:  # no speculation: no drafting counts
            kw.update(n_drafted=None, n_accepted=None, n_verif_steps=None, accepted_per_pos=None)
        return RunResult(engine=self.name, mode=mode.name, prompt_id=prompt.id, category=prompt.category, repeat=repeat,
                         tool=self.tool(mode), **kw)


# -------------------------------------------------------------------------------------------------
# llamaspec
# -------------------------------------------------------------------------------------------------


class LlamaspecRunner(Runner):
    name = "llamaspec"

    def __init__(self, target: llama.Model, draft: llama.Model | None, settings: RunSettings):
        self.model, self.model_dft, self.s = target, draft, settings
        self.has_draft = draft is not None
        self.engines: dict[str, object] = {}

    def prepare(self, mode: Mode) -> None:
        from ..engine import Engine

        if mode.name in self.engines:
            return
        # draft-mtp needs the target loaded with its MTP blocks: the engine loads its own copy
        target = self.model.path if "draft-mtp" in mode.types else self.model
        spec = mode.spec_params(self.s.spec)
        draft = self.model_dft if mode.uses_draft else None
        if draft is not None and spec.draft_trim()[0]:
            draft = draft.path  # the engine loads the trimmed copy of the draft (a loaded model is used as is)
        self.engines[mode.name] = Engine(
            target, draft=draft, spec=spec,
            n_ctx=self.s.n_ctx, n_batch=self.s.n_batch, flash_attn=self.s.flash_attn,
            **(dict(n_threads=mode.threads, n_threads_batch=mode.threads, n_threads_draft=mode.threads) if mode.threads
               else dict(n_threads=self.s.threads, n_threads_batch=self.s.threads_batch or None,
                         n_threads_draft=self.s.threads_draft or None) if self.s.threads_given else {}))

    def run(self, mode: Mode, prompt: BenchPrompt, n_predict: int, repeat: int) -> RunResult:
        self.prepare(mode)
        eng = self.engines[mode.name]
        for d in eng.chain.impls if eng.chain is not None else ():
            if getattr(d, "pool", None) is not None:  # each run sees its prompt for the first time (the
                d.pool.clear()  # shared n-gram pool would remember earlier repeats; bench --trace measures that)
        r = eng.generate(list(prompt.tokens), n_predict=n_predict, sampling=llama.SamplingParams(temp=0.0, seed=self.s.seed))
        st = r.stats
        return self._result(mode, prompt, repeat, n_prompt=st.n_prompt or len(prompt.tokens), n_predicted=len(r.tokens),
                            t_prompt_s=st.t_prompt_s, t_decode_s=st.t_decode_s, n_drafted=st.n_drafted,
                            n_accepted=st.n_accepted, n_verif_steps=st.n_verif_steps,
                            accepted_per_pos=list(st.n_accepted_per_pos), tokens=list(r.tokens), text=r.text)

    def close(self) -> None:
        for e in self.engines.values():
            e.close()
        self.engines.clear()


# -------------------------------------------------------------------------------------------------
# native llama.cpp
# -------------------------------------------------------------------------------------------------


class NativeRunner(Runner):
    """``llama-speculative-simple`` for single-sequence draft-model runs, ``llama-server`` for everything
    else (``force_server``: the server for every mode — engine name ``native-server``)."""

    def __init__(self, target: str, draft: str | None, settings: RunSettings, *, native_dir: str | None = None,
                 force_server: bool = False, log_dir: str | None = None):
        self.name = "native-server" if force_server else "native"
        self.target, self.draft, self.s = target, draft, settings
        self.force_server, self.has_draft = force_server, bool(draft)
        self.server_bin = find_tool(SERVER, native_dir)
        self.simple_bin = find_tool(SPEC_SIMPLE, native_dir)
        self.servers: dict[str, Server] = {}
        self.log_dir = log_dir
        self.commands: dict[str, list[str]] = {}

    def nsettings(self, mode: Mode) -> RunSettings:
        s, t = self.s, mode.threads
        return dataclasses.replace(s, threads=t or s.threads, threads_batch=t or s.threads_batch,
                                   threads_draft=t or s.threads_draft)

    def tool(self, mode: Mode) -> str:
        if not self.force_server and mode.types == ("draft-simple",) and mode.synth_len is None:
            return SPEC_SIMPLE
        return SERVER

    def supports(self, mode: Mode) -> str | None:
        why = super().supports(mode)
        own = [t for t in mode.types if t in ("auto", "ngram-lookup")]
        if why is not None or own:
            return why or f"{own[0]} is llamaspec's own (beyond llama.cpp)"
        if mode.is_default:
            return "llamaspec's defaults (adaptive length, trimmed draft vocabulary) are its own"
        tool = self.tool(mode)
        if (self.simple_bin if tool == SPEC_SIMPLE else self.server_bin) is None:
            return f"native tool {tool} is not built (run scripts/build_llama_cpp.sh --targets tools)"
        return None

    def _args(self, mode: Mode) -> list[str]:
        ns = self.nsettings(mode)
        return common_args(ns) + spec_args(mode, self.s.spec, self.draft) + (draft_device_args(ns) if mode.needs_draft else [])

    def prepare(self, mode: Mode) -> None:
        if self.tool(mode) != SERVER or mode.name in self.servers:
            return
        srv = Server(self.server_bin, self.target, self._args(mode), log_dir=self.log_dir, label=f"{self.name}-{mode.name}")
        srv.start()
        self.servers[mode.name] = srv
        self.commands[mode.name] = srv.command()

    def run(self, mode: Mode, prompt: BenchPrompt, n_predict: int, repeat: int) -> RunResult:
        if self.tool(mode) == SPEC_SIMPLE:
            return self._run_simple(mode, prompt, n_predict, repeat)
        self.prepare(mode)
        res, delta = self.servers[mode.name].complete_counted(prompt.tokens, n_predict, self.s.seed)
        t = res.get("timings", {})
        return self._result(
            mode, prompt, repeat, n_prompt=int(t.get("prompt_n", len(prompt.tokens))),
            n_predicted=int(t.get("predicted_n", res.get("tokens_predicted", 0))),
            t_prompt_s=float(t.get("prompt_ms", 0.0)) / 1e3, t_decode_s=float(t.get("predicted_ms", 0.0)) / 1e3,
            n_drafted=int(round(delta.get("spec_decode_num_draft_tokens_total", 0))),
            n_accepted=int(round(delta.get("spec_decode_num_accepted_tokens_total", 0))),
            n_verif_steps=int(round(delta.get("spec_decode_num_drafts_total", 0))),
            accepted_per_pos=per_pos_from_metrics(delta), tokens=[int(x) for x in res.get("tokens", [])],
            text=res.get("content", ""))

    def _run_simple(self, mode: Mode, prompt: BenchPrompt, n_predict: int, repeat: int) -> RunResult:
        cmd, r = run_spec_simple_parsed(self.simple_bin, self.target, self._args(mode), prompt.text, n_predict,
                                        prompt.piece_prefix)
        self.commands[mode.name] = cmd[:4] + ["PROMPT"] + cmd[5:]
        return self._result(mode, prompt, repeat, n_prompt=r.n_prompt, n_predicted=r.n_predicted,
                            # the tool's decode timer covers every generated token (the first one included)
                            t_prompt_s=r.t_prompt_s,
                            t_decode_s=r.t_decode_s * (r.n_predicted - 1) / r.n_predicted if r.n_predicted > 1 else r.t_decode_s,
                            n_drafted=r.n_drafted, n_accepted=r.n_accepted, n_verif_steps=r.n_verif_steps,
                            accepted_per_pos=r.accepted_per_pos, tokens=None, text=r.text)

    def close(self) -> None:
        for s in self.servers.values():
            s.stop()
            s.remove_log()
        self.servers.clear()


# -------------------------------------------------------------------------------------------------
# llama-cpp-python
# -------------------------------------------------------------------------------------------------


class _CountingLookup:
    """Wraps ``LlamaPromptLookupDecoding`` and records every draft with the input length it was made for."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, input_ids, /, **kwargs):
        d = self.inner(input_ids, **kwargs)
        self.calls.append((len(input_ids), [int(x) for x in d]))
        return d


def lookup_stats(calls: Sequence[tuple[int, Sequence[int]]], sequence: Sequence[int], n_ctx_end: int) -> tuple[int, int, int, list[int]]:
    """(drafted, accepted, steps, per-position counts) of prompt-lookup drafts against the final token
    sequence (greedy: a drafted token is accepted iff it equals the token generated at its position).

    ``n_ctx_end`` = length of prompt + generated tokens; drafts are only verified up to it.

    >>> lookup_stats([(3, [9, 9]), (5, []), (5, [4, 7])], [1, 2, 3, 9, 5, 4, 8], 7)
    (4, 2, 2, [2, 0])
    """
    drafted = accepted = steps = 0
    per: list[int] = []
    for n_in, d in calls:
        if not d or n_in >= n_ctx_end:
            continue
        steps += 1
        drafted += len(d)
        j = 0
        while j < len(d) and n_in + j < n_ctx_end and sequence[n_in + j] == d[j]:
            j += 1
        accepted += j
        while len(per) < len(d):
            per.append(0)
        for i in range(j):
            per[i] += 1
    return drafted, accepted, steps, per


class LlamaCppPythonRunner(Runner):
    name = "llama-cpp-python"

    def __init__(self, target: str, settings: RunSettings):
        self.target, self.s = target, settings
        self.llms: dict[str, object] = {}
        self.drafts: dict[str, _CountingLookup] = {}

    def supports(self, mode: Mode) -> str | None:
        if mode.kind in ("plain", "lookup"):
            return None
        return "llama-cpp-python has no llama.cpp drafter chain (only plain and prompt lookup)"

    def prepare(self, mode: Mode) -> None:
        if mode.name in self.llms:
            return

        draft = None
        if mode.kind == "lookup":
            draft = _CountingLookup(lcp.prompt_lookup_decoding(mode.lookup_n))
            self.drafts[mode.name] = draft
        self.llms[mode.name] = lcp.load_llama(
            self.target, n_ctx=self.s.n_ctx, n_batch=self.s.n_batch, n_ubatch=self.s.n_batch,
            n_threads=mode.threads or self.s.threads,
            n_threads_batch=mode.threads or self.s.threads_batch or self.s.threads, flash_attn=self.s.flash_attn, seed=self.s.seed,
            n_gpu_layers=self.s.n_gpu_layers, draft_model=draft, verbose=False, **_lcp_placement(self.s))

    def run(self, mode: Mode, prompt: BenchPrompt, n_predict: int, repeat: int) -> RunResult:
        self.prepare(mode)
        llm = self.llms[mode.name]
        draft = self.drafts.get(mode.name)
        if draft is not None:
            draft.calls.clear()
        is_eog = lcp.eog_test(llm)
        llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        gen = llm.generate(list(prompt.tokens), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                if t_first is None:
                    t_first = time.perf_counter()
                out.append(int(tok))
                if is_eog(tok) or len(out) >= n_predict:
                    break
        finally:
            gen.close()
        t_end = time.perf_counter()
        t_first = t_first or t_end
        kw = {}
        if draft is not None:
            seq = list(prompt.tokens) + out
            d, a, s, per = lookup_stats(draft.calls, seq, len(seq))
            kw = dict(n_drafted=d, n_accepted=a, n_verif_steps=s, accepted_per_pos=per)
        return self._result(mode, prompt, repeat, n_prompt=len(prompt.tokens), n_predicted=len(out),
                            t_prompt_s=t_first - t0, t_decode_s=t_end - t_first, tokens=out, text=None, **kw)

    def close(self) -> None:
        for llm in self.llms.values():
            try:
                llm.close()
            except Exception as ex:  # pragma: no cover - best effort
                log.warning("bench: closing a llama-cpp-python Llama failed (skipped): %s", ex)
        self.llms.clear()
