"""``llamaspec serve``: an OpenAI-compatible speculative server (llama-server's routes, shapes, codes and flags).

Every flag of the pinned llama-server is accepted with its spellings and ``LLAMA_ARG_*`` variables
(:mod:`llamaspec.cli.server_compat`, :mod:`llamaspec.cli.server_flags`): those below are honoured; the
others print one line saying why they are ignored.
"""
from __future__ import annotations

import click

from ._common import err_console, handle_errors, option_group
from .device_options import device_options, pop_device_options
from .limit_options import limit_options, pop_limit_options
from .sampler_options import sampler_extra, sampler_options
from .serve_setup import (apply_logging, chat_template_arg, ctx_size_arg, flash_attn_arg, kv_f32_arg, model_sources,
                          n_parallel_arg, pop_slot_options, read_api_keys, server_config, slot_options)
from .server_compat import ServeCommand
from .spec_options import resolve_spec_models, spec_options

_SERVER_OPTIONS = [
    click.option("--host", default="127.0.0.1", show_default=True,
                 help="Address(es) to listen on: a comma list of IP addresses or UNIX socket paths ending in .sock."),
    click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on."),
    click.option("--reuse-port", is_flag=True, help="Let several processes listen on the same port (SO_REUSEPORT)."),
    click.option("--api-key", "api_keys", multiple=True,
                 help="API key(s) the clients must send (Authorization: Bearer KEY or X-Api-Key: KEY); repeatable or a "
                      "comma list."),
    click.option("--api-key-file", type=str, default=None, help="File with API keys, one per line."),
    click.option("--api-prefix", default="", help="Prefix of every route, e.g. /llama (default: none)."),
    click.option("--ssl-key-file", default=None, help="PEM private key: serve HTTPS (with --ssl-cert-file)."),
    click.option("--ssl-cert-file", default=None, help="PEM certificate: serve HTTPS (with --ssl-key-file)."),
    click.option("--cors-origins", default=None,
                 help="Allowed CORS origins: * (default), localhost (only local origins), or a list sent as it is."),
    click.option("--cors-methods", default="GET, POST, DELETE, OPTIONS", show_default=True,
                 help="Access-Control-Allow-Methods of a preflight."),
    click.option("--cors-headers", default="*", show_default=True, help="Access-Control-Allow-Headers of a preflight."),
    click.option("--cors-credentials/--no-cors-credentials", default=True, show_default=True,
                 help="Allow credentials (with --cors-origins *, the request's Origin is echoed)."),
    click.option("-a", "--alias", default=None,
                 help="Model name(s), a comma list, reported by /v1/models and in responses (default: the -m value)."),
    click.option("--tags", default=None, help="Comma list of tags reported by /v1/models."),
    click.option("--metrics", "metrics", is_flag=True, help="Enable GET /metrics (Prometheus, llama-server's metric names)."),
    click.option("--props", "props", is_flag=True, help="Allow POST /props (the server's default generation settings)."),
    click.option("--slots/--no-slots", "slots", default=True, show_default=True, help="Enable GET /slots."),
    click.option("--jinja/--no-jinja", "jinja", default=True, show_default=True,
                 help="Render the chat template with Jinja (--no-jinja: llama.cpp's built-in templates only)."),
    click.option("--chat-template", default=None,
                 help="Chat template: a llama.cpp built-in name (chatml, llama3, gemma, ...) or a Jinja template "
                      "(default: the model's own, else chatml)."),
    click.option("--chat-template-file", default=None, help="Read the Jinja chat template from a file."),
    click.option("--sse-ping-interval", type=float, default=30.0, show_default=True,
                 help="Seconds of silence before a keep-alive comment in a stream (0 = never)."),
    click.option("--cache-prompt/--no-cache-prompt", "cache_prompt", default=True, show_default=True,
                 help="Keep each slot's KV after a request and reuse the longest common prefix (llama-server's prompt cache)."),
    click.option("-sps", "--slot-prompt-similarity", "slot_prompt_similarity", type=click.FloatRange(0.0, 1.0),
                 default=0.1, show_default=True,
                 help="A request takes the free slot whose cached prompt covers more than this share of its prompt, "
                      "else the least recently used slot (0 = least recently used only)."),
    click.option("--ui-mcp-proxy/--no-ui-mcp-proxy", "mcp_proxy", default=False, show_default=True,
                 help="Enable /cors-proxy?url=..., llama-server's proxy for its web UI's MCP clients: it forwards "
                      "only the X-Llama-Server-Proxy-Header-* headers. Do not enable it in untrusted environments."),
    click.option("--tools", default=None, hidden=True),
    click.option("--mcp-servers-config", default=None, hidden=True),
    click.option("--mcp-servers-json", default=None, hidden=True),
]

