"""The target sampler with llama.cpp's ``common_sampler`` semantics (§8.1).

llama.cpp keeps the grammar **apart** from the sampler chain: it samples with the chain alone, checks the one
token it picked against the grammar, and only when the grammar rejects it samples again with the grammar
applied first. Tokens are accepted with ``generated=True`` (chain and grammar) or ``False`` (chain only:
prompt tokens, synthetic drafts). :class:`TargetSampler` does the same on top of the boundary's samplers:

- ``sample(ctx, row)`` picks and accepts (``common_sampler_sample`` + ``accept(generated=True)``);
- ``sample_no_accept(ctx, row)`` picks only (the chain's random stream advances as in ``sample``);
- ``accept(token, generated)``; ``accept_prompt(tokens)`` (chain only, as llama-server does before the first
  sample: penalties see the prompt);
- ``probs(ctx, row)``: the distribution ``sample`` draws from, as sparse ``(ids, p)``, computed by llama.cpp's
  own samplers on a clone (penalties, grammar, top-k/p, min-p, temperature all included). With a grammar it
  is the exact mixture of llama.cpp's two paths: ``p(x) = [x allowed] p_chain(x) + P(rejected) p_grammar(x)``.
- ``clone()`` / ``copy_from()`` for checkpoints (chain, grammar and the random state).

``logits_processor`` (llama-cpp-python's ``LogitsProcessorList`` or any ``f(input_ids, logits) -> logits``): called
on a copy of each row's logits before anything else, with the tokens the sampler has seen (the prompt, then
every accepted token) as ``input_ids``, as llama-cpp-python's custom sampler does. Rows are sampled in order
and each accepted token joins the history before the next row, so in a verification each drafted row sees
exactly the history plain decoding would have had. (A recurrent target that goes back to a checkpoint replays
the accepted rows of that round: the processor sees those rows a second time, with the same history.)

``penalize_prompt=False``: the prompt does not enter the penalties' history (llama-cpp-python's ``Llama``
penalizes generated tokens only; llama-server, the default, the prompt too). Both options reach the sampler
through a request's ``RequestOptions(hooks=SamplerHooks(...))`` (llamaspec.options).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from . import _llama as llama

__all__ = ["GRAMMAR_END", "TargetSampler"]

#: what the sampler picks when the grammar allows no token at all: it is complete and no end-of-generation
#: token may follow (the vocabulary has none, ``ignore_eos``, a ``-inf`` bias), or the logit bias forbids every
#: token it allows. Generation ends there as at an end-of-generation token (llamaspec.emit); it is never
#: accepted (llama.cpp's grammar aborts the process: "Unexpected empty grammar stack after accepting piece").
GRAMMAR_END = -1


class TargetSampler:
    """One request's target sampler (see the module docstring)."""

    def __init__(self, vocab: "llama.Vocab", params: "llama.SamplingParams", *,
                 _parts: "tuple[llama.Sampler, llama.Sampler | None] | None" = None,
                 logits_processor: "Callable[[np.ndarray, np.ndarray], np.ndarray] | None" = None,
                 penalize_prompt: bool = True):
        self.params = params
        self.penalize_prompt = penalize_prompt
        self.logits_processor = logits_processor
        #: the tokens the sampler has seen (only kept for a logits processor), and the last one it accepted
        self.history: list[int] = []
        self.last_token = GRAMMAR_END
        self.vocab = vocab
        if _parts is not None:
            self.chain, self.grammar = _parts
        else:
            params.validate()
            self.grammar = llama.Sampler.grammar_only(vocab, params) if params.grammar else None
            try:
                self.chain = llama.Sampler.from_params(vocab, params, grammar=False)
            except BaseException:
                if self.grammar is not None:
                    self.grammar.close()
                raise
        self._cand_buf: "llama.Candidates | None" = None
        self._has_history = bool(params.repeat_penalty != 1.0 or params.frequency_penalty or params.presence_penalty
                                 or params.dry_multiplier)

    @property
    def _cand(self) -> "llama.Candidates":
        """The candidates array over the vocabulary, made on first use: plain sampling never needs it (for a
        262k-token vocabulary it is 3 MB, per request)."""
        if self._cand_buf is None:
            self._cand_buf = llama.Candidates(self.vocab.n_tokens)
        return self._cand_buf

    # -- sampling -----------------------------------------------------------------------------------
    def sample_no_accept(self, ctx: "llama.Context", idx: int) -> int:
        """``common_sampler_sample`` (grammar_first = false): chain, check the pick, resample with the grammar."""
        logits = self._row(ctx, idx)
        cand = self._cand
        cand.fill(logits)
        tok = cand.apply(self.chain)
        if self.grammar is None or self.grammar.allows(tok):
            return tok
        cand.fill(logits)
        cand.apply(self.grammar)
        tok = cand.apply(self.chain)
        return tok if tok >= 0 and self.grammar.allows(tok) else GRAMMAR_END  # nothing allowed: the end

    def sample(self, ctx: "llama.Context", idx: int) -> int:
        """Pick from row ``idx`` and accept the pick (as generated)."""
        if self.grammar is None and self.logits_processor is None:
            self.last_token = tok = self.chain.sample(ctx, idx)  # one native call: chain apply + accept
            return tok
        tok = self.sample_no_accept(ctx, idx)
        self.accept(tok, True)
        return tok

    def accept(self, token: int, generated: bool = True) -> None:
        """``common_sampler_accept``: the grammar only sees generated tokens; the chain sees every token
        (:data:`GRAMMAR_END` is no token: nothing sees it)."""
        self.last_token = token
        if token == GRAMMAR_END:
            return
        if self.logits_processor is not None:
            self.history.append(int(token))
        if generated and self.grammar is not None:
            self.grammar.accept(token)
        self.chain.accept(token)

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """llama-server's ``init_sampler``: prompt tokens go into the chain (penalty history), not the grammar.
        Without penalties or DRY the chain keeps no history and nothing needs doing."""
        if self.logits_processor is not None:
            self.history.extend(int(t) for t in tokens)
        if self._has_history and self.penalize_prompt:
            for t in tokens:
                self.chain.accept(int(t))

    # -- the distribution -------------------------------------------------------------------------
    def probs(self, ctx: "llama.Context", idx: int) -> tuple[np.ndarray, np.ndarray]:
        """The distribution :meth:`sample` draws from at row ``idx``, as ``(ids, p)`` (ids ascending, only
        ids with p > 0). Nothing is drawn: the samplers run on a clone. ``temp <= 0`` gives a point mass, and so
        does a row with no distribution (non-finite logits): the chain's own pick."""
        logits = self._row(ctx, idx)
        cand = self._cand
        cand.fill(logits)
        ids_c, p_c = self._chain_dist(cand)
        if self.grammar is None:
            return _by_id(ids_c, p_c)
        allowed = self.grammar.allowed(ids_c)
        p_rejected = float(p_c[~allowed].sum())
        ids, p = ids_c[allowed], p_c[allowed]
        if p_rejected > 0.0:
            cand.fill(logits)
            cand.apply(self.grammar)
            ids_g, p_g = self._chain_dist(cand)
            ok = (ids_g >= 0) & np.isfinite(p_g) & (p_g > 0)
            if ok.any():
                ok[ok] = self.grammar.allowed(ids_g[ok])
            if not ok.any():  # the grammar allows nothing here: its share ends the generation
                ids_g, p_g = np.array([GRAMMAR_END], dtype=np.int64), np.array([1.0])
            elif not ok.all():
                ids_g, p_g = ids_g[ok], p_g[ok] / p_g[ok].sum()
            ids = np.concatenate([ids, ids_g])
            p = np.concatenate([p, p_rejected * p_g])
        return _by_id(ids, p)

    def _row(self, ctx: "llama.Context", idx: int) -> np.ndarray:
        """Row ``idx``'s logits, through the logits processor when there is one."""
        logits = ctx.logits(idx)
        if self.logits_processor is None:
            return logits
        out = self.logits_processor(np.asarray(self.history, dtype=np.intc), np.array(logits, dtype=np.single))
        return np.asarray(out, dtype=np.single)

    def _chain_dist(self, cand: "llama.Candidates") -> tuple[np.ndarray, np.ndarray]:
        if self.params.greedy:
            tok = cand.apply_clone(self.chain)
            return np.array([tok], dtype=np.int64), np.array([1.0])
        tok = cand.apply_clone(self.chain)
        ids, p = cand.kept()
        total = p.sum()
        if tok >= 0 and not (np.isfinite(total) and total > 0.0):
            # no distribution (non-finite logits: an extreme penalty or bias): the chain's own pick, as sample's
            return np.array([tok], dtype=np.int64), np.array([1.0])
        return ids, p

    # -- state --------------------------------------------------------------------------------------
    def clone(self) -> "TargetSampler":
        chain = self.chain.clone()
        grammar = self.grammar.clone() if self.grammar is not None else None
        out = TargetSampler(self.vocab, self.params, _parts=(chain, grammar), logits_processor=self.logits_processor,
                            penalize_prompt=self.penalize_prompt)
        out.history = list(self.history)
        return out

    def copy_from(self, other: "TargetSampler") -> None:
        self.history = list(other.history)
        self.chain.copy_from(other.chain)
        if self.grammar is not None and other.grammar is not None:
            self.grammar.copy_from(other.grammar)

    def close(self) -> None:
        for s in (getattr(self, "chain", None), getattr(self, "grammar", None)):
            if s is not None:
                s.close()
        self.chain = self.grammar = None


def _by_id(ids: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge duplicate ids (summing), drop zeros, sort ascending."""
    ids = np.asarray(ids, dtype=np.int64)
    p = np.asarray(p, dtype=np.float64)
    keep = p > 0.0
    ids, p = ids[keep], p[keep]
    uniq, inv = np.unique(ids, return_inverse=True)
    if uniq.size == ids.size:
        order = np.argsort(ids, kind="stable")
        return ids[order], p[order]
    out = np.zeros(uniq.size, dtype=np.float64)
    np.add.at(out, inv, p)
    return uniq, out
