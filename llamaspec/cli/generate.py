"""``llamaspec generate``: plain and speculative generation; text on stdout, everything else on stderr."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ._common import check_output_path, err_console, handle_errors
from .device_options import device_options, pop_device_options
from .sampler_options import sampler_extra, sampler_options
from .spec_options import resolve_spec_models, spec_options


def _read_prompt(prompt: str | None, file: str | None) -> str:
    from llamaspec.errors import UsageError

    if prompt is not None and file is not None:
        raise UsageError("give the prompt either as an argument or with --file, not both")
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8") if file != "-" else sys.stdin.read()
        except FileNotFoundError:
            raise UsageError(f"prompt file not found: {file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"prompt file {file} is not UTF-8 text") from None
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        return sys.stdin.read()
    if prompt is None:
        raise UsageError('no prompt: give one as an argument (llamaspec generate "def fibonacci(n):"), with --file, or on stdin')
    return prompt


def _parse_logit_bias(text: str) -> tuple[int, float]:
    """llama.cpp's ``--logit-bias TOKEN_ID(+/-)BIAS``.

    >>> _parse_logit_bias("15043+1"), _parse_logit_bias("15043-inf"), _parse_logit_bias(" 7+1e-3 ")
    ((15043, 1.0), (15043, -inf), (7, 0.001))
    """
    from llamaspec.errors import UsageError

    t = text.strip()
    signs = [i for i in (t.find("+", 1), t.find("-", 1)) if i > 0]
    try:
        if not signs:
            raise ValueError
        i = min(signs)
        tok, bias = int(t[:i]), float(t[i:])
        if tok < 0 or bias != bias or bias == float("inf"):
            raise ValueError
    except ValueError:
        raise UsageError(f"--logit-bias {text!r}: expected TOKEN_ID(+/-)BIAS, e.g. 15043+1, 15043-1 or 15043-inf "
                         "(never this token)") from None
    return tok, bias


@click.command()
@click.argument("prompt", required=False)
@click.option("-f", "--file", "prompt_file", type=str, help="Read the prompt from a file ('-' = stdin).")
@click.option("--prompts-file", type=str, help="Several prompts (one per line, or JSONL with \"prompt\"), run --n-parallel at a time.")
@click.option("-m", "--model", help="Target model: a name from models.toml or a path to a GGUF file (default: models.toml's default).")
@click.option("--pair", default=None, help="A target+draft pair from models.toml (e.g. gemma3-270m) instead of -m and -md.")
@click.option("-n", "--n-predict", type=click.IntRange(min=-1), default=256, show_default=True,
              help="Tokens to generate (-1 = until end of generation or a full context).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=4096, show_default=True, help="Context size (clamped to the model's).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Batch size (n_batch).")
@click.option("-np", "--n-parallel", type=click.IntRange(min=1, max=256), default=1, show_default=True, help="Slots decoded together.")
@device_options()
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="Top-k (0 = off).")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True, help="Top-p (1.0 = off).")
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True, help="Min-p (0.0 = off).")
@click.option("--repeat-penalty", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True, help="Repetition penalty (1.0 = off).")
@click.option("--repeat-last-n", type=click.IntRange(-1, (1 << 31) - 1), default=64, show_default=True, help="Tokens the repetition penalty looks at (0 = off, -1 = the context size).")
@click.option("-s", "--seed", type=click.IntRange(min=-1, max=0xFFFFFFFF), default=-1, show_default=True, help="Sampling seed (-1 = random).")
@click.option("--grammar-file", type=click.Path(dir_okay=False), help="GBNF grammar constraining the output.")
@click.option("--max-grammar-alternatives", type=click.IntRange(min=0), default=512, show_default=True,
              help="Refuse a grammar with more alternatives open at once, each a pass over the vocabulary per token (0 = no limit).")
@click.option("-l", "--logit-bias", "logit_bias", multiple=True, metavar="TOKEN_ID(+/-)BIAS",
              help="Add BIAS to a token's logit, as llama.cpp: 15043+1, 15043-1, 15043-inf (never) (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Never end on an end-of-generation token (generate -n tokens).")
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable); the text is cut before it.")
@sampler_options
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the model's chat template.")
@click.option("--system", "system_prompt", default=None, help="System message (with --chat).")
@spec_options
@click.option("--cache-dir", default=None, help="Model cache directory (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@click.option("--stats-json", type=click.Path(dir_okay=False, writable=True), help="Write generation statistics as JSON to this file.")
@click.option("--color/--no-color", "color", default=None, help="Colour drafted-and-accepted tokens (default: when stdout is a terminal).")
@click.option("-q", "--quiet", is_flag=True, help="Nothing on stderr after the text (no summary line).")
@click.option("-v", "--stats", "show_stats", is_flag=True,
              help="The full statistics: the speculative-decoding table and llama.cpp's per-drafter lines.")
@click.option("--baseline", is_flag=True,
              help="Also run plain decoding of the same prompt(s) and report the measured speedup (doubles the time).")
@handle_errors
def generate(prompt, prompt_file, prompts_file, model, pair, n_predict, ctx_size, batch_size, n_parallel, temp, top_k,
             top_p, min_p, repeat_penalty, repeat_last_n, seed, grammar_file, max_grammar_alternatives, logit_bias, ignore_eos, stop, chat, system_prompt, cache_dir,
             stats_json, color, quiet, show_stats, baseline, **spec_kw):
    """Generate text from PROMPT (argument, --file or stdin). Only the generated text goes to stdout.

    With no -m / -md / --pair / --spec-type, the default pair of models.toml is used (fetched on first
    use), so generation is speculative: the draft model proposes tokens and the target verifies them in one
    batch. -m alone drafts from n-grams of the prompt and output where that pays (--spec-type auto, the
    default; --spec-type none is plain). Greedy output is the same as without speculation.
    After the text, one summary line on stderr (tokens/s, acceptance, speedup over plain); -v/--stats for
    the full statistics, -q for none.
    """
    from llamaspec import DEFAULT_SEED, SamplingParams
    from llamaspec.chat import TOKENIZE, ChatTemplate
    from llamaspec.engine import Engine
    from llamaspec.errors import UsageError

    check_output_path(stats_json, "--stats-json")
    device = pop_device_options(spec_kw)  # -ngl -ngld -mg -sm -ts -t -tb -td, checked before any model loads
    if prompts_file is not None and (prompt is not None or prompt_file is not None):
        raise UsageError("give either a prompt (argument / --file) or --prompts-file, not both")
    if prompts_file:
        from llamaspec.bench.prompts import load_prompts

        prompts = [p.text for p in load_prompts(prompts_file)]
    else:
        prompts = [_read_prompt(prompt, prompt_file)]
    if system_prompt is not None and not chat:
        raise UsageError("--system needs --chat")
    grammar = None
    if grammar_file:
        try:
            grammar = Path(grammar_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"grammar file not found: {grammar_file}") from None
    sampling = SamplingParams(
        temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, seed=DEFAULT_SEED if seed == -1 else seed, grammar=grammar,
        logit_bias=tuple(_parse_logit_bias(x) for x in logit_bias), ignore_eos=ignore_eos,
        max_grammar_alternatives=max_grammar_alternatives, **sampler_extra(),
    )
    sampling.validate()
    if grammar:
        from llamaspec._llama.sampler import check_grammar

        check_grammar(sampling)  # before any model loads (too many alternatives: a UsageError naming the flag)
        sampling.max_grammar_alternatives = 0  # counted: the engine's sampler would count them again
    if pair is None and not model and not spec_kw.get("draft_model") and not spec_kw.get("spec_type") \
            and not spec_kw.get("spec_default"):
        from llamaspec.models import load_registry

        pair = load_registry().default_pair or None  # the first command speculates with the draft model
    spec, verify, path, dpath = resolve_spec_models(model, pair, cache_dir, spec_kw)
    out = sys.stdout
    use_color = out.isatty() if color is None else color
    with Engine(path, draft=dpath, spec=spec, verify=verify, n_ctx=ctx_size, n_batch=batch_size,
                n_parallel=n_parallel, **device) as eng:
        template = ChatTemplate.of_model(eng.model) if chat else None  # serve's rendering (llamaspec.chat)

        def encode(text: str) -> list[int]:
            if template is not None:
                msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
                return eng.tokenize(template.render(msgs), **TOKENIZE)
            return eng.tokenize(text)

        token_lists = [encode(p) for p in prompts]
        written = [""]  # the last text written to stdout (does it end the line?)

        def write(ch) -> None:
            if not ch.text:
                return
            written[0] = ch.text
            if use_color and ch.n_from_draft:
                # the text of the accepted drafted tokens, then the target's own token, uncoloured
                own = eng.vocab.token_to_piece(ch.tokens[-1]).decode("utf-8", "replace") if ch.tokens else ""
                cut = len(ch.text) - len(own) if own and ch.text.endswith(own) and len(ch.tokens) > ch.n_from_draft else len(ch.text)
                out.write("\x1b[32m" + ch.text[:cut] + "\x1b[0m" + ch.text[cut:])
            else:
                out.write(ch.text)
            out.flush()

        if len(token_lists) == 1:
            results = [eng.generate(token_lists[0], n_predict=n_predict, sampling=sampling, stop=stop, on_chunk=write)]
        else:
            results = eng.generate_many(token_lists, n_predict=n_predict, sampling=sampling, stop=stop)
            for i, r in enumerate(results):
                if i:
                    out.write("\n\n")
                out.write(r.text)
                written[0] = r.text or written[0]
            out.flush()
        open_line = bool(written[0]) and not written[0].endswith("\n")
        if open_line and out.isatty():
            out.write("\n")
        out.flush()
        if open_line and not out.isatty() and not quiet and _shares_a_screen_or_file(out, sys.stderr):
            sys.stderr.write("\n")  # `> run.log 2>&1`: the summary starts on its own line; stdout stays the text
            sys.stderr.flush()
        stats = _collect_stats(eng, path, dpath, results)
        if not quiet or stats_json:
            base = _plain_baseline(eng, results, token_lists, stats["decode_tokens_per_second"], measure=baseline,
                                   n_predict=n_predict, sampling=sampling, stop=stop, ctx_size=ctx_size,
                                   batch_size=batch_size)
            if base is not None:
                stats["baseline"] = base
        if stats_json:
            from llamaspec._io import write_atomic

            write_atomic(stats_json, json.dumps(stats, indent=2) + "\n")
        if not quiet:
            from ._common import CliState

            if n_predict == 0:
                err_console.print(f"[dim]-n 0: the prompt was processed ({stats['n_prompt']} tokens), nothing generated[/]")
            else:
                if show_stats or CliState.verbose > 0:  # the full statistics, then the summary line
                    _print_stats(eng, stats)
                    b = stats.get("baseline")
                    if b and b["kind"] == "estimated":
                        err_console.print(f"[dim]plain estimate: median of {b['n_steps']} plain steps of the target (decode + sample), "
                                          f"{b['ms_per_token']:.1f} ms each (measured in {b['wall_ms']:.0f} ms)[/]",
                                          soft_wrap=True)
                    elif b and b["kind"] == "measured in-run":
                        err_console.print(f"[dim]plain measured in-run: the last {b['n_plain_rounds']} plain rounds of this run "
                                          f"(the referee's, between the speculative ones), times ±{100 * b['spread']:.0f}%[/]",
                                          soft_wrap=True)
                err_console.print(_summary_line(eng, stats), soft_wrap=True)
        failed = [(i, r) for i, r in enumerate(results) if r.error]
        for i, r in failed:
            from rich.markup import escape

            err_console.print(f"[bold red]error:[/] prompt {i + 1} failed: {escape(r.error)}", soft_wrap=True)
        if failed:
            sys.exit(1)


def _shares_a_screen_or_file(out, err) -> bool:
    """Could the end of the text on ``out`` and what ``err`` prints next land on the same line? Yes when
    both go to one file or pipe (``> run.log 2>&1``), when stdout is a pipe and stderr a terminal
    (``| cat``), and when it cannot be told."""
    import os
    import stat

    try:
        so, se = os.fstat(out.fileno()), os.fstat(err.fileno())
    except (AttributeError, OSError, ValueError):
        return True
    if (so.st_dev, so.st_ino) == (se.st_dev, se.st_ino):
        return True
    return stat.S_ISFIFO(so.st_mode) and err.isatty()


def _plain_baseline(eng, results, token_lists, spec_tps, *, measure, n_predict, sampling, stop, ctx_size,
                    batch_size) -> dict | None:
    """Plain decoding speed to compare with: measured (--baseline: the same prompts again, without drafting)
    or estimated (a few plain decode + sample steps of the target, :mod:`llamaspec.estimate`). None when there
    is nothing to compare (plain run, nothing generated, several slots without --baseline)."""
    from llamaspec.estimate import measure_plain_step, speedup

    if not eng.chain or not any(r.stats.n_predicted > 1 for r in results):
        return None
    cp = eng.ctx.params
    if measure:
        from llamaspec.engine import Engine

        with Engine(eng.model, n_ctx=ctx_size, n_batch=batch_size, n_parallel=eng.n_parallel, n_threads=cp.n_threads,
                    n_threads_batch=cp.n_threads_batch, flash_attn=cp.flash_attn, kv_f32=cp.kv_f32) as plain:
            if len(token_lists) == 1:
                res = [plain.generate(token_lists[0], n_predict=n_predict, sampling=sampling, stop=stop)]
            else:
                res = plain.generate_many(token_lists, n_predict=n_predict, sampling=sampling, stop=stop)
            tps = _collect_stats(plain, None, None, res)["decode_tokens_per_second"]
        s = speedup(spec_tps, tps)
        return {"kind": "measured", "plain_tokens_per_second": round(tps, 3),
                "speedup": round(s, 4) if s is not None else None}
    if len(results) != 1 or eng.n_parallel != 1:
        return None  # slots decoded together: one plain step is no baseline for a batch
    inrun = _in_run_plain(eng)
    if inrun is not None:
        return {**inrun, "speedup": _rounded(speedup(spec_tps, inrun["plain_tokens_per_second"]))}
    r = results[0]
    cost = measure_plain_step(eng.model, r.prompt_tokens, r.tokens, sampling=sampling, n_threads=cp.n_threads,
                              n_threads_batch=cp.n_threads_batch, flash_attn=cp.flash_attn, kv_f32=cp.kv_f32)
    s = speedup(spec_tps, cost.tokens_per_second) if cost.spread <= NOISY_SPREAD else None
    return {"kind": "estimated", "plain_tokens_per_second": round(cost.tokens_per_second, 3),
            "speedup": _rounded(s), "ms_per_token": round(cost.ms_per_token, 3),
            "n_steps": cost.n_steps, "wall_ms": round(cost.wall_s * 1e3, 1), "spread": round(cost.spread, 3),
            "noisy": cost.spread > NOISY_SPREAD}


#: plain step or round times that vary more than this (median absolute deviation over the median) come from a
#: machine too busy for a one-line estimate: the summary says so instead of printing a speedup
NOISY_SPREAD = 0.25


def _rounded(x: float | None) -> float | None:
    return round(x, 4) if x is not None else None


def _in_run_plain(eng) -> dict | None:
    """Plain decoding's speed as the run itself measured it: the referee's plain rounds (llamaspec.referee),
    decoded between the speculative ones under the same load; None with fewer than 3 of them."""
    w = eng.referee.plain_window(1) if eng.referee is not None else None
    tps = w.rate() if w is not None and len(w) >= 3 else None
    if not tps:
        return None
    spread = w.spread() or 0.0
    return {"kind": "measured in-run", "plain_tokens_per_second": round(tps, 2), "n_plain_rounds": len(w),
            "spread": round(spread, 3), "noisy": spread > NOISY_SPREAD}


def _summary_line(eng, stats: dict) -> str:
    """The one line after the text: tokens/s, the speedup over plain (estimated or measured), acceptance,
    mean accepted length."""
    from llamaspec.auto import AutoChain

    n = stats["n_predicted"]
    head = f"generated {n} token{'s' if n != 1 else ''} at [bold]{stats['decode_tokens_per_second']:.1f} tok/s[/]"
    if not eng.chain:
        return head + " [dim]· plain decoding (no draft model: -md MODEL or --pair NAME to speculate)[/]"
    parts = [head]
    b = stats.get("baseline")
    if b and b.get("noisy"):  # the truth: the machine was too busy for a one-line figure
        parts.append(f"vs plain: not estimated, the machine was busy (plain steps varied ±{100 * b['spread']:.0f}%; "
                     "--baseline measures it)")
    elif b and b.get("speedup") is not None:
        parts.append(f"[bold]{b['speedup']:.2f}x[/] vs plain ({b['kind']}: {b['plain_tokens_per_second']:.1f} tok/s)")
    if stats["n_drafted"]:
        parts.append(f"acceptance {100 * stats['acceptance_rate']:.1f}%")
        parts.append(f"mean accepted length {stats['mean_accepted_length']:.2f}")
        by_type = stats.get("n_accepted_by_type") or {}
        if len(eng.chain.types) > 1 and by_type:  # --spec-type auto or a chain: who produced the accepted tokens
            parts.append("accepted from " + ", ".join(f"{k} {v}" for k, v in by_type.items()))
    else:
        auto = " (auto: no drafter was expected to pay off here)" if isinstance(eng.chain, AutoChain) else ""
        parts.append("nothing was drafted" + auto)
    return " · ".join(parts)


def _collect_stats(eng, path, dpath, results) -> dict:
    from llamaspec.engine import GenerationStats

    total = GenerationStats()
    for r in results:
        total.merge(r.stats)
    d = total.to_dict()
    # the slots ran concurrently: wall-clock decode time is the longest one, not the sum
    if len(results) > 1:
        t = max(r.stats.t_decode_s for r in results)
        d["t_decode_ms"] = round(t * 1e3, 3)
        d["decode_tokens_per_second"] = round(sum(max(0, r.stats.n_predicted - 1) for r in results) / t, 3) if t > 0 else 0.0
    return {
        "model": path,
        "draft_model": dpath,
        "spec_types": eng.chain.types if eng.chain else [],
        "verify": eng.verify,
        "target_level": eng.tgt_level.name,
        "draft_level": eng.dft_level.name if eng.ctx_dft is not None else None,
        "n_parallel": eng.n_parallel,
        "finish_reasons": [r.finish_reason.value for r in results],
        **d,
        "drafters": eng.drafter_stats(),
    }


def _print_stats(eng, stats: dict) -> None:
    from rich.table import Table

    err_console.print(
        f"[dim]{stats['n_prompt']} prompt tokens in {stats['t_prompt_ms']:.0f} ms "
        f"({stats['prompt_tokens_per_second']:.1f} t/s), {stats['n_predicted']} generated in "
        f"{stats['t_decode_ms']:.0f} ms ({stats['decode_tokens_per_second']:.1f} t/s), "
        f"finish: {', '.join(stats['finish_reasons'])}[/]"
    )
    if not eng.chain:
        return
    t = Table(title="speculative decoding", title_justify="left")
    for c in ("drafted", "accepted", "rate", "mean len", "steps", "target", "draft", "restores"):
        t.add_column(c, justify="right")
    t.add_row(str(stats["n_drafted"]), str(stats["n_accepted"]), f"{stats['acceptance_rate']:.3f}",
              f"{stats['mean_accepted_length']:.2f}", str(stats["n_verif_steps"]), stats["target_level"],
              stats["draft_level"] or "-", str(stats["n_restores"]))
    err_console.print(t)
    for line in eng.stats_lines():
        err_console.print(f"[dim]{line}[/]", soft_wrap=True)
