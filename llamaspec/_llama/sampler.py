"""Target sampling: :class:`SamplingParams` and the owning llama.cpp sampler chain :class:`Sampler`."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
from llama_cpp import llama_cpp as native

from ..errors import LlamaSpecError, SamplerError, UsageError
from .context import Context
from .grammar_limits import MAX_ALTERNATIVES, alternatives_message, alternatives_over, check_gbnf
from .log import _forget_native_errors, _last_native_error
from .model import Model, Vocab, _Owned
from .sampler_chain import chain_samplers, sampler_order

DEFAULT_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: "pick a random seed"


@dataclass
class SamplingParams:
    """Target sampling settings (llama.cpp names). ``temp <= 0`` means greedy."""

    temp: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int = DEFAULT_SEED
    grammar: str | None = None
    grammar_root: str = "root"
    #: refuse a grammar with more alternatives open at once (each costs a pass over the vocabulary per token:
    #: llamaspec._llama.grammar_cost, docs/limits.md); 0 = no limit
    max_grammar_alternatives: int = MAX_ALTERNATIVES
    #: ``(token id, bias)`` pairs added to the logits before anything else (``-inf``: never this token);
    #: llama.cpp's ``--logit-bias`` / the OpenAI field
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: never end on an end-of-generation token (a ``-inf`` bias on every EOG token, as llama-server does)
    ignore_eos: bool = False
    # llama.cpp's other samplers (common_params_sampling names and defaults; neutral values do nothing)
    typ_p: float = 1.0
    min_keep: int = 0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = 64
    dry_sequence_breakers: tuple[str, ...] = ("\n", ":", "\"", "*")
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    adaptive_target: float = -1.0
    adaptive_decay: float = 0.9
    #: the sampler order (llamaspec._llama.sampler_chain names); None = llama.cpp's default order
    samplers: tuple[str, ...] | None = None

    @property
    def greedy(self) -> bool:
        return self.temp <= 0

    def validate(self) -> None:
        for bad, msg in (
            (self.top_k < 0, f"top-k must be >= 0 (0 disables it), got {self.top_k}"),
            (not 0.0 <= self.top_p <= 1.0, f"top-p must be in [0, 1], got {self.top_p}"),
            (not 0.0 <= self.min_p <= 1.0, f"min-p must be in [0, 1], got {self.min_p}"),
            (self.repeat_last_n < -1, "repeat-last-n must be -1 (the context size), 0 (off) or a positive window, "
                                      f"got {self.repeat_last_n}"),
            (self.repeat_penalty <= 0, f"repeat-penalty must be > 0 (1.0 disables it), got {self.repeat_penalty}"),
            (not 0 <= self.seed <= 0xFFFFFFFF, f"seed must be in [0, 4294967295], got {self.seed}"),
            (self.temp != self.temp, "temperature must be a number"),  # NaN
            (self.mirostat not in (0, 1, 2), f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}"),
            (self.min_keep < 0 or self.dry_allowed_length < 0 or self.dry_penalty_last_n < 0,
             "min-keep, dry-allowed-length and dry-penalty-last-n must be >= 0"),
            (self.max_grammar_alternatives < 0,
             f"max-grammar-alternatives must be >= 0 (0: no limit), got {self.max_grammar_alternatives}"),
            (not 0.0 <= self.xtc_probability <= 1.0, f"xtc-probability must be in [0, 1], got {self.xtc_probability}"),
        ):
            if bad:
                raise UsageError(msg)
        if self.samplers is not None:
            self.samplers = sampler_order(self.samplers)
        for tok, bias in self.logit_bias:
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise UsageError(f"logit-bias: token ids are integers >= 0, got {tok!r}")
            if bias != bias or bias == float("inf"):
                raise UsageError(f"logit-bias for token {tok}: the bias must be a number or -inf, got {bias!r}")


def _logit_biases(vocab: Vocab, params: SamplingParams) -> list[tuple[int, float]]:
    """``params.logit_bias`` checked against the vocabulary (a later pair for the same token wins), then
    ``-inf`` on every EOG token with ``ignore_eos`` (whatever their bias)."""
    n = vocab.n_tokens
    out: dict[int, float] = {}
    for tok, bias in params.logit_bias:
        if not 0 <= tok < n:
            raise UsageError(f"logit-bias: token id {tok} is outside the vocabulary (0..{n - 1})")
        out[tok] = float(bias)
    if params.ignore_eos:
        out.update((t, float("-inf")) for t in vocab.eog_tokens())
    return sorted(out.items())


def check_grammar(params: SamplingParams) -> None:
    """``params.grammar`` against what llama.cpp can take: nested deeper than its recursive parser can go
    without overflowing its stack (:class:`SamplerError`), or more alternatives open at once than
    ``params.max_grammar_alternatives`` (:class:`UsageError`: every token would cost a pass over the vocabulary
    for each)."""
    text = params.grammar or ""
    try:
        check_gbnf(text)
    except ValueError as e:
        raise SamplerError(f"grammar refused: {e}") from None
    n = alternatives_over(text, params.max_grammar_alternatives)
    if n:
        raise UsageError(f"grammar refused: {alternatives_message(n)}, over the limit of "
                         f"{params.max_grammar_alternatives} (SamplingParams.max_grammar_alternatives, "
                         "--max-grammar-alternatives on the command line; 0: no limit)")


def _native_grammar(vocab: Vocab, params: SamplingParams):
    """The native grammar sampler of ``params`` (checked by :func:`check_grammar` already); :class:`SamplerError`
    when llama.cpp cannot parse the grammar."""
    _forget_native_errors()  # the message below quotes this call's log lines only
    ptr = native.llama_sampler_init_grammar(vocab.ptr, (params.grammar or "").encode("utf-8"),
                                            params.grammar_root.encode("utf-8"))
    if not ptr:
        raise SamplerError(f"grammar does not parse: {_last_native_error('see the llama.cpp log')}")
    return ptr


class Sampler(_Owned):
    """An owning llama.cpp sampler chain built from :class:`SamplingParams`.

    Chain order follows llama.cpp's common sampler: [grammar] -> [logit bias] -> the samplers of
    :mod:`.sampler_chain` (penalties -> DRY -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> XTC ->
    temperature by default, or mirostat) -> dist (or greedy when ``temp <= 0``). ``sample`` accepts the sampled token into the chain
    (``llama_sampler_sample`` does so itself).

    A grammar sampler reads its model's vocabulary natively, so it keeps (and acquires) the model.
    """

    _TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])

    def __init__(self, ptr, *, model: Model | None = None):
        self.ptr = ptr
        self._model = None
        if model is not None:
            model._acquire()  # when this raises, __del__ still frees ptr
            self._model = model

    @classmethod
    def grammar_only(cls, vocab: Vocab, params: SamplingParams) -> "Sampler":
        """The grammar of ``params`` alone (llama.cpp's ``common_sampler`` keeps it apart from the chain)."""
        model = vocab.model  # raises when the model is closed
        check_grammar(params)
        return cls(_native_grammar(vocab, params), model=model)

    @classmethod
    def from_params(cls, vocab: Vocab, params: SamplingParams, *, grammar: bool = True) -> "Sampler":
        """The chain of ``params``; ``grammar=False`` leaves the grammar out (see :meth:`grammar_only`)."""
        params.validate()
        use_grammar = bool(params.grammar) and grammar
        model = vocab.model if use_grammar else None  # raises when the model is closed
        if use_grammar:
            check_grammar(params)
        biases = _logit_biases(vocab, params)  # refused before anything native is made
        chain = native.llama_sampler_chain_init(native.llama_sampler_chain_default_params())
        add = lambda s: native.llama_sampler_chain_add(chain, s)  # noqa: E731
        try:
            if use_grammar:
                add(_native_grammar(vocab, params))
            if biases:
                arr = (native.llama_logit_bias * len(biases))(*[native.llama_logit_bias(t, b) for t, b in biases])
                add(native.llama_sampler_init_logit_bias(vocab.n_tokens, len(biases), arr))
            for smpl in chain_samplers(vocab, params):
                add(smpl)
        except BaseException:
            native.llama_sampler_free(chain)  # and the samplers added to it
            raise
        return cls(chain, model=model)

    def live_ptr(self):
        """The native ``llama_sampler *``; :class:`LlamaSpecError` when the sampler is closed."""
        ptr = self.ptr
        if not ptr:
            raise LlamaSpecError("sampler is closed")
        return ptr

    def sample(self, ctx: Context, idx: int) -> int:
        """Sample from batch row ``idx`` of ``ctx``'s last decode and accept the token into the chain.

        :class:`DecodeError` when the row has no logits (llama.cpp would abort); contexts with backend
        samplers (``extra["samplers"]``) may have a sampled token instead, so they are not checked.
        """
        ptr = self.ptr or self.live_ptr()  # (live_ptr raises: the sampler is closed)
        ctx_ptr = ctx.live_ptr()
        if not ctx.has_backend_samplers and not native.llama_get_logits_ith(ctx_ptr, idx):
            ctx.logits_ptr(idx)  # raises DecodeError: the row has no logits
        return native.llama_sampler_sample(ptr, ctx_ptr, idx)

    def accept(self, token: int) -> None:
        native.llama_sampler_accept(self.live_ptr(), token)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """For a grammar sampler: which of ``ids`` it allows now (one ``llama_sampler_apply``)."""
        ids = np.asarray(ids, dtype=np.int32).reshape(-1)
        buf = np.zeros(ids.size, dtype=self._TOKEN_DATA)
        buf["id"] = ids
        buf["logit"] = 1.0
        if ids.size:
            arr = native.llama_token_data_array(
                data=buf.ctypes.data_as(native.llama_token_data_p), size=ids.size, selected=-1, sorted=False
            )
            native.llama_sampler_apply(self.live_ptr(), ctypes.byref(arr))
        return np.isfinite(buf["logit"])

    def allows(self, token: int) -> bool:
        """For a grammar sampler: whether it allows ``token`` now (llama.cpp's single-token check)."""
        return bool(self.allowed(np.array([token]))[0])

    def clone(self) -> "Sampler":
        """Deep copy, including the random state of ``dist``."""
        return Sampler(native.llama_sampler_clone(self.live_ptr()), model=self._model)

    def copy_from(self, other: "Sampler") -> None:
        """Copy ``other``'s state into this sampler (``llama_sampler_copy``), e.g. to restore a clone."""
        native.llama_sampler_copy(other.live_ptr(), self.live_ptr())

    def close(self) -> None:
        ptr = getattr(self, "ptr", None)
        if ptr:
            self.ptr = None
            native.llama_sampler_free(ptr)
        model = getattr(self, "_model", None)
        if model is not None:
            self._model = None
            model._release()


class Candidates:
    """A reusable ``llama_token_data_array`` over the whole vocabulary, filled from one row's logits, for
    applying samplers the way ``common_sampler`` does (apply, read ``selected``, read the kept ``p``)."""

    def __init__(self, n_vocab: int):
        self.buf = np.zeros(n_vocab, dtype=Sampler._TOKEN_DATA)
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self.arr = native.llama_token_data_array(
            data=self.buf.ctypes.data_as(native.llama_token_data_p), size=n_vocab, selected=-1, sorted=False
        )

    def fill(self, logits: np.ndarray) -> None:
        n = self.buf.shape[0]
        if logits.shape[0] < n:
            raise SamplerError(f"a row has {logits.shape[0]} logits, the vocabulary {n} tokens")
        self.buf["id"] = self._ids
        self.buf["logit"] = logits[:n]
        self.buf["p"] = 0.0
        self.arr.data = self.buf.ctypes.data_as(native.llama_token_data_p)
        self.arr.size = n
        self.arr.selected = -1
        self.arr.sorted = False

    def apply(self, sampler: Sampler) -> int:
        """Apply ``sampler`` (its state advances: the random stream of ``dist``); the selected token id, or -1
        when the sampler selects none (a grammar)."""
        native.llama_sampler_apply(sampler.live_ptr(), ctypes.byref(self.arr))
        sel = self.arr.selected
        if sel < 0:
            return -1
        if sel >= self.arr.size:
            raise SamplerError("the sampler chain selected no token")
        return int(self.buf["id"][sel])

    def apply_clone(self, sampler: Sampler) -> int:
        """:meth:`apply` on a throw-away clone: the candidates change, ``sampler`` does not."""
        ptr = native.llama_sampler_clone(sampler.live_ptr())
        try:
            native.llama_sampler_apply(ptr, ctypes.byref(self.arr))
        finally:
            native.llama_sampler_free(ptr)
        sel = self.arr.selected
        return int(self.buf["id"][sel]) if 0 <= sel < self.arr.size else -1

    def kept(self) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, p)`` of the candidates left after the last apply (``p`` as ``dist`` normalised it)."""
        n = int(self.arr.size)
        part = self.buf[:n]
        return part["id"].astype(np.int64), part["p"].astype(np.float64)
