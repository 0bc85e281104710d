"""``llamaspec serve``'s bounds on the work one request, and the whole server, may ask for (docs/limits.md):
``--max-request-generations --max-queued-generations --max-prompt-chars --max-stop --max-stop-chars
--max-json-depth --max-body-size --max-grammar-alternatives --shutdown-timeout``, and the connection's:
``--max-url-bytes --max-header-bytes --max-headers --timeout --max-connections``. The defaults are :class:`llamaspec.server.limits.Limits`'s.
"""
from __future__ import annotations

import click

from ._common import option_group

# the defaults of llamaspec.server.limits.Limits (that module needs starlette, which the CLI must not import
# before `serve` checks that it is installed); tests/test_server_limits.py checks that they agree
DEFAULTS = {"max_request_generations": 64, "max_queued_generations": 1024, "max_prompt_chars": 1 << 20,
            "max_stop": 16, "max_stop_chars": 1024, "max_json_depth": 64, "max_body_size": 8 << 20,
            "max_grammar_alternatives": 512, "shutdown_timeout": 10.0, "max_url_bytes": 8192,
            "max_header_bytes": 16384, "max_headers": 100, "timeout": 600.0, "max_connections": 1024}
#: the keyword names the options fill in (the fields of ``Limits``)
KEYS = tuple(DEFAULTS)


def limit_options():
    """Decorator adding the limit flags (each over its limit: a 400 naming the flag; a full queue: 503 with
    Retry-After; a body over --max-body-size: 413)."""
    d = DEFAULTS
    opts = [
        click.option("--max-request-generations", type=click.IntRange(1, 1 << 20), default=d["max_request_generations"],
                     show_default=True, help="Generations one request may ask for: its prompts times n (more: 400)."),
        click.option("--max-queued-generations", type=click.IntRange(1, 1 << 24), default=d["max_queued_generations"],
                     show_default=True,
                     help="Generations queued or running in the whole server (a request past it: 503 with Retry-After)."),
        click.option("--max-prompt-chars", type=click.IntRange(1), default=d["max_prompt_chars"], show_default=True,
                     help="Characters of prompt text in one request: every prompt, or every chat message (more: 400)."),
        click.option("--max-stop", type=click.IntRange(0, 1 << 16), default=d["max_stop"], show_default=True,
                     help="Stop strings in one request (more: 400)."),
        click.option("--max-stop-chars", type=click.IntRange(1, 1 << 20), default=d["max_stop_chars"], show_default=True,
                     help="Characters in one stop string (more: 400)."),
        click.option("--max-json-depth", type=click.IntRange(2, 512), default=d["max_json_depth"], show_default=True,
                     help="Nesting levels of a request body's JSON (deeper: 400)."),
        click.option("--max-body-size", type=click.IntRange(1024), default=d["max_body_size"], show_default=True,
                     metavar="BYTES", help="Bytes in a request body (more: 413)."),
        click.option("--max-grammar-alternatives", type=click.IntRange(0), default=d["max_grammar_alternatives"],
                     show_default=True,
                     help="Alternatives a request's grammar or JSON schema may have open at once, e.g. the values of "
                          "an enum: each costs a pass over the vocabulary on every token (more: 400; 0 = no limit)."),
        click.option("--shutdown-timeout", type=click.FloatRange(0.0), default=d["shutdown_timeout"], show_default=True,
                     metavar="SECONDS",
                     help="On SIGTERM, seconds the running requests have to finish (new ones get 503) before they "
                          "end with an error event; a second SIGTERM stops at once."),
        click.option("--max-url-bytes", type=click.IntRange(256, 1 << 20), default=d["max_url_bytes"],
                     show_default=True, metavar="BYTES", help="Bytes in a request's URL (more: 414)."),
        click.option("--max-header-bytes", type=click.IntRange(1024, 1 << 24), default=d["max_header_bytes"],
                     show_default=True, metavar="BYTES",
                     help="Bytes in a request's header lines together (more: 431)."),
        click.option("--max-headers", type=click.IntRange(8, 1 << 16), default=d["max_headers"], show_default=True,
                     help="Header lines in one request (more: 431)."),
        click.option("-to", "--timeout", type=click.FloatRange(0.0), default=d["timeout"], show_default=True,
                     metavar="SECONDS",
                     help="Seconds a request's head, and then its body, may take to arrive (later: 408 and the "
                          "connection is closed; 0 = no limit)."),
        click.option("--max-connections", type=click.IntRange(1), default=d["max_connections"], show_default=True,
                     help="Connections open at once (a request on one more: 503)."),
    ]
    return option_group(opts)


def pop_limit_options(kw: dict):
    """Take the limit flags out of ``kw`` (the command's keyword arguments): a
    :class:`~llamaspec.server.limits.Limits` (call it once ``serve`` knows that the server extra is there)."""
    from llamaspec.server.limits import Limits

    return Limits(**{k: kw.pop(k) for k in KEYS if k in kw})
