"""What the routes of ``llamaspec serve`` share: :class:`ServerConfig` (how the server was started) and
:class:`ServerState` (the engine once loaded, its start, the loading thread's outcome, the open
generation groups, shutdown)."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..chat import ChatTemplate
from ..malloc import Trimmer
from .errors import unavailable
from .jobs import Dispatcher, JobGroup
from .limits import Admission, Limits
from .metrics import make_registry
from .parsing import Defaults

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["ServerConfig", "ServerState"]

log = logging.getLogger("llamaspec.server")

#: chatml (``<|im_start|>role\ncontent<|im_end|>\n``, then the assistant's opening) as a Jinja template: the
#: template under ``--jinja`` of a model without one, and of ``--chat-template chatml``, as llama-server has it
CHATML_JINJA = ("{%- for message in messages -%}"
                "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
                "{%- endfor -%}"
                "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")


@dataclass
class ServerConfig:
    """What ``llamaspec serve`` was started with (besides the Engine)."""

    model_id: str = "llamaspec"
    model_path: str = ""
    api_keys: list[str] = field(default_factory=list)
    metrics: bool = False
    slots: bool = True
    #: a built-in template name (``chatml``, ``llama3``...) or a Jinja template; None = the GGUF's own
    chat_template: str | None = None
    sse_ping_interval: float = 30.0
    defaults: Defaults = field(default_factory=Defaults)
    #: every name of the model (``--alias a,b``; /v1/models ``aliases``) and its ``--tags``
    aliases: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    #: ``POST /props`` allowed (``--props``)
    props: bool = False
    #: ``--jinja`` (llama-server's default): Jinja templates are rendered with Jinja; ``--no-jinja``: built-in only
    jinja: bool = True
    #: ``--verbose``: responses may carry ``__verbose`` when the request asks for it
    verbose: int = 0
    #: ``--api-prefix``: every route lives under it
    api_prefix: str = ""
    #: llama-server's CORS: ``*`` (echo the Origin with credentials), ``localhost`` (local origins only) or a value
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True
    #: ``--ui-mcp-proxy``: ``/cors-proxy`` forwards requests (:mod:`llamaspec.server.cors_proxy`); off: 403
    mcp_proxy: bool = False
    #: the ``--max-*`` bounds (:mod:`llamaspec.server.limits`)
    limits: Limits = field(default_factory=Limits)
    #: ``--slot-save-path``: the directory of ``POST /slots/{id}?action=save|restore`` files (None: 501)
    slot_save_path: str | None = None
    #: ``--spm-infill``: ``/infill`` prompts in suffix/prefix/middle order (default prefix/suffix/middle)
    spm_infill: bool = False


class ServerState:
    """The engine (once loaded) and everything the routes share."""

    def __init__(self, config: ServerConfig, engine: "Engine | None" = None):
        self.config = config
        #: when the server started (``/metrics``' ``Process-Start-Time-Unix`` header)
        self.t_start = time.time()
        self.engine: "Engine | None" = None
        self.load_error: BaseException | None = None
        self.chat_template: str | None = None
        #: the chat template every chat route renders with (:class:`llamaspec.chat.ChatTemplate`)
        self.chat: ChatTemplate | None = None
        self.groups: set[JobGroup] = set()
        #: generations queued or running (``--max-queued-generations``)
        self.admission = Admission(config.limits)
        #: moves every request's chunks to the event loop (one thread, started with the engine)
        self.dispatcher: Dispatcher | None = None
        #: gives the C heap's free memory back after requests (on the dispatcher thread; llamaspec.malloc)
        self.trimmer = Trimmer()
        #: a SIGTERM arrived: new generations get 503 while the running ones finish
        self.draining = False
        self._lock = threading.Lock()
        self.on_ready: Callable[["ServerState"], None] | None = None
        self.on_load_failed: Callable[[BaseException], None] | None = None
        self._registry = None
        if engine is not None:
            self._set_engine(engine)

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def _set_engine(self, engine: "Engine") -> None:
        tmpl = self.config.chat_template or engine.model.chat_template()
        if tmpl is None:
            log.warning("the model has no chat template: /v1/chat/completions uses chatml (as llama-server); "
                        "--chat-template NAME|TEMPLATE to choose one")
            tmpl = "chatml"
        if tmpl == "chatml" and self.config.jinja:  # llama-server: chatml as a Jinja template (tools work)
            tmpl = CHATML_JINJA
        chat = ChatTemplate.of_model(engine.model, tmpl, jinja=self.config.jinja)  # compiled once, on first use
        chat.render([{"role": "user", "content": "x"}])  # fails early
        self.chat_template = tmpl
        self.chat = chat
        engine.start()
        self.dispatcher = Dispatcher(engine, self.trimmer)
        self.dispatcher.start()
        self.engine = engine

    def load(self, loader: Callable[[], "Engine"]) -> None:
        """Build the engine (in the loader thread); ``/health`` answers 503 until it is ready."""
        eng = None
        try:
            eng = loader()
            self._set_engine(eng)
        except BaseException as e:  # noqa: BLE001 - reported by the serve command as one line
            self.load_error = e
            if eng is not None:
                with contextlib.suppress(Exception):
                    eng.close()
            if self.on_load_failed is not None:
                self.on_load_failed(e)
            return
        if self.on_ready is not None:
            self.on_ready(self)

    def shutdown(self) -> None:
        self.cancel_all()
        eng, self.engine = self.engine, None
        if eng is not None:
            with contextlib.suppress(Exception):
                eng.stop()
            eng.close()  # every request still running ends with abort
        if self.dispatcher is not None:
            self.dispatcher.stop()

    def cancel_all(self) -> None:
        """Cancel every running generation (the drain timeout passed): each ends with an error event."""
        with self._lock:
            groups = list(self.groups)
        for g in groups:
            g.cancel()

    @property
    def n_groups(self) -> int:
        """HTTP requests whose generations are still being answered."""
        with self._lock:
            return len(self.groups)

    def check_accepting(self) -> None:
        """503 once a SIGTERM started the drain."""
        if self.draining:
            raise unavailable("the server is shutting down")

    def add_group(self, g: JobGroup) -> None:
        with self._lock:
            self.groups.add(g)

    def drop_group(self, g: JobGroup) -> None:
        with self._lock:
            if g not in self.groups:
                return
            self.groups.discard(g)
        self.admission.release(len(g.reqs))

    @property
    def registry(self):
        if self._registry is None:
            self._registry = make_registry(lambda: self.engine)
        return self._registry

    def need_engine(self) -> "Engine":
        eng = self.engine
        if eng is None:
            raise unavailable("Loading model")
        return eng
