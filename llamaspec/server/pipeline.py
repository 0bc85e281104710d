"""The generation routes of ``llamaspec serve`` (:data:`ROUTES`) and the one handler that serves them all
(:func:`generate`), as llama-server's ``handle_completions_impl(type)`` serves its completion, chat and infill
routes.

A row of :data:`ROUTES` (:class:`GenerationRoute`) says how a route reads its prompts, how it answers (its
renderer and its stream's end), whether it reads a chat request (``tools``, the JSON schema of the Jinja chat
path) and whether it gives more than one answer. Every request then goes one way: its body
(:func:`read_json`), its fields (``parse_gen_params``; a chat request's tools and schema, each parsed once), its
prompts tokenised (:func:`~llamaspec.server.prompt_bound.tokenize`), :func:`submit` (the one check of the
prompts against the slot's context, the limits, the engine requests), and the route's renderer answers
(:class:`~llamaspec.server.respond.GenerationResponse`). The parsing, tokenising and submitting run in a worker
thread, or on the event loop for a small request (:func:`_inline`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable

from starlette.requests import Request as HttpRequest
from starlette.routing import Route

from .chat_prompt import chat_prompt
from .errors import api_error, exceed_context, invalid
from .infill import infill_parts, infill_prompt, require_fim
from .jobs import JobGroup, in_worker
from .limits import Limits, check_generations, parse_json, read_body
from .parsing import Body, GenParams, parse_gen_params, parse_messages, parse_prompts
from .prompt_bound import tokenize
from .render import ChatRenderer, CompletionRenderer, NativeRenderer, generation_settings
from .respond import GenerationResponse, Renderer, Served
from .responses import ResponsesRenderer, to_chat
from .state import ServerState

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..request import Request

__all__ = ["GenerationRoute", "Job", "ROUTES", "generate", "routes", "read_json", "state_of", "submit"]


def state_of(request: HttpRequest) -> ServerState:
    return request.app.state.llamaspec


async def read_json(request: HttpRequest) -> Body:
    """The request's JSON object (413 past ``--max-body-size``, 400 when it is not one); a large body is
    parsed off the event loop."""
    limits = state_of(request).config.limits
    raw = await read_body(request, limits)
    if len(raw) > 65536:
        return Body(await in_worker(parse_json, raw, limits, request=request), len(raw))
    return Body(parse_json(raw, limits), len(raw))


@dataclass
class Job:
    """One generation request on its way to the engine: what a route's prompt parser reads, and what the
    steps before it parsed (``checked``: the route's own fields, ``GenerationRoute.check``)."""

    state: ServerState
    eng: "Engine"
    b: Body
    gen: GenParams | None = None
    verbose: bool = False
    checked: Any = None


@dataclass(frozen=True)
class GenerationRoute:
    """One generation route (see the module docstring)."""

    paths: tuple[str, ...]
    #: the job -> its prompts as token lists (after the generation fields are parsed)
    prompts: Callable[[Job], list[list[int]]]
    renderer: type[Renderer]
    #: a chat request: ``tools`` allowed (elsewhere a 400), a JSON schema on the Jinja path (server/chat_format.py)
    chat: bool = False
    #: reads ``verbose`` (the answer's ``__verbose``)
    verbose: bool = False
    #: the API that gives one answer per request (``n`` / ``n_cmpl`` other than 1: a 400 naming it)
    one_answer: str | None = None
    #: the body as the chat request it stands for (always in a worker: its input list is the client's)
    body: Callable[[dict], dict] | None = None
    #: checks the engine before the body is read (``/infill``: a model without FIM tokens is a 501)
    ready: Callable[["Engine"], None] | None = None
    #: the route's own fields, checked before the generation fields (``Job.checked``)
    check: Callable[[Body, Limits], Any] | None = None
    #: a stream ends with OpenAI's ``data: [DONE]``
    done: bool = True


#: a body up to this size, asking for at most INLINE_REQUESTS generations and no grammar, is tokenised and
#: submitted on the event loop: tens of microseconds of native work, against ~0.3 ms for the hop to a
#: worker thread and back
INLINE_BODY = 8192
INLINE_REQUESTS = 4
_GRAMMAR_FIELDS = ("grammar", "json_schema", "response_format", "tools", "tool_choice")


def _inline(b: Body) -> bool:
    """Whether the request is cheap to submit on the event loop (see INLINE_BODY).

    >>> _inline(Body({"prompt": "hi", "n": 2}, size=30)), _inline(Body({"prompt": ["a"] * 5}, size=30))
    (True, False)
    >>> _inline(Body({"prompt": "hi", "grammar": "root ::= x"}, size=40)), _inline(Body({"prompt": "hi"}, size=9000))
    (False, False)
    """
    if b.size is None or b.size > INLINE_BODY or any(b.data.get(k) is not None for k in _GRAMMAR_FIELDS):
        return False
    prompt = b.data.get("prompt")
    n = b.data.get("n", b.data.get("n_cmpl", 1))
    n_prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return isinstance(n, int) and n_prompts * n <= INLINE_REQUESTS


async def generate(route: GenerationRoute, request: HttpRequest) -> GenerationResponse:
    """The handler of every generation route: parse, tokenise and submit (:func:`_prepare`), then answer. Until
    the response owns the group, an error (a bad field read last) closes it: its requests are cancelled and
    their admission released (they would otherwise run on and count against --max-queued-generations)."""
    state = state_of(request)
    eng = state.need_engine()
    if route.ready is not None:
        route.ready(eng)
    job = Job(state, eng, await read_json(request))
    inline = route.body is None and _inline(job.b)
    group = _prepare(route, job) if inline else await in_worker(_prepare, route, job, request=request)
    try:
        return GenerationResponse(group, route.renderer(_served(job)), stream=job.gen.stream,
                                  ping_interval=state.config.sse_ping_interval, done=route.done)
    except BaseException:
        group.close()
        raise


def _prepare(route: GenerationRoute, job: Job) -> JobGroup:
    """The job's fields, prompts and engine requests, in the order llama-server reads them."""
    state, eng, limits = job.state, job.eng, job.state.config.limits
    if route.body is not None:
        job.b = Body(route.body(job.b.data), job.b.size)
    b = job.b
    for key in ("n", "n_cmpl") if route.one_answer else ():  # n_cmpl: the alias parse_gen_params reads too
        n = b.data.get(key)
        if n is not None and (isinstance(n, bool) or n != 1):
            raise invalid(f"Field '{key}': {route.one_answer} gives one answer per request")
    if route.verbose:
        job.verbose = _verbose(b, state)
    if route.check is not None:
        job.checked = route.check(b, limits)
    job.gen = parse_gen_params(b, state.config.defaults, n_ctx=eng.n_ctx_seq, limits=limits,
                               tokenize=lambda text: eng.tokenize(text, add_special=False, parse_special=False),
                               chat=route.chat, jinja=state.chat is not None and state.chat.jinja)
    return submit(state, route.prompts(job), job.gen)


def _served(job: Job) -> Served:
    state, eng, gen = job.state, job.eng, job.gen
    v = job.b.data.get("model")
    model = v if isinstance(v, str) and v else state.config.model_id
    return Served(gen, model, eng.vocab, eng.chain is not None,
                  lambda: generation_settings(eng, gen, state.config.defaults, model) if state.engine is not None
                  else None,
                  job.verbose)


def _verbose(b: Body, state: ServerState) -> bool:
    """The request's ``verbose`` (llama-server: ``__verbose`` in the answer), default ``--verbose``."""
    v = b.data.get("verbose")
    if v is None:
        return state.config.verbose > 0
    if not isinstance(v, bool):
        raise invalid(f"Field 'verbose': expected true or false, got {v!r}")
    return v


def _completion_prompts(job: Job) -> list[list[int]]:
    return parse_prompts(job.b, partial(tokenize, job.eng), limits=job.state.config.limits, n_cmpl=job.gen.n_cmpl)


def _chat_prompts(job: Job) -> list[list[int]]:
    """The messages, templated with the request's tools (server/chat_prompt.py), as one prompt."""
    messages = parse_messages(job.b, job.state.config.limits)
    return [tokenize(job.eng, chat_prompt(job.state, job.b.data, messages, job.gen.tools))]


def _infill_prompts(job: Job) -> list[list[int]]:
    return [infill_prompt(job.eng, job.state.config, job.checked)]


def submit(state: ServerState, prompts: list[list[int]], gen: GenParams) -> JobGroup:
    """Queue one engine request per prompt (times ``n``); 400 / 503 before anything runs when one cannot: a
    prompt as long as the slot's context (llama-server's ``exceed_context_size_error``), too many generations,
    a full server, an option the engine refuses (a UsageError is a 400 naming the field)."""
    eng = state.need_engine()
    state.check_accepting()
    check_generations(len(prompts), gen.n_cmpl, state.config.limits)
    n_ctx = eng.n_ctx_seq
    for toks in prompts:
        if len(toks) >= n_ctx:
            raise exceed_context(len(toks), n_ctx)
    n = len(prompts) * gen.n_cmpl
    reqs: list["Request"] = []
    state.admission.reserve(n)  # 503 + Retry-After when the server is full
    try:
        for toks in prompts:
            for _ in range(gen.n_cmpl):
                reqs.append(eng.submit(toks, gen.options))
    except BaseException as e:
        state.admission.release(n)
        for r in reqs:
            r.cancel()
        raise api_error(e) from e
    group = JobGroup(reqs, on_close=state.drop_group, dispatcher=state.dispatcher)
    state.add_group(group)
    return group


#: every generation route (their fields: :func:`llamaspec.server.openapi.describe`)
ROUTES = (
    GenerationRoute(("/v1/completions",), _completion_prompts, CompletionRenderer, verbose=True),
    GenerationRoute(("/v1/chat/completions", "/chat/completions"), _chat_prompts, ChatRenderer, chat=True,
                    verbose=True),
    GenerationRoute(("/v1/responses", "/responses"), _chat_prompts, ResponsesRenderer, chat=True,
                    one_answer="the Responses API", body=to_chat, done=False),
    GenerationRoute(("/completion", "/completions"), _completion_prompts, NativeRenderer, done=False),
    GenerationRoute(("/infill",), _infill_prompts, NativeRenderer, ready=require_fim, check=infill_parts, done=False),
)


def routes() -> list[Route]:
    """The Starlette routes of :data:`ROUTES`, each served by :func:`generate`."""
    return [Route(p, partial(generate, r), methods=["POST"]) for r in ROUTES for p in r.paths]
