"""The copy-heavy prompt set against llama-cpp-python's prompt lookup (issue 25, ``python -m benchmarks.research --copy-set``).

The set (``data/copy-set.jsonl``, 16 prompts of 8 kinds: lists with alternating items, list edits, renames of a
local name and of a function or class in code, one token changed in one of many similar lines, JSON / table
reformatting, quoting a passage back, code refactors)
is split once, in the file (``"half"``), into a ``tune`` half (policy work may look at it) and a ``held-out``
half (it may not); every kind has one prompt in each half. Each line holds the user's message (``"user"``,
rendered with the model's chat template, or Gemma's turn markers for a Gemma GGUF without one: ``--copy-format
auto``, the default) and the same message as a plain ``User: ... Assistant:`` prompt (``"prompt"``,
``--copy-format plain``; also what ``llamaspec bench --prompts`` reads).

For every prompt, interleaved (the bench schedule: every configuration back to back, order reversed on odd
repeats), greedy, same model and ``n_predict``:

* ``llama-cpp-python/plain``: ``llama_cpp.Llama`` without a draft model;
* ``llama-cpp-python/lookup:N``: ``llama_cpp.Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=N))``
  at its other defaults (``max_ngram_size=2``); N = 10 (its default) and 2 (``--lookup-n``); the best of them
  per prompt (chosen after the fact) is the anchor;
* ``llamaspec/default``: llamaspec's :class:`~llamaspec.engine.Engine` with its command-line defaults and no
  draft model (``--spec-type auto``: ngram-lookup over the request's own text, plus the shared pool, which the
  bench clears before each run: every run sees its prompt for the first time);
* ``llamaspec/plain``: the reference every greedy output is compared with (near-tie aware: a difference where
  the two tokens are within ``--near-tie-tol`` of the top logit, teacher-forced, is a near-tie).

The report: per prompt, decode tokens/s of each, llamaspec over the best prompt-lookup setting; per half and
overall the median and the minimum of that ratio, against the issue's targets (every prompt ×1.0, median ×1.3).
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from llamaspec.errors import UsageError
from llamaspec.bench.prompts import Prompt

__all__ = ["DATA", "LOOKUP_NS", "CopyPrompt", "load_copy_set", "render_prompts", "modes_for", "summarise_copy",
           "render_copy_markdown", "probe_plain_tps", "TARGET_MIN", "TARGET_MEDIAN"]

DATA = Path(__file__).parent / "data" / "copy-set.jsonl"
#: num_pred_tokens of the prompt-lookup settings (10: LlamaPromptLookupDecoding's default)
LOOKUP_NS = (10, 2)
HALVES = ("tune", "held-out")
TARGET_MIN, TARGET_MEDIAN = 1.0, 1.3
LS = "llamaspec/default"


@dataclass(frozen=True)
class CopyPrompt:
    id: str
    category: str
    half: str
    user: str
    prompt: str


def load_copy_set(path: str | Path | None = None, half: str = "all") -> list[CopyPrompt]:
    """The set (default: the shipped one), or one half of it.

    >>> ps = load_copy_set()
    >>> len(ps), sorted({p.half for p in ps}), len(load_copy_set(half="held-out"))
    (16, ['held-out', 'tune'], 8)
    >>> all(sum(q.category == p.category for q in ps if q.half == "tune") == 1 for p in ps)
    True
    """
    p = Path(path) if path is not None else DATA
    if half not in ("all", *HALVES):
        raise UsageError(f"--copy-half must be all, tune or held-out, not {half!r}")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UsageError(f"copy set not found: {p}") from None
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            item = CopyPrompt(str(d["id"]), str(d.get("category", "copy")), str(d["half"]), str(d["user"]),
                              str(d.get("prompt") or f"User: {d['user']}\nAssistant:"))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UsageError(f"{p}:{i}: a copy-set line needs \"id\", \"half\" and \"user\"") from None
        if item.half not in HALVES:
            raise UsageError(f"{p}:{i}: \"half\" must be tune or held-out, not {item.half!r}")
        if any(o.id == item.id for o in out):
            raise UsageError(f"{p}:{i}: duplicate id {item.id!r}")
        out.append(item)
    sel = [x for x in out if half == "all" or x.half == half]
    if not sel:
        raise UsageError(f"{p}: no prompt in half {half!r}")
    return sel


#: Gemma's turn markers (its GGUFs here carry no chat template; the trace benchmark uses the same)
GEMMA_TURNS = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
FORMATS = ("auto", "chat", "gemma", "plain")


def render_prompts(items: Sequence[CopyPrompt], target: str, fmt: str = "auto") -> tuple[list[Prompt], str]:
    """Bench prompts and the format used: the user's message in the model's chat template (``chat``), in
    Gemma's turn markers (``gemma``), or the plain ``User: ... Assistant:`` prompt (``plain``); ``auto``: the
    model's template when it has one, else Gemma's markers for a Gemma model, else plain."""
    if fmt not in FORMATS:
        raise UsageError(f"--copy-format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt == "plain":
        return [Prompt(x.id, x.category, x.prompt) for x in items], fmt
    from llamaspec import _llama as llama
    from llamaspec.chat import apply_chat_template

    with llama.Model(target, vocab_only=True) as m:
        has_template, arch = m.chat_template() is not None, m.arch
        if fmt == "auto":
            fmt = "chat" if has_template else "gemma" if arch.startswith("gemma") else "plain"
        if fmt == "chat":
            if not has_template:
                raise UsageError(f"{Path(target).name} has no chat template: use --copy-format gemma or plain")
            return [Prompt(x.id, x.category, apply_chat_template(m, [{"role": "user", "content": x.user}]))
                    for x in items], fmt
    if fmt == "gemma":
        return [Prompt(x.id, x.category, GEMMA_TURNS.format(x.user)) for x in items], fmt
    return [Prompt(x.id, x.category, x.prompt) for x in items], fmt


def modes_for(lookup_ns: Sequence[int]) -> list[str]:
    """
    >>> modes_for((10, 2))
    ['plain', 'default', 'lookup:10', 'lookup:2']
    """
    return ["plain", "default", *[f"lookup:{n}" for n in dict.fromkeys(lookup_ns)]]


def probe_plain_tps(target: str, threads: int, n_ctx: int, prompt: str, n: int = 32) -> float:
    """Plain greedy decode tokens/s on ``prompt`` (for the runtime estimate printed up front)."""
    from llamaspec import _llama as llama
    from llamaspec.engine import Engine

    with llama.Model(target) as m, Engine(m, n_ctx=n_ctx, n_threads=threads or None, flash_attn=True) as e:
        r = e.generate(e.tokenize(prompt, parse_special=True), n_predict=n, sampling=llama.SamplingParams(temp=0.0))
        return r.stats.decode_tokens_per_second or 0.0


def _med(xs: Sequence[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summarise_copy(report: dict, items: Sequence[CopyPrompt]) -> dict:
    """Per prompt and per half (module docstring), from a bench report's runs and equality check."""
    runs = [r for r in report["runs"] if not r.get("error") and r["repeat"] >= 0]
    half = {x.id: x.half for x in items}
    divs = {(d["engine"], d["mode"], d["prompt_id"]): d for d in report["equality"]["divergences"]}
    rows = []
    for x in items:
        rs = [r for r in runs if r["prompt_id"] == x.id]
        cfgs = list(dict.fromkeys(f"{r['engine']}/{r['mode']}" for r in rs))
        tps, acc = {}, {}
        for c in cfgs:
            mine = [r for r in rs if f"{r['engine']}/{r['mode']}" == c]
            tps[c] = round(statistics.median(r["decode_tokens_per_second"] for r in mine), 2)
            dr = sum(r.get("n_drafted") or 0 for r in mine)
            acc[c] = {"drafted": dr // max(1, len(mine)), "accepted": sum(r.get("n_accepted") or 0 for r in mine) // max(1, len(mine))}
        lookups = [c for c in cfgs if c.startswith("llama-cpp-python/lookup:")]
        best = max(lookups, key=lambda c: tps[c]) if lookups else None
        ratio = round(tps[LS] / tps[best], 3) if best and LS in tps and tps[best] > 0 else None
        outputs = {}
        for c in cfgs:
            e, m = c.split("/", 1)
            d = divs.get((e, m, x.id))
            outputs[c] = "equal" if d is None else ("near-tie" if d.get("near_tie") else "DIFFERS")
        rows.append({"prompt": x.id, "category": x.category, "half": half[x.id], "tokens_per_s": tps, "drafts": acc,
                     "best_lookup": best, "ls_vs_best_lookup": ratio,
                     "ls_vs_lcp_plain": round(tps[LS] / tps["llama-cpp-python/plain"], 3)
                     if LS in tps and tps.get("llama-cpp-python/plain") else None, "outputs": outputs})
    halves = {}
    for h in (*HALVES, "all"):
        sel = [r["ls_vs_best_lookup"] for r in rows if (h == "all" or r["half"] == h) and r["ls_vs_best_lookup"] is not None]
        if sel:
            med, lo = _med(sel), round(min(sel), 3)
            halves[h] = {"n": len(sel), "median": med, "min": lo,
                         "min_prompt": next(r["prompt"] for r in rows if r["ls_vs_best_lookup"] == lo),
                         "met": lo >= TARGET_MIN and med >= TARGET_MEDIAN}
    bad = [f"{r['prompt']} {c}" for r in rows for c, o in r["outputs"].items() if o == "DIFFERS"]
    return {"rows": rows, "halves": halves, "targets": {"min": TARGET_MIN, "median": TARGET_MEDIAN},
            "real_divergences": bad}


def render_copy_markdown(report: dict) -> str:
    cs, s = report["copy_set"], report["settings"]
    lk = [m for m in s["modes"] if m.startswith("lookup:")]
    est = cs.get("estimate") or {}
    lines = ["# Copy-heavy prompts: llamaspec against llama-cpp-python's prompt lookup (issue 25)", "",
             f"- date: {report['created']}, duration {report['duration_s'] / 60:.1f} min"
             + (f" (estimated up front: at most {fmt_duration(est['estimate_s'])})" if est else ""),
             f"- command: `{report.get('command') or 'python -m benchmarks.research --copy-set'}`",
             f"- model `{s['target']}`, {s['n_prompts']} prompts ({cs['file']}, half: {cs['half']}, "
             f"format: {cs['format']}), {s['n_predict']} tokens, {s['repeats']} repeat(s), greedy, {s['threads']} threads, "
             f"context {s['n_ctx']}, flash attention {'on' if s['flash_attn'] else 'off'}",
             f"- machine: {report['machine'].get('cpu', '')}, load average at start "
             f"{_load(report['machine'].get('loadavg_at_start'))}, at end {_load(report['machine'].get('loadavg_at_end'))}",
             "- `lcp` = `llama_cpp.Llama`; `lookup:N` = `LlamaPromptLookupDecoding(num_pred_tokens=N)` (10 is its "
             "default); `llamaspec` = the Engine with llamaspec's command-line defaults, no draft model "
             "(`--spec-type auto`: n-grams of the request plus the shared pool, cleared before each run)", "",
             "## Against the targets", "",
             f"llamaspec / best prompt-lookup setting per prompt; targets: every prompt ×{TARGET_MIN:.1f}, median "
             f"×{TARGET_MEDIAN}.", "", "| half | prompts | median | min (prompt) | met |", "|---|---:|---:|---|---|"]
    for h, v in cs["halves"].items():
        lines.append(f"| {h} | {v['n']} | ×{v['median']:.2f} | ×{v['min']:.2f} ({v['min_prompt']}) | "
                     f"{'yes' if v['met'] else 'no'} |")
    head = ["half", "prompt", "kind", "lcp plain", *[f"lcp {m}" for m in lk], "llamaspec plain", "llamaspec",
            "llamaspec / best lookup",
            "llamaspec / lcp plain", "llamaspec drafted / accepted", "outputs"]
    lines += ["", "## Per prompt (decode tokens/s, median over repeats)", "", "| " + " | ".join(head) + " |",
              "|" + "---|" * 3 + "---:|" * (len(head) - 5) + "---|---|"]
    for r in cs["rows"]:
        t = r["tokens_per_s"]

        def c(k):
            return f"{t[k]:.1f}" if k in t else "–"

        cells = [r["half"], r["prompt"], r["category"], c("llama-cpp-python/plain"),
                 *[c(f"llama-cpp-python/{m}") + (" *" if r["best_lookup"] == f"llama-cpp-python/{m}" else "") for m in lk],
                 c("llamaspec/plain"), c(LS), "–" if r["ls_vs_best_lookup"] is None else f"×{r['ls_vs_best_lookup']:.2f}",
                 "–" if r["ls_vs_lcp_plain"] is None else f"×{r['ls_vs_lcp_plain']:.2f}",
                 f"{r['drafts'].get(LS, {}).get('drafted', '–')} / {r['drafts'].get(LS, {}).get('accepted', '–')}",
                 ", ".join(sorted({o for o in r["outputs"].values()}))]
        lines.append("| " + " | ".join(cells) + " |")
    eq = report["equality"]
    lines += ["", "`*`: the best prompt-lookup setting on that prompt (the anchor). outputs: every configuration's "
              f"greedy tokens against `{eq['reference']}` (first repeat): `equal`, `near-tie` (first difference where both "
              f"tokens are within {s['near_tie_tol']} of the top logit, teacher-forced), or `DIFFERS` (a real divergence). "
              f"{eq['n_compared']} outputs compared, {len(eq['divergences'])} differ "
              f"({sum(1 for d in eq['divergences'] if d.get('near_tie'))} near-ties).",
              "", "tok/s: decode tokens per second, (generated - 1) / decode time (the first token comes from the "
              "prompt), per prompt the median over repeats; llamaspec drafted / accepted: per run."]
    if cs["real_divergences"]:
        lines += ["", "**Real divergences**: " + ", ".join(cs["real_divergences"])]
    return "\n".join(lines) + "\n"


def fmt_duration(s: float) -> str:
    """
    >>> fmt_duration(42), fmt_duration(1500)
    ('42 s', '25 min')
    """
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def estimate_s(n_runs: int, n_predict: int, plain_tps: float) -> float:
    """Upper bound of the run's time: every run at plain speed, plus ~1 s each for its prompt and set-up."""
    return n_runs * ((n_predict / plain_tps if plain_tps > 0 else 0.0) + 1.0)


def _load(v) -> str:
    return "–" if not v else ", ".join(f"{x:.2f}" for x in v)
