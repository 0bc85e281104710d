"""Load & fault run against a real ``llamaspec serve`` process (127.0.0.1 only).

    python scripts/load_faults.py                          # 64 clients, 10 minutes, tiny models, draft-simple
    python scripts/load_faults.py -c 16 -t 60              # short
    python scripts/load_faults.py --model smollm2-135m-f32 --draft smollm2-135m-q4_1 -np 4
    python scripts/load_faults.py --spec ngram -c 16 -t 60 --seed 3 --json out.json

The server runs with -np N slots and speculation on (a draft model, or an n-gram drafter with --spec ngram).
``-c`` clients each send, until ``-t`` seconds have passed, a mix drawn from ``--seed``
(tests/support/load_mix.py): completions and chats, stream and not, greedy and sampled, of varied
lengths, some pinned to slot 0; and hostile requests: disconnects mid-stream and while the prompt waits or
is processed, bodies cut half-way, prompts over the context / --max-prompt-chars / --max-body-size, invalid
JSON, wrong types, huge numbers, huge n_probs / n / stop lists, pathological grammars and JSON schemas,
huge max_tokens with tiny client timeouts, slow stream readers, speculative.n_max abuse, unknown routes;
/health, /slots and /metrics are polled throughout.

A failure is a 5xx, a stream error event, a hang (no answer within --request-timeout), a connection reset by
the server, a malformed 200, any outcome the request's kind does not allow, or a greedy answer that differs
from the same request sent alone before the load (a divergence where the two best tokens are within
--near-tie log-prob is reported, not failed). With --inject, decodes, drafters, state loads and admissions
fail at random in the server during the load: a request that ends with that injected error is counted, not
failed, and everything else must hold as without it. The run also fails when /health stopped answering or
got slow (--health-limit), slots are still busy after the run, the greedy answers differ afterwards, the
server's RSS grew more than --rss-limit MB (the median of the run's last quarter against that of the quarter
after the warm-up), or SIGTERM did not end it with exit code 0.
Prints a summary, writes the whole report as JSON, exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support: the load runner (not shipped)

from support.load_run import RunConfig, run, summary  # noqa: E402

#: as the tests: batched and single-row decoding agree closely (flash attention off, F32 KV cache)
EXACT = ["-fa", "off", "-ctk", "f32", "-ctv", "f32"]


def server_args(args: argparse.Namespace, d: Path) -> list[str]:
    """The `llamaspec serve` arguments (the tiny models are written to ``d``)."""
    if args.model == "tiny":
        from llamaspec.testing.tiny_models import write_model

        target = str(write_model("llama", d / "llama.gguf", n_ctx=8192))
        draft = str(write_model("llama-draft", d / "llama-draft.gguf", n_ctx=8192))
        # one thread: a tiny model gains nothing from more, and a busy machine's cores make threads wait on each other
        base = ["-m", target, "--chat-template", "chatml", "-c", str(args.ctx or 8192), "-b", "64", "-t", "1"]
    else:
        from llamaspec.models import resolve_model

        target = str(resolve_model(args.model))
        draft = str(resolve_model(args.draft)) if args.draft else None
        base = ["-m", target, "-c", str(args.ctx or 8192)]
    spec = args.spec or ("draft" if draft else "ngram")
    if spec == "draft":
        if not draft:
            raise SystemExit("--spec draft needs --draft")
        # a fixed draft length: on the tiny models the adaptive one would stop drafting (a draft costs what its
        # target does)
        base += ["-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", "4",
                 *(["--no-spec-draft-adaptive"] if args.model == "tiny" else [])]
    elif spec == "ngram":
        base += ["--spec-type", "ngram-simple"]
    return [*base, "-np", str(args.n_parallel), *EXACT, *shlex.split(args.server_args)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--clients", type=int, default=64, help="concurrent clients (default 64)")
    ap.add_argument("-t", "--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--seed", type=int, default=0, help="the request mix's seed (default 0)")
    ap.add_argument("--model", default="tiny", help="'tiny' (random-weight llama, default), a models.toml name or a GGUF")
    ap.add_argument("--draft", default=None, help="draft model (models.toml name or GGUF; tiny: its own draft)")
    ap.add_argument("--spec", choices=["draft", "ngram", "none"], default=None,
                    help="speculation: a draft model (default when there is one), ngram-simple, or none")
    ap.add_argument("-np", "--n-parallel", type=int, default=4, help="server slots (default 4)")
    ap.add_argument("--ctx", type=int, default=None, help="server context, all slots together (default 8192)")
    ap.add_argument("--server-args", default="",
                    help="more `llamaspec serve` arguments, one string: --server-args=\"-t 2 --offline\"")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request is a hang")
    ap.add_argument("--pool", type=int, default=12, help="greedy requests with a reference answer (default 12)")
    ap.add_argument("--near-tie", type=float, default=0.01, help="log-prob gap of a tolerated greedy divergence")
    ap.add_argument("--health-limit", type=float, default=5.0, help="slowest /health answer allowed, s (default 5)")
    ap.add_argument("--rss-limit", type=float, default=20.0,
                    help="RSS growth allowed, MB: the median of the run's last quarter minus that of its second (20)")
    ap.add_argument("--memory-limit", type=float, default=16.0,
                    help="the server's address-space limit, GB (a blow-up kills it, not the machine; 0: none)")
    ap.add_argument("--inject", default="", metavar="POINT=P,...",
                    help="inject native failures during the load: decode, mirror, drafter, state, admit with their "
                         "probabilities, e.g. decode=0.002,drafter=0.005,admit=0.01 (tests/support/faults.py)")
    ap.add_argument("--json", default="load-faults.json", help="where the report goes (default load-faults.json)")
    ap.add_argument("--log", default="load-faults-server.log", help="the server's log (default load-faults-server.log)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        ap.error("--clients must be >= 1 and --duration > 0")
    if args.model == "tiny":
        args.draft = "tiny"
    with tempfile.TemporaryDirectory(prefix="load-faults-") as d:
        cfg = RunConfig(server_args(args, Path(d)), clients=args.clients, duration=args.duration, seed=args.seed,
                        request_timeout=args.request_timeout, pool=args.pool, near_tie=args.near_tie,
                        health_limit=args.health_limit, rss_limit_mb=args.rss_limit, log=args.log,
                        memory_limit_gb=args.memory_limit, inject=args.inject)
        print(f"llamaspec serve {' '.join(cfg.server_args)}\n{cfg.clients} clients for {cfg.duration:.0f} s, "
              f"seed {cfg.seed}", flush=True)
        rep = run(cfg)
    Path(args.json).write_text(json.dumps(rep, indent=1, default=str))
    print(summary(rep))
    print(f"report: {args.json}; server log: {args.log}")
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
