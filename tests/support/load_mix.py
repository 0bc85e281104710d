"""The request mix of ``scripts/load_faults.py``: what each client sends, drawn from a seeded RNG.

A :class:`Call` is one HTTP request (method, path, raw body), how the client treats it (read it all, read it
slowly, disconnect after some events, or close the socket while the server is still reading or processing
the prompt) and the outcomes it may end with (:data:`OK` ...). :func:`draw_call` picks a kind by weight
(:data:`KINDS`) and builds it; the same seed, client and call number give the same call.

Normal kinds (their latencies are reported) are completions and chats, stream and not, greedy or sampled,
of varied lengths; a greedy one is a :class:`GreedyCase` of a fixed pool whose answer alone is known
(``load_run`` checks the text under load equals it), sent with a variant that must not change a greedy
answer (``speculative.n_max`` 0 or 1, the rejection rule, no prompt cache, a pinned slot). Hostile kinds
are the rest: clients that go away, oversized and malformed bodies, wrong types and huge numbers,
pathological grammars and JSON schemas, huge ``n_probs`` / ``n`` / stop lists, huge ``max_tokens`` with a
tiny client timeout, slow readers, unknown routes, and the monitoring routes.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

__all__ = ["Call", "GreedyCase", "MixContext", "KINDS", "NORMAL", "draw_call", "greedy_pool", "completion_body"]

#: outcomes: an HTTP status as text ("200", "400"...), or one of these
TIMEOUT, DISCONNECTED, RESET, BAD_BODY, MISMATCH, NEAR_TIE = ("timeout", "disconnected", "reset", "bad-body",
                                                              "mismatch", "near-tie")
OK = frozenset({"200"})
BAD_REQUEST = frozenset({"400"})

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex the jovial box of "
         "numbers 12 37 ab cd ef and river delta heat pump compiler database index step by step why how "
         "because therefore").split()


@dataclass
class MixContext:
    """What the mix needs to know about the server."""

    n_ctx: int  # tokens per slot
    n_vocab: int
    n_parallel: int
    ids: list[int]  # token ids that make ordinary text (from tokenising WORDS)
    max_body: int  # --max-body-size
    max_prompt_chars: int
    pool: list["GreedyCase"] = field(default_factory=list)


@dataclass
class GreedyCase:
    """A greedy request whose answer alone is known (``ref``, with its tokens' bytes and top-2 log-probs)."""

    path: str
    body: dict
    stream: bool
    prompt_tokens: list[int] = field(default_factory=list)
    ref: str | None = None
    ref_pieces: list[bytes] = field(default_factory=list)
    ref_gaps: list[float] = field(default_factory=list)  # top-1 minus top-2 log-prob at each output token


@dataclass
class Call:
    kind: str
    method: str
    path: str
    body: bytes | None = None
    stream: bool = False
    expect: frozenset = OK
    #: "read" (all), "slow" (``arg`` s between stream lines), "events" (disconnect after ``arg`` events),
    #: "early" (raw socket: close ``arg`` s after sending), "partial" (raw socket: close half-way through the body)
    action: str = "read"
    arg: float = 0.0
    timeout: float | None = None  # the client's own timeout (None: the run's per-request limit)
    case: int | None = None  # the GreedyCase (index in the pool) whose answer this must equal
    normal: bool = False
    note: str = ""


def _dump(obj) -> bytes:
    return json.dumps(obj).encode()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _ids(rng: random.Random, ctx: MixContext, n: int) -> list[int]:
    return [rng.choice(ctx.ids) for _ in range(n)]


def _messages(rng: random.Random, n_words: int) -> list[dict]:
    msgs = [{"role": "user", "content": _text(rng, n_words)}]
    if rng.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": _text(rng, 6)})
    return msgs


def completion_body(route: str, prompt, n_out: int, stream: bool, **kw) -> dict:
    key = "n_predict" if route == "/completion" else "max_tokens"
    if route == "/v1/chat/completions":
        return {"messages": prompt, key: n_out, "stream": stream, **kw}
    return {"prompt": prompt, key: n_out, "stream": stream, **kw}


ROUTES = ("/completion", "/v1/completions", "/v1/chat/completions")


def greedy_pool(seed: int, ctx: MixContext, size: int) -> list[GreedyCase]:
    """``size`` greedy requests over the three routes, stream and not, of 4..96 tokens (no answers yet)."""
    rng = random.Random(f"{seed}:pool")
    out = []
    for i in range(size):
        route, stream = ROUTES[i % 3], bool((i // 3) % 2)
        n = rng.choice([4, 16, 32, 64, 96])
        if route == "/v1/chat/completions":
            prompt = _messages(rng, rng.randint(3, 40))
        elif route == "/completion" and rng.random() < 0.5:
            prompt = _ids(rng, ctx, rng.randint(2, 200))
        else:
            prompt = _text(rng, rng.randint(2, 120))
        out.append(GreedyCase(route, completion_body(route, prompt, n, stream, temperature=0), stream))
    return out


#: what may be added to a greedy request without changing its answer
GREEDY_VARIANTS = ({}, {}, {"speculative.n_max": 0}, {"speculative": {"n_max": 1}}, {"speculative.verify": "rejection"},
                   {"cache_prompt": False}, {"id_slot": 0}, {"top_k": 1}, {"seed": 7})


def _normal(rng: random.Random, ctx: MixContext, kind: str) -> Call:
    if ctx.pool and rng.random() < 0.5:  # greedy, with a known answer
        i = rng.randrange(len(ctx.pool))
        c = ctx.pool[i]
        variant = dict(rng.choice(GREEDY_VARIANTS))
        if kind == "pinned":
            variant["id_slot"] = 0
        return Call(kind, "POST", c.path, _dump({**c.body, **variant}), c.stream, case=i, normal=True,
                    note=json.dumps(variant))
    route = {"complete": "/completion", "oai-complete": "/v1/completions", "chat": "/v1/chat/completions"}.get(
        kind, rng.choice(ROUTES))
    stream = rng.random() < 0.5
    n = rng.choice([1, 8, 32, 64, 128, rng.randint(1, 256)])
    prompt = (_messages(rng, rng.randint(1, 60)) if route == "/v1/chat/completions" else
              _ids(rng, ctx, rng.randint(1, 300)) if route == "/completion" and rng.random() < 0.4 else
              _text(rng, rng.randint(1, 200)))
    kw: dict = {"temperature": rng.choice([0.0, 0.7, 1.0, 1.5]), "seed": rng.randrange(1 << 32)}
    if kw["temperature"] and route != "/completion" and rng.random() < 0.3:
        kw["n"] = 2
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(WORDS), "\n\n"]
    if kind == "pinned":
        kw["id_slot"] = 0
    return Call(kind, "POST", route, _dump(completion_body(route, prompt, n, stream, **kw)), stream, normal=True)


def _disconnect_stream(rng, ctx) -> Call:
    route = rng.choice(ROUTES)
    prompt = _messages(rng, 10) if route == ROUTES[2] else _text(rng, rng.randint(2, 100))
    body = completion_body(route, prompt, rng.choice([256, 1024, -1]), True, temperature=rng.choice([0, 0.8]))
    return Call("disconnect-stream", "POST", route, _dump(body), True, expect=OK | {DISCONNECTED}, action="events",
                arg=rng.choice([0, 1, 2, 5, 20]))


def _disconnect_prompt(rng, ctx) -> Call:
    """A prompt nearly as long as the context, the socket closed while it waits or is processed."""
    n = rng.randint(ctx.n_ctx // 2, ctx.n_ctx - 40)
    body = completion_body("/completion", _ids(rng, ctx, n), 32, rng.random() < 0.5)
    return Call("disconnect-prompt", "POST", "/completion", _dump(body), body["stream"], expect=OK | {DISCONNECTED},
                action="early", arg=rng.choice([0.0, 0.01, 0.05, 0.2, 0.5]))


def _partial_body(rng, ctx) -> Call:
    body = _dump(completion_body("/completion", _text(rng, 50), 8, False))
    return Call("partial-body", "POST", "/completion", body, expect=frozenset({DISCONNECTED, "400"}), action="partial",
                arg=rng.random())


def _oversized(rng, ctx) -> Call:
    which = rng.randrange(4)
    if which == 0:  # more prompt tokens than a slot holds
        return Call("oversized", "POST", "/completion", _dump({"prompt": _ids(rng, ctx, ctx.n_ctx + rng.randint(0, 500)),
                                                               "n_predict": 4}), expect=BAD_REQUEST, note="tokens")
    if which == 1:  # text that tokenises past the context (but within --max-prompt-chars)
        route = rng.choice(ROUTES)
        text = _text(rng, min(ctx.max_prompt_chars // 8, ctx.n_ctx * 3))
        prompt = [{"role": "user", "content": text}] if route == ROUTES[2] else text
        body = completion_body(route, prompt, 4, rng.random() < 0.5)
        return Call("oversized", "POST", route, _dump(body), body["stream"], expect=BAD_REQUEST, note="text")
    if which == 2:  # over --max-prompt-chars
        return Call("oversized", "POST", "/v1/completions",
                    _dump({"prompt": "a" * (ctx.max_prompt_chars + 1), "max_tokens": 2}), expect=BAD_REQUEST,
                    note="chars")
    body = b'{"prompt": "' + b"x" * (ctx.max_body + 10) + b'", "n_predict": 2}'  # over --max-body-size
    return Call("oversized", "POST", "/completion", body, expect=frozenset({"413"}), note="body")


#: bodies that are no valid request: (raw body, route)
BAD_JSON = [b"", b"{", b'{"prompt": ', b"[1, 2]", b"null", b'"text"', b"\xff\xfe{}", b'{"prompt": "a\xc3"}',
            b'{"prompt": NaN, "n_predict": 2}', b'{"prompt": "x", "n_predict": Infinity}', b'{"prompt": "\\ud800"}',
            b'{"messages": [{"role": "user", "content": "\\udfff"}]}', b"[" * 100000 + b"]" * 100000,
            b'{"prompt": ' + b"[" * 5000 + b"1" + b"]" * 5000 + b"}", b"{'single': 1}", b'{"prompt": "x"} trailing',
            b'{"messages": []}', b'{"messages": [{}]}', b'{"prompt": []}', b'{"prompt": [[]]}', b'{"tokens": [1e400]}']
#: a field with a value of the wrong type or out of range (each must be a 400)
WRONG = [("temperature", "hot"), ("temperature", [0]), ("n_predict", "10"), ("n_predict", -7), ("max_tokens", {}),
         ("top_k", 1.5), ("top_p", 7), ("min_p", -1), ("seed", -2), ("seed", 2 ** 64), ("stop", 5), ("stop", [1, 2]),
         ("stream", "yes"), ("n_predict", 10 ** 30), ("top_k", 2 ** 40), ("repeat_last_n", 10 ** 12),
         ("repeat_last_n", -2), ("repeat_penalty", -1), ("logit_bias", {"999999999": 1}), ("logit_bias", "x"),
         ("n_probs", -1), ("n_probs", 10 ** 9), ("n", 0), ("n", 10 ** 6), ("id_slot", 10 ** 9), ("id_slot", -5),
         ("cache_prompt", "no"), ("grammar", 7), ("json_schema", "x"), ("response_format", {"type": "bogus"}),
         ("speculative.n_max", -1), ("speculative.n_max", 10 ** 9), ("speculative.n_max", "x"),
         ("speculative", {"n_max": 10 ** 9}), ("speculative", {"verify": "bogus"}), ("speculative", {"p_min": 2}),
         ("speculative", {"n_min": -3}), ("speculative", "fast"), ("presence_penalty", "x"), ("mirostat", 9)]


def _bad_json(rng, ctx) -> Call:
    raw = rng.choice(BAD_JSON)
    return Call("bad-json", "POST", rng.choice(ROUTES + ("/tokenize", "/apply-template")), raw, expect=BAD_REQUEST,
                note=repr(raw[:40]))


def _wrong_type(rng, ctx) -> Call:
    route = rng.choice(ROUTES)
    name, value = rng.choice(WRONG)
    body = completion_body(route, [{"role": "user", "content": "hi"}] if route == ROUTES[2] else "hi", 4, False)
    if name in ("n_predict", "max_tokens"):  # the length field the route reads first (the other is a fallback)
        name = "n_predict" if route == "/completion" else "max_tokens"
    body[name] = value
    return Call("wrong-type", "POST", route, _dump(body), expect=BAD_REQUEST, note=f"{name}={value!r}"[:80])


#: grammars and JSON schemas that are hard to parse, to follow or to satisfy: each a 200 or a 400, in time
GRAMMARS = ['root ::= a\na ::= a "x" | "x"', "root ::= (", 'root ::= "\\u2603"', 'root ::= [^\\x00-\\U0010FFFF]',
            'root ::= "a"{1000}', 'root ::= ("a"{100}){100}', 'root ::= "a"{0,100000}',
            "root ::= " + "(" * 2000 + '"a"' + ")" * 2000, 'root ::= x\nx ::= y\ny ::= x', "root ::= undefined",
            'root ::= "' + "ab" * 20000 + '"', "root ::= " + " | ".join(f'"{i}"' for i in range(5000)),
            'root ::= [a-z]* "" [a-z]*', "root ::= ()*", 'root ::= ("" | "a")*', "root ::= " + "(" * 20000 + '"a"' + ")" * 20000,
            'root ::= ("a" | "a" | "aa" | [a-f] | [0-9a-f]+)+', 'root ::= x+\nx ::= y | y y | y y y\ny ::= [0-9a-f] | "1"']
SCHEMAS = [{"$ref": "#"}, {"$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"},
           {"type": "string", "minLength": 10 ** 8}, {"type": "array", "minItems": 10 ** 9, "items": {"type": "integer"}},
           {"type": "string", "pattern": "^((a+)+)+$"}, {"enum": list(range(20000))},
           {"type": "integer", "minimum": 10 ** 300}, {"type": "object", "required": ["a" * 5000]},
           {"anyOf": [{"type": "string", "maxLength": i} for i in range(300)]},
           {"type": "string", "pattern": "^" + "(a|b)" * 500 + "$"}, {"type": "object", "properties": {
               f"p{i}": {"type": "object", "properties": {"q": {"type": "string"}}} for i in range(500)},
               "required": [f"p{i}" for i in range(500)]}, {"not": {}}, {"type": "bogus"}, {"type": ["string", 5]},
           {"type": "string", "format": "date-time", "minLength": 3, "maxLength": 2}]


def _nested_schema(depth: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


def _grammar(rng, ctx) -> Call:
    route = rng.choice(ROUTES)
    body = completion_body(route, [{"role": "user", "content": "hi"}] if route == ROUTES[2] else "hi",
                           rng.choice([4, 64]), rng.random() < 0.5)
    if rng.random() < 0.5:
        body["grammar"] = g = rng.choice(GRAMMARS)
        note = g[:60]
    else:
        schema = rng.choice(SCHEMAS + [_nested_schema(rng.choice([30, 60]))])
        if route == "/v1/chat/completions" and rng.random() < 0.5:
            body["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
        else:
            body["json_schema"] = schema
        note = json.dumps(schema)[:60]
    return Call("grammar", "POST", route, _dump(body), body["stream"], expect=OK | BAD_REQUEST, note=note)


def _abuse(rng, ctx) -> Call:
    """Huge ``n_probs``, ``n``, prompts x n, stop lists and stop strings."""
    route = rng.choice(ROUTES[:2])
    body = completion_body(route, "hi", 4, rng.random() < 0.5)
    which = rng.randrange(6)
    if which == 0:
        body["n_probs" if route == "/completion" else "logprobs"] = rng.choice([10 ** 6, 101, 2 ** 31])
    elif which == 1:
        body["n_probs" if route == "/completion" else "logprobs"] = min(20, ctx.n_vocab)  # the most: a 200
        return Call("abuse", "POST", route, _dump(body), body["stream"], note="n_probs max")
    elif which == 2:
        body["prompt"] = ["hi"] * 200
        body["n"] = 16
    elif which == 3:
        body["stop"] = [str(i) for i in range(1000)]
    elif which == 4:
        body["stop"] = ["s" * 5000]
    else:
        body["speculative.n_max"] = rng.choice([0, 1, 2, 3]) if rng.random() < 0.5 else 10 ** 6
        return Call("abuse", "POST", route, _dump(body), body["stream"], expect=OK | BAD_REQUEST, note="n_max")
    return Call("abuse", "POST", route, _dump(body), body["stream"], expect=BAD_REQUEST, note=f"abuse {which}")


def _tiny_timeout(rng, ctx) -> Call:
    """``max_tokens`` huge and a client that gives up after a fraction of a second."""
    route = rng.choice(ROUTES)
    prompt = [{"role": "user", "content": "hi"}] if route == ROUTES[2] else _text(rng, 5)
    body = completion_body(route, prompt, rng.choice([10 ** 6, -1, 2 ** 31 - 1]), rng.random() < 0.5)
    return Call("tiny-timeout", "POST", route, _dump(body), body["stream"], expect=frozenset({TIMEOUT}) | OK,
                timeout=rng.choice([0.02, 0.1, 0.3, 1.0]))


def _slow_reader(rng, ctx) -> Call:
    route = rng.choice(ROUTES)
    prompt = _messages(rng, 8) if route == ROUTES[2] else _text(rng, 20)
    body = completion_body(route, prompt, rng.choice([16, 64, 128]), True, temperature=0.8, seed=rng.randrange(99))
    return Call("slow-reader", "POST", route, _dump(body), True, action="slow", arg=rng.choice([0.02, 0.05, 0.1]))


def _odd_route(rng, ctx) -> Call:
    which = rng.randrange(5)
    if which == 0:
        return Call("odd-route", "GET", "/no/such/route", expect=frozenset({"404"}))
    if which == 1:
        return Call("odd-route", "GET", "/completion", expect=frozenset({"405", "404"}))
    if which == 2:
        return Call("odd-route", "POST", "/tokenize", _dump({"content": _text(rng, 3000), "with_pieces": True}))
    if which == 3:
        return Call("odd-route", "POST", "/detokenize", _dump({"tokens": [ctx.n_vocab + 5, -1]}), expect=BAD_REQUEST)
    return Call("odd-route", "POST", "/detokenize", _dump({"tokens": _ids(rng, ctx, 2000)}))


def _poll(rng, ctx) -> Call:
    return Call("poll", "GET", rng.choice(["/slots", "/metrics", "/health", "/props", "/v1/models"]))


#: kind -> (weight, builder); the normal kinds first
KINDS = {
    "complete": (10, lambda r, c: _normal(r, c, "complete")),
    "oai-complete": (8, lambda r, c: _normal(r, c, "oai-complete")),
    "chat": (10, lambda r, c: _normal(r, c, "chat")),
    "pinned": (4, lambda r, c: _normal(r, c, "pinned")),
    "disconnect-stream": (5, _disconnect_stream),
    "disconnect-prompt": (4, _disconnect_prompt),
    "partial-body": (1, _partial_body),
    "oversized": (3, _oversized),
    "bad-json": (3, _bad_json),
    "wrong-type": (4, _wrong_type),
    "grammar": (4, _grammar),
    "abuse": (3, _abuse),
    "tiny-timeout": (3, _tiny_timeout),
    "slow-reader": (2, _slow_reader),
    "odd-route": (2, _odd_route),
    "poll": (3, _poll),
}
NORMAL = ("complete", "oai-complete", "chat", "pinned")


def draw_call(rng: random.Random, ctx: MixContext) -> Call:
    names = list(KINDS)
    kind = rng.choices(names, weights=[KINDS[n][0] for n in names])[0]
    return KINDS[kind][1](rng, ctx)
