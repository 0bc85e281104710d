"""``llama_cpp.Llama``'s token-level API on the drop-in: :meth:`~TokenAPI.eval`, :meth:`~TokenAPI.sample`,
:meth:`~TokenAPI.generate` and the state they keep (``n_tokens``, ``input_ids``, ``scores``, ``eval_tokens``,
``eval_logits``, ``_input_ids``, ``_scores``), plus ``ctx`` / ``model`` / ``_ctx`` for code that reaches for the
native handles, ``context_params`` (what LlamaIndex reads its context window from), and ``_is_recurrent`` /
``_is_hybrid``.

llama-cpp-python keeps one sequence in its context and these methods move it directly. Here that sequence is
bookkeeping, and the engine's prompt cache (slot 0) does the work:

* ``eval(tokens)`` is a request for ``input_ids[:n_tokens] + tokens`` that generates nothing (the prompt stays
  cached); with ``logits_all=True`` the new rows' logits are written to ``scores`` (:mod:`.scoring`); without
  it llama-cpp-python leaves ``scores`` unfilled too.
* ``sample(idx=i)`` is a one-token request on ``input_ids[:i + 1]``: its last token is decoded again and its
  logits sampled by the request's own sampler (a fresh one seeded with the current seed, as llama-cpp-python's
  ``sample`` outside ``generate`` builds).
* ``generate(tokens)`` is one request streamed token by token, speculative like any other, with the
  end-of-generation token yielded as llama-cpp-python yields it (generation goes on past it if the caller keeps
  asking); ``n_tokens`` counts, at each ``yield``, the prompt and the tokens yielded before. A token list
  sent into the generator is appended after the yielded token. The request is cancelled when the generator is
  closed, or when another call (``eval``, ``sample``, a completion) needs the slot: the old generator then ends.
"""
from __future__ import annotations

from collections import deque
from types import SimpleNamespace
from typing import Any, Deque, Iterator, Sequence

import numpy as np

from .. import _llama as llama
from .._llama import compat as lcp
from ..sampler import GRAMMAR_END
from ..slot import FinishReason
from .args import CompatError
from ..options import RequestOptions
from .completion import build_sampling, sampler_hooks
from .scoring import Scorer

__all__ = ["TokenAPI"]


class _ContextView:
    """What code written for llama-cpp-python reads of ``Llama._ctx`` (an ``internals.LlamaContext``): ``ctx``,
    the ``llama_context`` pointer, and ``n_ctx()``."""

    def __init__(self, llm: Any):
        self._llm = llm

    @property
    def ctx(self):
        return self._llm.ctx

    def n_ctx(self) -> int:
        return self._llm.n_ctx()


