"""``llamaspec serve``: an OpenAI-compatible speculative server (llama-server's routes, shapes and codes)."""
from __future__ import annotations

from pathlib import Path

import click

from ._common import err_console, handle_errors
from .device_options import device_options, pop_device_options
from .spec_options import resolve_spec_models, spec_options


def _read_api_keys(keys: tuple[str, ...], key_file: str | None) -> list[str]:
    """``--api-key`` (repeatable, comma lists) and ``--api-key-file`` (one key per line; ``#`` comments)."""
    from llamaspec.errors import UsageError

    out = [k.strip() for arg in keys for k in arg.split(",") if k.strip()]
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            raise UsageError(f"--api-key-file: file not found: {key_file}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--api-key-file: cannot read {key_file}: {e}") from None
        file_keys = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
        if not file_keys:
            raise UsageError(f"--api-key-file: {key_file} holds no key (one key per line)")
        out += file_keys
    return out


def _chat_template(name: str | None, file: str | None) -> str | None:
    from llamaspec.errors import UsageError

    if name is not None and file is not None:
        raise UsageError("give --chat-template or --chat-template-file, not both")
    if file is not None:
        try:
            return Path(file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"--chat-template-file: file not found: {file}") from None
    return name


@click.command()
@click.option("-m", "--model", help="Target model: a name from models.toml or a path to a GGUF file (default: models.toml's default).")
@click.option("--pair", default=None, help="A target+draft pair from models.toml (e.g. gemma3-270m) instead of -m and -md.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--api-key", "api_keys", multiple=True,
              help="API key(s) the clients must send (Authorization: Bearer KEY or X-Api-Key: KEY); repeatable or a comma list.")
@click.option("--api-key-file", type=str, default=None, help="File with API keys, one per line.")
@click.option("-a", "--alias", default=None, help="Model name reported by /v1/models and in responses (default: the -m value).")
@click.option("--metrics", "metrics", is_flag=True, help="Enable GET /metrics (Prometheus, llama-server's metric names).")
@click.option("--slots/--no-slots", "slots", default=True, show_default=True, help="Enable GET /slots.")
@click.option("--chat-template", default=None,
              help="Chat template: a llama.cpp built-in name (chatml, llama3, gemma, ...) or a Jinja template "
                   "(default: the model's own, else chatml).")
@click.option("--chat-template-file", default=None, help="Read the Jinja chat template from a file.")
@click.option("--sse-ping-interval", type=float, default=30.0, show_default=True,
              help="Seconds of silence before a keep-alive comment in a stream (0 = never).")
@click.option("--cache-prompt/--no-cache-prompt", "cache_prompt", default=True, show_default=True,
              help="Keep each slot's KV after a request and reuse the longest common prefix (llama-server's prompt cache).")
@click.option("-n", "--n-predict", type=click.IntRange(min=-1), default=-1, show_default=True,
              help="Default tokens to generate when a request gives no max_tokens (-1 = until end of generation or a full context).")
@click.option("-c", "--ctx-size", type=click.IntRange(min=16), default=4096, show_default=True,
              help="Context size (clamped to the model's).")
@click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Batch size (n_batch).")
@click.option("-np", "--n-parallel", "--parallel", "n_parallel", type=click.IntRange(min=1, max=256), default=1,
              show_default=True, help="Slots: requests decoded together (more requests wait in a queue).")
@device_options()
@click.option("--temp", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="Default temperature; 0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="Default top-k (0 = off).")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True, help="Default top-p (1.0 = off).")
@click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True, help="Default min-p (0.0 = off).")
@click.option("--repeat-penalty", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
              help="Default repetition penalty (1.0 = off).")
@click.option("--repeat-last-n", type=click.IntRange(min=-1), default=64, show_default=True,
              help="Default tokens the repetition penalty looks at.")
@click.option("-s", "--seed", type=click.IntRange(min=-1, max=0xFFFFFFFF), default=-1, show_default=True,
              help="Default sampling seed (-1 = random).")
@spec_options
@click.option("--cache-dir", default=None, help="Model cache directory (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec).")
@handle_errors
def serve(model, pair, host, port, api_keys, api_key_file, alias, metrics, slots, chat_template, chat_template_file,
          sse_ping_interval, cache_prompt, n_predict, ctx_size, batch_size, n_parallel, temp, top_k, top_p, min_p,
          repeat_penalty, repeat_last_n, seed, cache_dir, **spec_kw):
    """Serve MODEL over HTTP: OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/models) and
    llama-server's own routes (/completion, /tokenize, /detokenize, /slots, /props, /health, /metrics).

    Requests are batched over -np slots (more wait in a queue); with a draft model (-md) or an n-gram
    drafter (--spec-type) every slot speculates. A request may lower the speculative settings for itself:
    "speculative.n_max": 0 turns drafting off, "speculative.verify": "rejection" picks the rule. Every
    response carries llama-server's "timings" plus the acceptance report.

    \b
    llamaspec serve -m gemma3-270m-f32 -md gemma3-270m-q4km -np 4
    curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}'
    """
    from importlib.util import find_spec

    from llamaspec.errors import UsageError

    missing = [m for m in ("starlette", "uvicorn") if find_spec(m) is None]
    if missing:
        raise UsageError(f'llamaspec serve needs {" and ".join(missing)}: pip install "llamaspec[server]"')
    from llamaspec.engine import Engine
    from llamaspec.server.app import ServerConfig
    from llamaspec.server.parsing import Defaults
    from llamaspec.server.run import serve as run_server

    device = pop_device_options(spec_kw)
    keys = _read_api_keys(api_keys, api_key_file)
    template = _chat_template(chat_template, chat_template_file)
    if metrics and find_spec("prometheus_client") is None:
        raise UsageError('--metrics needs prometheus-client: pip install "llamaspec[server]"')
    if pair is None and not model and not spec_kw.get("draft_model") and not spec_kw.get("spec_type") \
            and not spec_kw.get("spec_default"):
        from llamaspec.models import load_registry

        pair = load_registry().default_pair or None
    spec, verify, path, dpath = resolve_spec_models(model, pair, cache_dir, spec_kw)
    model_id = alias or model or Path(path).stem
    config = ServerConfig(
        model_id=model_id, model_path=path, api_keys=keys, metrics=metrics, slots=slots, chat_template=template,
        sse_ping_interval=sse_ping_interval,
        defaults=Defaults(n_predict=n_predict, temp=temp, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed),
    )

    import inspect

    extra = {"cache_prompt": cache_prompt} if "cache_prompt" in inspect.signature(Engine).parameters else {}

    def load():
        return Engine(path, draft=dpath, spec=spec, verify=verify, n_ctx=ctx_size, n_batch=batch_size,
                      n_parallel=n_parallel, **extra, **device)

    def ready(state, url: str) -> None:
        eng = state.engine
        mode = (f"speculative: {', '.join(eng.chain.types)}, n_max {eng.chain.n_max}" if eng.chain is not None
                else "plain decoding (no draft model)")
        err_console.print(f"llamaspec serve: [bold]{url}[/] · model {model_id} · {eng.n_parallel} slot"
                          f"{'s' if eng.n_parallel != 1 else ''} of {eng.n_ctx_seq} tokens · {mode}"
                          f"{' · API key required' if keys else ''}", soft_wrap=True, highlight=False)

    from ._common import CliState

    err_console.print(f"llamaspec serve: loading {model_id} ...", highlight=False)
    run_server(config, load, host=host, port=port, on_ready=ready,
               log_level="info" if CliState.verbose else "warning", access_log=CliState.verbose > 0)
    err_console.print("llamaspec serve: stopped", highlight=False)
