"""One verifier object per request: the rule of :mod:`.rules` bound to the request's target sampler.

The engine picks a verifier once, when a request is submitted (:func:`verifier_for`), and then calls only
``verify(rows, draft, p_dft)`` (a new draft) or ``replay(rows, known)`` (the round after a checkpoint
restore, :func:`.rules.replay`). ``rows`` are the indices of this slot's output rows in the decoded batch
(``rows[0]`` is the row of ``id_last``). Both return the emitted tokens (1..d+1, the last one the target's).

============================  ===============================  =====================================
verifier                      ``verify``                       ``replay``
============================  ===============================  =====================================
:class:`MatchVerifier`        llama.cpp's sample-and-match     known tokens re-accepted, row d sampled
:class:`RejectionVerifier`    rejection sampling (temp > 0),   as the round it replays was verified
                              sample-and-match for drafts
                              without ``p_dft`` (n-grams)
:class:`SynthVerifier`        synthetic acceptance (§8.2)      synthetic replay (§8.2, ``is_replay``)
============================  ===============================  =====================================
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import _llama as llama
from ..synth import Mt19937Uniform, synth_accept
from .rules import rejection_verify, replay, sample_and_match, sample_from_probs

if TYPE_CHECKING:  # pragma: no cover
    from ..sampler import TargetSampler

__all__ = ["Verifier", "MatchVerifier", "RejectionVerifier", "SynthVerifier", "verifier_for"]


class Verifier:
    """Base: holds the request's target sampler, the target context and the EOG test."""

    def __init__(self, sampler: "TargetSampler", ctx: "llama.Context", is_eog: Callable[[int], bool]):
        self.sampler = sampler
        self.ctx = ctx
        self.is_eog = is_eog

    @property
    def draft_temp(self) -> float:
        """The temperature drafters should sample at for this request (0 = argmax drafts, llama.cpp's)."""
        return 0.0

    def verify(self, rows: Sequence[int], draft: Sequence[int], p_dft: Sequence[np.ndarray] | None = None) -> list[int]:
        raise NotImplementedError

    def replay(self, rows: Sequence[int], known: Sequence[int]) -> list[int]:
        raise NotImplementedError


class MatchVerifier(Verifier):
    """llama.cpp's ``common_sampler_sample_and_accept_n`` (§8.1); the default and the parity mode."""

    def verify(self, rows, draft, p_dft=None):
        sampler, ctx = self.sampler, self.ctx  # (no draft: plain decoding, the one pick)
        return sample_and_match(lambda i: sampler.sample(ctx, rows[i]), self.is_eog, draft)

    def replay(self, rows, known):
        sampler, ctx = self.sampler, self.ctx

        def advance_row(i: int, token: int) -> None:
            # the decision was made in the first pass: advance the sampler as it did, keep the known token
            sampler.sample_no_accept(ctx, rows[i])
            sampler.accept(token)

        return replay(advance_row, lambda i: sampler.sample(ctx, rows[i]), known)


class RejectionVerifier(MatchVerifier):
    """Rejection sampling (:func:`.rules.rejection_verify`) with the request's own stream ``rejection_rng``. ``p_tgt`` of
    each row comes from llama.cpp's samplers (penalties, grammar, top-k/p, min-p, temperature: exactly what
    sample-and-match draws from, :meth:`TargetSampler.probs`), computed lazily, row by row, after the
    previous token was accepted. A draft without ``p_dft`` (n-gram drafters, or a truncated sampled draft)
    is verified by sample-and-match, and its replay follows the rule that verified the round."""

    def __init__(self, sampler, ctx, is_eog, sampling: "llama.SamplingParams"):
        super().__init__(sampler, ctx, is_eog)
        self.sampling = sampling
        seed = None if sampling.seed == llama.DEFAULT_SEED else sampling.seed
        self.rejection_rng = np.random.Generator(np.random.MT19937(seed))
        self._last_rule = "match"

    @property
    def draft_temp(self) -> float:
        return self.sampling.temp

    def verify(self, rows, draft, p_dft=None):
        if not draft or p_dft is None or len(p_dft) != len(draft):
            self._last_rule = "match"
            return super().verify(rows, draft, p_dft)
        self._last_rule = "rejection"
        sampler, ctx = self.sampler, self.ctx
        res = rejection_verify(lambda i: sampler.probs(ctx, rows[i]), draft, p_dft, self.rejection_rng.random,
                               accept=sampler.accept, is_eog=self.is_eog)
        return list(res.tokens)

    def replay(self, rows, known):
        if self._last_rule == "match":
            return super().replay(rows, known)
        sampler, ctx = self.sampler, self.ctx

        def sample_row(i: int) -> int:
            ids, p = sampler.probs(ctx, rows[i])
            tok = int(ids[sample_from_probs(p, self.rejection_rng.random())])
            sampler.accept(tok)
            return tok

        # the uniforms of the first pass are not rewound: only the known tokens are accepted again
        return replay(lambda i, token: sampler.accept(token), sample_row, known)


class SynthVerifier(Verifier):
    """Synthetic acceptance (§8.2, benchmarks only): drafts are kept with the configured conditional
    probabilities, drawn from the request's mt19937 stream ``synth_rng`` (seeded like the sampler)."""

    def __init__(self, sampler, ctx, is_eog, cond: Sequence[float], seed: int):
        super().__init__(sampler, ctx, is_eog)
        self.cond = list(cond)
        self.synth_rng = Mt19937Uniform(seed)

    def _run(self, rows, draft, is_replay: bool) -> list[int]:
        sampler, ctx = self.sampler, self.ctx
        # synthetic tokens are accepted with generated=False: the grammar does not see them (§8.2)
        return synth_accept(lambda i: sampler.sample_no_accept(ctx, rows[i]), self.is_eog, sampler.accept, draft,
                            self.cond, self.synth_rng, is_replay)

    def verify(self, rows, draft, p_dft=None):
        if not draft:
            return [self.sampler.sample(self.ctx, rows[0])]
        return self._run(rows, draft, False)

    def replay(self, rows, known):
        return self._run(rows, known, True)


def verifier_for(mode: str, sampler: "TargetSampler", sampling: "llama.SamplingParams", ctx: "llama.Context",
                 is_eog: Callable[[int], bool], synth_cond: Sequence[float] | None) -> Verifier:
    """The verifier of one request (``sampler``: its target sampler, ``sampling``: its settings). ``mode`` is
    the engine's (``match`` / ``rejection``); synthetic acceptance wins when configured; greedy requests
    verify by sample-and-match (rejection sampling of a point mass is the same rule), and so do chains whose
    pick is not ``dist`` over a readable distribution (mirostat, XTC, adaptive-p: sample-and-match is exact
    for any chain)."""
    if synth_cond is not None:
        return SynthVerifier(sampler, ctx, is_eog, synth_cond, sampling.seed)
    if mode == "rejection" and not sampling.greedy and not llama.picks_in_chain(sampling):
        return RejectionVerifier(sampler, ctx, is_eog, sampling)
    return MatchVerifier(sampler, ctx, is_eog)