_MODEL_OPTIONS = [
    click.option("-m", "--model", help="Target model: a name from models.toml or a path to a GGUF file (default: "
                                       "models.toml's default)."),
    click.option("--pair", default=None, help="A target+draft pair from models.toml (e.g. gemma3-270m) instead of -m and -md."),
    click.option("-mu", "--model-url", default=None, help="Download the target GGUF from this URL (into the model cache)."),
    click.option("-hf", "--hf-repo", default=None, help="Target from Hugging Face: USER/MODEL[:QUANT] (default quant Q4_K_M)."),
    click.option("-hff", "--hf-file", default=None, help="The GGUF file of -hf (instead of choosing by QUANT)."),
    click.option("-hft", "--hf-token", default=None, help="Hugging Face token for -hf (default: $HF_TOKEN)."),
    click.option("-hfd", "--hf-repo-draft", default=None, help="Draft model from Hugging Face: USER/MODEL[:QUANT]."),
    click.option("--offline", is_flag=True, help="Never download: use only models already in the cache."),
    click.option("--cache-dir", default=None, help="Model cache directory (default: $LLAMASPEC_CACHE or ~/.cache/llamaspec)."),
]

_ENGINE_OPTIONS = [
    click.option("-n", "--n-predict", type=click.IntRange(min=-2), default=-1, show_default=True,
                 help="Default tokens to generate when a request gives no max_tokens (-1 = until end of generation or a "
                      "full context; -2 = the same)."),
    click.option("-c", "--ctx-size", type=click.IntRange(min=0), default=4096, show_default=True,
                 help="Context size (0 = the model's training context; clamped to it)."),
    click.option("-b", "--batch-size", type=click.IntRange(min=1), default=512, show_default=True, help="Batch size (n_batch)."),
    click.option("-ub", "--ubatch-size", type=click.IntRange(min=1), default=None, help="Physical batch size (default: -b)."),
    click.option("-np", "--n-parallel", "--parallel", "n_parallel", type=click.IntRange(min=-1, max=256), default=1,
                 show_default=True, help="Slots: requests decoded together (more wait in a queue; -1 = auto, 4)."),
    click.option("-fa", "--flash-attn", default="auto", show_default=True, help="Flash attention: on, off or auto."),
    click.option("-ctk", "--cache-type-k", default="f16", show_default=True, help="KV cache type of K: f16 or f32."),
    click.option("-ctv", "--cache-type-v", default="f16", show_default=True, help="KV cache type of V: f16 or f32."),
    click.option("-kvu", "--kv-unified/--no-kv-unified", "kv_unified", default=None,
                 help="One KV buffer shared by all slots (not available yet: each slot gets -c / -np tokens)."),
    click.option("--context-shift/--no-context-shift", "context_shift", default=False,
                 help="When a slot's context is full, drop the older half of its tokens (after the BOS) and go on, "
                      "as llama-server (default: the request ends with finish_reason length)."),
]

