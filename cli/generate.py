"""``llamaspec generate``: plain (and later speculative) generation, text on stdout, the rest on stderr."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ._common import err_console, handle_errors, resolve_model_arg


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


@click.command()
@click.argument("prompt", required=False)
@click.option("-f", "--file", "prompt_file", type=str, help="Read the prompt from a file ('-' = stdin).")
@click.option("-m", "--model", help="Model name from models.toml or a path to a GGUF file (default: models.toml's default).")
@click.option("-n", "--n-predict", type=click.IntRange(min=-1), default=256, show_default=True,
              help="Tokens to generate (-1 = until end of generation or a full context).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=4096, show_default=True, help="Context size (clamped to the model's).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Prompt batch size (n_batch).")
@click.option("-t", "--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: all available cores).")
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="Top-k (0 = off).")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True, help="Top-p (1.0 = off).")
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True, help="Min-p (0.0 = off).")
@click.option("--repeat-penalty", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True, help="Repetition penalty (1.0 = off).")
@click.option("--repeat-last-n", type=click.IntRange(min=-1), default=64, show_default=True, help="Tokens the repetition penalty looks at.")
@click.option("-s", "--seed", type=click.IntRange(min=-1, max=0xFFFFFFFF), default=-1, show_default=True, help="Sampling seed (-1 = random).")
@click.option("--grammar-file", type=click.Path(dir_okay=False), help="GBNF grammar constraining the output.")
@click.option("--stop", "stop", multiple=True, help="Stop string (repeatable); the text is cut before it.")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message with the model's chat template.")
@click.option("--system", "system_prompt", default=None, help="System message (with --chat).")
@click.option("--cache-dir", default=None, help="Model cache directory (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@click.option("--stats-json", type=click.Path(dir_okay=False, writable=True), help="Write generation statistics as JSON to this file.")
@click.option("-q", "--quiet", is_flag=True, help="No statistics on stderr.")
@handle_errors
def generate(prompt, prompt_file, model, n_predict, ctx_size, batch_size, threads, temp, top_k, top_p, min_p,
             repeat_penalty, repeat_last_n, seed, grammar_file, stop, chat, system_prompt, cache_dir, stats_json, quiet):
    """Generate text from PROMPT (argument, --file or stdin). Only the generated text goes to stdout."""
    from llamaspec import _llama as L
    from llamaspec.engine import Engine
    from llamaspec.errors import UsageError

    text = _read_prompt(prompt, prompt_file)
    if system_prompt is not None and not chat:
        raise UsageError("--system needs --chat")
    grammar = None
    if grammar_file:
        try:
            grammar = Path(grammar_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"grammar file not found: {grammar_file}") from None
    sampling = L.SamplingParams(
        temp=temp, top_k=top_k, top_p=top_p, min_p=min_p, repeat_penalty=repeat_penalty,
        repeat_last_n=repeat_last_n, seed=L.DEFAULT_SEED if seed == -1 else seed, grammar=grammar,
    )
    sampling.validate()
    path = resolve_model_arg(model, cache_dir)
    with Engine(path, n_ctx=ctx_size, n_batch=batch_size, n_threads=threads) as eng:
        if chat:
            msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]
            text = eng.model.apply_chat_template(msgs)
            tokens = eng.tokenize(text, add_special=True, parse_special=True)
        else:
            tokens = eng.tokenize(text)
        out = sys.stdout
        result = eng.generate(tokens, n_predict=n_predict, sampling=sampling, stop=stop,
                              on_chunk=lambda ch: (out.write(ch.text), out.flush()) if ch.text else None)
        if result.text and not result.text.endswith("\n") and out.isatty():
            out.write("\n")
        out.flush()
        stats = {
            "model": path,
            "finish_reason": result.finish_reason.value,
            **result.stats.to_dict(),
        }
        if stats_json:
            Path(stats_json).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
        if not quiet:
            _print_stats(stats)


def _print_stats(stats: dict) -> None:
    err_console.print(
        f"[dim]{stats['n_prompt']} prompt tokens in {stats['t_prompt_ms']:.0f} ms "
        f"({stats['prompt_tokens_per_second']:.1f} t/s), {stats['n_predicted']} generated in "
        f"{stats['t_decode_ms']:.0f} ms ({stats['decode_tokens_per_second']:.1f} t/s), "
        f"finish: {stats['finish_reason']}[/]"
    )