class TokenAPI:
    """Mixin of :class:`~llamaspec.compat.llama.Llama` (see the module docstring)."""

    n_tokens: int = 0
    cache = None  # set_cache(): a llama_cpp BaseLlamaCache
    _live = None  # the request of a suspended generate()
    _scorer_obj: "Scorer | None" = None
    _input_buf: "np.ndarray | None" = None
    _scores_buf: "np.ndarray | None" = None
    _vocab_ctx: "llama.Context | None" = None

    # -- state arrays -----------------------------------------------------------------------------------
    @property
    def input_ids(self) -> np.ndarray:
        """The evaluated tokens in ``[:n_tokens]`` (an ``n_ctx`` array of ``intc``, as llama-cpp-python's)."""
        if self._input_buf is None or self._input_buf.shape[0] != self.n_ctx():
            self._input_buf = np.zeros(self.n_ctx(), dtype=np.intc)
        return self._input_buf

    @property
    def scores(self) -> np.ndarray:
        """Logits per evaluated row (``n_ctx x n_vocab`` with ``logits_all``, else ``n_batch x n_vocab``), filled
        by :meth:`eval` with ``logits_all=True`` only. Allocated on first use."""
        if self._scores_buf is None:
            rows = self.n_ctx() if self._logits_all else self.n_batch
            self._scores_buf = np.zeros((rows, self.n_vocab()), dtype=np.single)
        return self._scores_buf

    @property
    def _input_ids(self) -> np.ndarray:
        return self.input_ids[: self.n_tokens]

    @property
    def _scores(self) -> np.ndarray:
        return self.scores[: self.n_tokens, :]

    @property
    def eval_tokens(self) -> Deque[int]:
        return deque(self.input_ids[: self.n_tokens].tolist(), maxlen=self.n_ctx())

    @property
    def eval_logits(self) -> Deque[list]:
        return deque(self.scores[: self.n_tokens, :].tolist(), maxlen=self.n_ctx() if self._logits_all else 1)

    def _remember(self, tokens: Sequence[int]) -> None:
        """``tokens`` are now what llama-cpp-python would have evaluated."""
        n = min(len(tokens), self.n_ctx())
        self.input_ids[:n] = np.asarray(tokens[:n], dtype=np.intc)
        self.n_tokens = n

    # -- native handles -----------------------------------------------------------------------------------
    @property
    def ctx(self):
        """The target's ``llama_context`` pointer (a small context of its own with ``vocab_only``)."""
        if self._engine is not None:
            return self._engine.ctx.live_ptr()
        if self._vocab_ctx is None:
            if self._owned_model is None:
                raise CompatError("this Llama is closed")
            self._vocab_ctx = llama.Context(self._model, n_ctx=8, n_batch=8, n_ubatch=8, n_threads=1)
        return self._vocab_ctx.live_ptr()

    @property
    def model(self):
        """The ``llama_model`` pointer."""
        return self._model.live_ptr()

    @property
    def context_params(self) -> SimpleNamespace:
        """The fields of llama-cpp-python's ``Llama.context_params`` that code reads (``n_ctx``, ``n_batch``,
        ``n_ubatch``, ``n_threads``, ``n_threads_batch``, ``n_seq_max``, ``embeddings``), as this Llama has them."""
        p = self._engine.ctx.params if self._engine is not None else None
        return SimpleNamespace(n_ctx=self.n_ctx(), n_batch=self.n_batch, n_ubatch=p.n_ubatch if p else self.n_batch,
                               n_threads=self.n_threads, n_threads_batch=self.n_threads_batch,
                               n_seq_max=p.n_seq_max if p else 1, embeddings=False)

    @property
    def _ctx(self) -> _ContextView:
        return _ContextView(self)

    @property
    def _is_recurrent(self) -> bool:
        return lcp.model_kind(self._model)[0]

    @property
    def _is_hybrid(self) -> bool:
        return lcp.model_kind(self._model)[1]

    def _scorer(self) -> Scorer:
        if self._scorer_obj is None:
            self._scorer_obj = Scorer(self)
        return self._scorer_obj

    def _close_token_api(self) -> None:
        live, self._live = self._live, None
        if live is not None and not live.done and self._engine is not None:
            live.cancel()
        for name in ("_scorer_obj", "_vocab_ctx"):
            obj = self.__dict__.pop(name, None)
            if obj is not None:
                obj.close()

    def _end_live(self) -> None:
        """Cancel a suspended :meth:`generate`'s request: the slot is needed for something else."""
        live, self._live = self._live, None
        if live is not None and not live.done:
            live.cancel()

    def _submit(self, tokens: list[int], n_predict: int, sampling=None, logits_processor=None, **options: Any):
        """One request on the slot (a suspended :meth:`generate` gives it up); ``options``: RequestOptions fields."""
        engine = self._require_engine()
        self._end_live()
        return engine.submit(tokens, RequestOptions(n_predict=n_predict, sampling=sampling,
                                                    cache_prompt=self._take_cache_permission(),
                                                    hooks=sampler_hooks(logits_processor), **options))

    @staticmethod
    def _check(req) -> None:
        if req.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"llamaspec: the request failed: {req.error}")

    # -- eval / sample / generate -------------------------------------------------------------------------
    def eval(self, tokens: Sequence[int]) -> None:
        """Evaluate ``tokens`` after the first ``n_tokens`` (``llama_cpp.Llama.eval``)."""
        new = [int(t) for t in tokens]
        seq = self.input_ids[: self.n_tokens].tolist() + new
        if len(seq) > self.n_ctx():
            raise CompatError(f"eval: {len(seq)} tokens exceed the context window of {self.n_ctx()}")
        if not new:
            return
        req = self._submit(seq, 0)
        req.result()
        self._check(req)
        if self._logits_all:
            scores = self.scores
            for i, logits in self._scorer().rows(seq, start=self.n_tokens):
                scores[i] = logits
        self._remember(seq)

    def _sampling(self, temp, top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty, presence_penalty,
                  mirostat_mode, mirostat_tau, mirostat_eta, grammar):
        return build_sampling(self, temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, grammar=grammar, typical_p=typical_p,
                              mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta)

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: "int | None" = None) -> int:
        """A token sampled from the logits after ``input_ids[: idx + 1]`` (default: the last evaluated row)."""
        if self.n_tokens <= 0:
            raise CompatError("sample: nothing evaluated yet (call eval first)")
        i = self.n_tokens - 1 if idx is None else int(idx)
        if not 0 <= i < self.n_tokens:
            raise IndexError(f"sample: idx {idx} is outside the {self.n_tokens} evaluated tokens")
        sp = self._sampling(temp, top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty,
                            presence_penalty, mirostat_mode, mirostat_tau, mirostat_eta, grammar)
        req = self._submit(self.input_ids[: i + 1].tolist(), 1, sp, logits_processor)
        req.result()
        self._check(req)
        return int(req.target_sampler.last_token)

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None,
                 grammar=None) -> Iterator[int]:
        """Tokens generated after ``tokens`` (after ``input_ids[:n_tokens] + tokens`` with ``reset=False``),
        for as long as the caller asks (``llama_cpp.Llama.generate``; see the module docstring)."""
        sp = self._sampling(temp, top_k, top_p, min_p, typical_p, repeat_penalty, frequency_penalty,
                            presence_penalty, mirostat_mode, mirostat_tau, mirostat_eta, grammar)
        seq = ([] if reset else self.input_ids[: self.n_tokens].tolist()) + [int(t) for t in tokens]
        zeros = np.zeros(self.n_vocab(), dtype=np.single) if stopping_criteria is not None else None
        n_ctx = self.n_ctx()
        while len(seq) < n_ctx:
            req = self._submit(seq, n_ctx - len(seq), sp, logits_processor)
            self._live = req
            self._remember(seq)
            try:
                sent = None
                for ch in req.chunks():
                    for tok in ch.tokens:
                        if stopping_criteria is not None and stopping_criteria(self._input_ids.copy(), zeros):
                            return
                        sent = yield tok
                        if self._live is not req:
                            return  # another call took the slot while this generator waited
                        self._remember(self._input_ids.tolist() + [tok])
                        if sent is not None:
                            break
                    if sent is not None:
                        break
                if sent is None:
                    if req.finish_reason is FinishReason.ABORT or self._live is not req:
                        return  # cancelled: another call took the slot
                    self._check(req)
                    last = req.target_sampler.last_token
                    if req.stop_type != "eos" or last == GRAMMAR_END:
                        return  # the context is full, or the grammar allows nothing more
                    if stopping_criteria is not None and stopping_criteria(self._input_ids.copy(), zeros):
                        return
                    sent = yield int(last)  # the end-of-generation token, as llama-cpp-python yields it
                    if self._live is not req:
                        return
                    self._remember(self._input_ids.tolist() + [int(last)])
                seq = self._input_ids.tolist() + [int(t) for t in (sent or ())]
            finally:
                if not req.done:
                    req.cancel()
                if self._live is req:
                    self._live = None