_SAMPLING_OPTIONS = [
    click.option("--temp", type=click.FloatRange(min=0.0), default=0.8, show_default=True, help="Default temperature; 0 = greedy."),
    click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True, help="Default top-k (0 = off)."),
    click.option("--top-p", type=click.FloatRange(0.0, 1.0), default=0.95, show_default=True, help="Default top-p (1.0 = off)."),
    click.option("--min-p", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True, help="Default min-p (0.0 = off)."),
    click.option("--repeat-penalty", type=click.FloatRange(min=0.0, min_open=True), default=1.0, show_default=True,
                 help="Default repetition penalty (1.0 = off)."),
    click.option("--repeat-last-n", type=click.IntRange(-1, (1 << 31) - 1), default=64, show_default=True,
                 help="Default tokens the repetition penalty looks at (0 = off, -1 = the context size; clamped to it)."),
    click.option("--presence-penalty", type=float, default=0.0, show_default=True, help="Default presence penalty (0 = off)."),
    click.option("--frequency-penalty", type=float, default=0.0, show_default=True, help="Default frequency penalty (0 = off)."),
    click.option("-s", "--seed", type=click.IntRange(min=-1, max=0xFFFFFFFF), default=-1, show_default=True,
                 help="Default sampling seed (-1 = random)."),
]

_LOG_OPTIONS = [
    click.option("-v", "--verbose", "log_verbose", count=True, help="Log every request (also: `llamaspec -v serve`)."),
    click.option("-lv", "--verbosity", "verbosity", type=int, default=None, help="Log verbosity: 0..4 (llama.cpp's levels)."),
    click.option("--log-file", default=None, help="Also write the log to this file."),
    click.option("--log-disable", is_flag=True, help="No log output."),
]


@click.command(cls=ServeCommand)
@option_group(_MODEL_OPTIONS + _SERVER_OPTIONS + _ENGINE_OPTIONS + _SAMPLING_OPTIONS + _LOG_OPTIONS)
@device_options()
@limit_options()
@slot_options
@spec_options
@sampler_options
@click.pass_context
@handle_errors
def serve(ctx, model, pair, model_url, hf_repo, hf_file, hf_token, hf_repo_draft, offline, cache_dir, host, port,
          reuse_port, api_keys, api_key_file, api_prefix, ssl_key_file, ssl_cert_file, cors_origins, cors_methods,
          cors_headers, cors_credentials, alias, tags, metrics, props, slots, jinja, chat_template, chat_template_file,
          sse_ping_interval, cache_prompt, slot_prompt_similarity, mcp_proxy, tools, mcp_servers_config, mcp_servers_json, n_predict, ctx_size, batch_size,
          ubatch_size, n_parallel, flash_attn, cache_type_k, cache_type_v, kv_unified, context_shift, temp, top_k, top_p,
          min_p, repeat_penalty, repeat_last_n, presence_penalty, frequency_penalty, seed, log_verbose, verbosity,
          log_file, log_disable, **spec_kw):
    """Serve MODEL over HTTP: OpenAI-compatible (/v1/completions, /v1/chat/completions, /v1/models) and
    llama-server's own routes (/completion, /tokenize, /detokenize, /slots, /props, /health, /metrics).

    A drop-in for llama-server: its command line and LLAMA_ARG_* variables are accepted as they are (a flag
    llamaspec cannot apply prints one line saying so). Requests are batched over -np slots (more wait in a
    queue); with a draft model (-md) or an n-gram drafter (--spec-type) every slot speculates. A request may
    lower the speculative settings for itself: "speculative.n_max": 0 turns drafting off,
    "speculative.verify": "rejection" picks the rule. Every response carries llama-server's "timings" plus the
    acceptance report.

    \b
    llamaspec serve -m gemma3-270m-f32 -md gemma3-270m-q4km -np 4
    curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}'
    """
    from importlib.util import find_spec

    from llamaspec.errors import UsageError

    notes = list(ctx.meta.get("llama_server_notes", []))
    missing = [m for m in ("starlette", "uvicorn") if find_spec(m) is None]
    if missing:
        raise UsageError(f'llamaspec serve needs {" and ".join(missing)}: pip install "llamaspec[server]"')
    from llamaspec.engine import Engine
    from llamaspec.server.run import serve as run_server

    verbose = apply_logging(log_verbose, verbosity, log_file, log_disable)
    device = pop_device_options(spec_kw)
    limits = pop_limit_options(spec_kw)
    slot_kw = pop_slot_options(spec_kw)  # --slot-save-path, --spm-infill
    keys = read_api_keys(api_keys, api_key_file)
    template = chat_template_arg(chat_template, chat_template_file)
    if metrics and find_spec("prometheus_client") is None:
        raise UsageError('--metrics needs prometheus-client: pip install "llamaspec[server]"')
    fa = flash_attn_arg(flash_attn)
    kv_f32 = kv_f32_arg(cache_type_k, cache_type_v, notes)
    n_parallel = n_parallel_arg(n_parallel)
    n_ctx = ctx_size_arg(ctx_size)
    if kv_unified:
        notes.append(f"--kv-unified is not available yet: the context (-c) is split evenly between the {n_parallel} "
                     "slots")
    for flag, v in (("--tools", tools), ("--mcp-servers-config", mcp_servers_config),
                    ("--mcp-servers-json", mcp_servers_json)):
        if v is not None:
            notes.append(f"ignoring {flag}: llamaspec serve runs no server-side tools or MCP servers")
    if cors_origins is None:  # llama-server: local origins only once tools or MCP servers are on
        cors_origins = "localhost" if (tools or mcp_servers_config or mcp_servers_json) else "*"
    model_name = hf_repo or model_url or model
    model, spec_kw["draft_model"] = model_sources(model, spec_kw.get("draft_model"), model_url=model_url,
                                                  hf_repo=hf_repo, hf_file=hf_file, hf_token=hf_token,
                                                  hf_repo_draft=hf_repo_draft, cache_dir=cache_dir, offline=offline)
    for line in dict.fromkeys(notes):
        err_console.print(f"[yellow]llamaspec serve:[/] {line}", soft_wrap=True, highlight=False)
    if pair is None and not model and not spec_kw.get("draft_model") and not spec_kw.get("spec_type") \
            and not spec_kw.get("spec_default"):
        from llamaspec.models import load_registry

        pair = load_registry().default_pair or None
        if offline and pair:
            p = load_registry().pair(pair)
            model, spec_kw["draft_model"], pair = model_sources(p.target, p.draft, cache_dir=cache_dir,
                                                                offline=True) + (None,)
    spec, verify, path, dpath = resolve_spec_models(model, pair, cache_dir, spec_kw)
    config = server_config(
        model=model_name, path=path, alias=alias, tags=tags, keys=keys, metrics=metrics, props=props, slots=slots,
        template=template, jinja=jinja, sse_ping_interval=sse_ping_interval, verbose=verbose, api_prefix=api_prefix,
        limits=limits, mcp_proxy=mcp_proxy, **slot_kw,
        cors=(cors_origins, cors_methods, cors_headers, cors_credentials),
        defaults=dict(n_predict=-1 if n_predict == -2 else n_predict, temp=temp, top_k=top_k, top_p=top_p,
                      min_p=min_p, repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, seed=seed,
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                      sampling_extra=sampler_extra(ctx)))

    def load():
        return Engine(path, draft=dpath, spec=spec, verify=verify, n_ctx=n_ctx, n_batch=batch_size,
                      n_ubatch=ubatch_size, n_parallel=n_parallel, flash_attn=fa, kv_f32=kv_f32,
                      context_shift=context_shift, cache_prompt=cache_prompt,
                      slot_prompt_similarity=slot_prompt_similarity, **device)

    def ready(state, url: str) -> None:
        eng = state.engine
        mode = (f"speculative: {', '.join(eng.chain.types)}, n_max {eng.chain.n_max}" if eng.chain is not None
                else "plain decoding (no draft model)")
        err_console.print(f"llamaspec serve: [bold]{url}[/] · model {config.model_id} · {eng.n_parallel} slot"
                          f"{'s' if eng.n_parallel != 1 else ''} of {eng.n_ctx_seq} tokens · {mode}"
                          f"{' · API key required' if keys else ''}", soft_wrap=True, highlight=False)

    err_console.print(f"llamaspec serve: loading {config.model_id} ...", highlight=False)
    run_server(config, load, host=host, port=port, on_ready=ready, log_level="info" if verbose else "warning",
               access_log=verbose > 0, reuse_port=reuse_port, ssl_keyfile=ssl_key_file, ssl_certfile=ssl_cert_file)
    err_console.print("llamaspec serve: stopped", highlight=False)

