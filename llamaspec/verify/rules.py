"""The verification rules: pure functions (numpy only, no llama.cpp).

Three verifiers, each reached through small callbacks so it can be tested without a model:

- :func:`sample_and_match` — llama.cpp's own rule (§8.1), the parity mode and the default.
- :func:`rejection_verify` — stochastic speculative sampling for temperature > 0 (beyond llama.cpp):
  accept draft token ``x`` with probability ``min(1, p_tgt(x) / p_dft(x))``, else emit a *recovered* token
  drawn from ``norm(max(0, p_tgt - p_dft))``; a *bonus* token from ``p_tgt`` of row ``d`` when every
  draft token is accepted. Emitted tokens are distributed exactly as the target's own samples.
- :func:`replay` — the round after a checkpoint restore (beyond llama.cpp): known tokens are
  re-accepted, only the last row is sampled.

Rows: a verification round decodes ``[id_last] + draft`` (``d + 1`` rows, all with outputs). Row 0 is the
row of ``id_last`` and predicts the position of ``draft[0]``; row ``i`` predicts the position of
``draft[i]``; row ``d`` predicts the token after the last draft.

Names: ``p_tgt`` is the target's distribution at a row, ``p_dft`` the draft's distribution that a draft
token was sampled from. Outcomes: *accepted* (a draft token kept), *recovered* (the token drawn instead
of a rejected draft token), *bonus* (the extra token after a fully accepted draft).

``p_tgt`` comes from llama.cpp's own samplers (:meth:`llamaspec.sampler.TargetSampler.probs`, grammar and
penalties included), ``p_dft`` from the drafter that sampled the draft; :mod:`llamaspec.verify.verifiers`
binds these rules to a request's sampler and rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np

__all__ = ["VerifyResult", "sample_and_match", "replay", "rejection_verify", "sample_from_probs", "sparse_dist"]


# --------------------------------------------------------------------------------------------------
# sample-and-match and replay
# --------------------------------------------------------------------------------------------------


def sample_and_match(sample_row: Callable[[int], int], is_eog: Callable[[int], bool], draft: Sequence[int]) -> list[int]:
    """llama.cpp's verification (``common_sampler_sample_and_accept_n``, §8.1).

    Callback contract:

    - ``sample_row(i)``: sample output row ``i`` of this round with the target sampler **and accept**
      the pick into it (as generated: grammar, penalties, history, random stream), return the pick.
      Called for rows ``0, 1, ...`` in order, each at most once.
    - ``is_eog(token)``: whether ``token`` ends generation.

    For ``i`` in ``0..d-1``: ``t = sample_row(i)``, emit ``t``; stop if ``t != draft[i]`` or if ``t`` is EOG
    and not the last draft position. When all ``d`` matched, also emit ``sample_row(d)`` (the bonus). The
    result has 1..d+1 tokens and its last one is always the target's own pick; ``len(result) - 1`` draft
    tokens were accepted.

    >>> picks = [5, 6, 9, 4]
    >>> sample_and_match(lambda i: picks[i], lambda t: False, [5, 6, 7])    # mismatch at position 2
    [5, 6, 9]
    >>> sample_and_match(lambda i: [5, 6, 7, 4][i], lambda t: False, [5, 6, 7])   # all + bonus
    [5, 6, 7, 4]
    >>> sample_and_match(lambda i: [5, 2, 7][i], lambda t: t == 2, [5, 2, 7])     # EOG before the end
    [5, 2]
    >>> sample_and_match(lambda i: 3, lambda t: False, [])                      # no draft: one token
    [3]
    """
    d = len(draft)
    out: list[int] = []
    for i in range(d):
        t = int(sample_row(i))
        out.append(t)
        if t != int(draft[i]) or (i + 1 < d and is_eog(t)):
            return out
    out.append(int(sample_row(d)))
    return out


def replay(advance_row: Callable[[int, int], object], sample_row: Callable[[int], int], known: Sequence[int]) -> list[int]:
    """The verification of a replay round (beyond llama.cpp; the restore is §7.5 step 4).

    After a partial acceptance forced a checkpoint restore, the next round decodes
    ``[id_last] + known`` again, where ``known`` is what the first pass emitted (the accepted draft
    tokens followed by the target's own token). The decisions were already made: this keeps ``known``
    and samples only the row after it. Returns ``known + [new token]``, so nothing is rolled back.

    Callback contract (the target sampler must have been restored to its state before the first pass):

    - ``advance_row(i, token)``: bring the target sampler to the state the first pass left it in after
      row ``i``: run the sampler over row ``i`` exactly as the first pass did, so its random stream
      advances by the same draws, **discard** the pick, then accept ``token`` into the sampler as
      generated (grammar, penalties, history). With llama.cpp that is ``llama_sampler_apply`` on the row's
      candidates followed by ``llama_sampler_accept(token)``; not ``llama_sampler_sample``, which would
      accept its own pick. For rows verified by :func:`rejection_verify` the first pass drew one uniform
      per examined row plus one for the recovered token; re-draw those (or do not rewind that stream).
      The return value is ignored.
    - ``sample_row(i)``: as in :func:`sample_and_match`: sample row ``i`` for real and accept the pick.

    Replay rounds are not new drafts: the engine must not count them as drafted/accepted again
    (§7.5 step 6 subtracts the target's token from the accepted count).

    >>> log = []
    >>> replay(lambda i, t: log.append((i, t)), lambda i: 40 + i, [11, 12, 13])
    [11, 12, 13, 43]
    >>> log
    [(0, 11), (1, 12), (2, 13)]
    """
    out: list[int] = []
    for i, token in enumerate(known):
        token = int(token)
        advance_row(i, token)
        out.append(token)
    out.append(int(sample_row(len(known))))
    return out


# --------------------------------------------------------------------------------------------------
# rejection sampling
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one round of :func:`rejection_verify`.

    ``tokens``: the emitted tokens: ``n_accepted`` accepted draft tokens, then one recovered token
    (``recovered``) or one bonus token (``bonus``), or nothing more when the round stopped at an accepted
    EOG draft token before the last position (both flags False).
    """

    tokens: list[int]
    n_accepted: int
    recovered: bool
    bonus: bool


def sample_from_probs(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw by token id: the first id whose cumulative weight exceeds ``u * total``.

    ``probs`` need not be normalised; ids with weight 0 are never drawn. One uniform ``u`` in [0, 1)
    per draw, so a fixed uniform stream gives a fixed token.

    >>> p = np.array([0.0, 0.5, 0.0, 0.25, 0.25])
    >>> [sample_from_probs(p, u) for u in (0.0, 0.49, 0.5, 0.74, 0.75, 0.999)]
    [1, 1, 3, 3, 4, 4]
    """
    w = np.asarray(probs, dtype=np.float64)
    cum = np.cumsum(w)
    total = cum[-1] if cum.size else 0.0
    if not total > 0.0 or not np.isfinite(total):
        raise ValueError("sample_from_probs: the weights sum to zero (or are not finite)")
    i = int(np.searchsorted(cum, u * total, side="right"))
    if i >= w.size or w[i] <= 0.0:  # u * total rounded up to the total: take the last id with weight
        i = int(np.flatnonzero(w > 0.0)[-1])
    return i


#: a distribution over token ids: a dense vector (index = id), or sparse ``(ids, probs)`` listing only the ids
#: with mass (any order; the target's samplers keep a few dozen candidates of a vocabulary of 10^5)
Dist = Union[np.ndarray, "tuple[np.ndarray, np.ndarray]"]
RowSource = Union[np.ndarray, Sequence[Dist], Callable[[int], Dist]]


def sparse_dist(dist: Dist) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, weights)`` of the ids with positive weight, ids ascending (so draws by token id match the
    dense form). Weights are not normalised.

    >>> sparse_dist(np.array([0.0, 0.5, 0.0, 0.5]))
    (array([1, 3]), array([0.5, 0.5]))
    >>> sparse_dist((np.array([7, 2]), np.array([0.25, 0.75])))
    (array([2, 7]), array([0.75, 0.25]))
    """
    if isinstance(dist, tuple):
        ids = np.asarray(dist[0], dtype=np.int64).reshape(-1)
        w = np.asarray(dist[1], dtype=np.float64).reshape(-1)
        if ids.shape != w.shape:
            raise ValueError(f"a sparse distribution has {ids.size} ids and {w.size} probabilities")
        order = np.argsort(ids, kind="stable")
        ids, w = ids[order], w[order]
        keep = w > 0.0
        return ids[keep], w[keep]
    v = np.asarray(dist, dtype=np.float64).reshape(-1)
    ids = np.flatnonzero(v > 0.0)
    return ids, v[ids]


def _weights_at(ids: np.ndarray, w: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The weights of ``at`` (ids) in the sparse ``(ids, w)``; 0 where absent."""
    if ids.size == 0:
        return np.zeros(at.shape, dtype=np.float64)
    j = np.minimum(np.searchsorted(ids, at), ids.size - 1)
    return np.where(ids[j] == at, w[j], 0.0)


def _target_row(raw, i: int) -> tuple[np.ndarray, np.ndarray]:
    ids, p = sparse_dist(raw)
    s = p.sum()
    if not s > 0.0 or not np.isfinite(s):
        raise ValueError(f"rejection_verify: p_tgt of row {i} has no mass")
    return ids, p / s


def rejection_verify(
    p_tgt: RowSource,
    draft: Sequence[int],
    p_dft: Sequence[np.ndarray],
    uniform: Callable[[], float],
    *,
    accept: Callable[[int], object] | None = None,
    is_eog: Callable[[int], bool] | None = None,
) -> VerifyResult:
    """Speculative (rejection) sampling of one round (beyond llama.cpp; the rule in the module docstring).

    Arguments:

    - ``p_tgt``: the target's distribution for rows ``0..d``, after its own sampler transformations, a
      grammar included (the engine asks llama.cpp's samplers, see
      :meth:`llamaspec.sampler.TargetSampler.probs`): a ``(d+1, n_vocab)`` array, a list of :data:`Dist`
      (dense vectors or sparse ``(ids, probs)``), or a callable ``row -> Dist``. Rows are read in order and
      only as far as needed.
    - ``draft``: the ``d`` drafted token ids; ``draft[i]`` must have been **sampled** from ``p_dft[i]``.
    - ``p_dft``: for each drafted position the distribution the drafter sampled from (after its top-k and
      temperature), dense or sparse. Draft and target vocabularies may differ in
      size (padded vocabularies): ids are compared, not positions.
    - ``uniform``: the target's own random stream, one uniform in [0, 1) per call (e.g. an
      :class:`~llamaspec.synth.Mt19937Uniform` seeded with the target seed). Never the draft's stream.
    - ``accept``: optional callback called with each emitted token, in order, before the next row's
      ``p_tgt`` is requested (so a callable ``p_tgt`` can depend on the grammar / penalty state).
    - ``is_eog``: optional; an accepted EOG draft token before the last position ends the round (as in
      :func:`sample_and_match`).

    Uniform draws: one per examined draft position (the acceptance test ``u * p_dft(x) < p_tgt(x)``,
    drawn even when the ratio is >= 1), plus one for the recovered or bonus token. ``p_dft`` and the
    ``p_tgt`` rows are normalised here; a draft token with ``p_dft(x) == 0`` is a contract violation.
    The residual ``max(0, p_tgt - p_dft)`` is taken by token id; if it sums to 0 (``p_tgt == p_dft``) the
    recovered token is drawn from ``p_tgt``.

    Worked example (3 tokens). The draft proposed token 0 with ``p_dft(0) = 0.8`` but ``p_tgt(0) = 0.4``:
    accepted iff ``u * 0.8 < 0.4``, i.e. ``u < 0.5``. With ``u = 0.7`` it is rejected and the residual
    ``max(0, [0.4, 0.5, 0.1] - [0.8, 0.1, 0.1]) = [0, 0.4, 0]`` recovers token 1:

    >>> p_tgt = np.array([[0.4, 0.5, 0.1], [0.2, 0.2, 0.6]])
    >>> p_dft = [np.array([0.8, 0.1, 0.1])]
    >>> us = iter([0.7, 0.3]); rejection_verify(p_tgt, [0], p_dft, lambda: next(us))
    VerifyResult(tokens=[1], n_accepted=0, recovered=True, bonus=False)

    With ``u = 0.2`` the draft token is accepted and the bonus is drawn from row 1 (``0.9`` -> token 2):

    >>> us = iter([0.2, 0.9]); rejection_verify(p_tgt, [0], p_dft, lambda: next(us))
    VerifyResult(tokens=[0, 2], n_accepted=1, recovered=False, bonus=True)

    A grammar that forbids token 1 at row 0 is part of the target's distribution there,
    ``p_tgt = [0.8, 0, 0.2]``: token 0 is then always accepted.

    >>> us = iter([0.99, 0.0]); rejection_verify([np.array([0.8, 0.0, 0.2]), p_tgt[1]], [0], p_dft, lambda: next(us))
    VerifyResult(tokens=[0, 0], n_accepted=1, recovered=False, bonus=True)
    """
    d = len(draft)
    if len(p_dft) != d:
        raise ValueError(f"rejection_verify: {len(p_dft)} p_dft vectors for a draft of {d}")
    row_of = p_tgt if callable(p_tgt) else p_tgt.__getitem__
    tokens: list[int] = []

    def emit(t: int) -> None:
        tokens.append(t)
        if accept is not None:
            accept(t)

    for i in range(d):
        raw = row_of(i)
        ids_t, p = _target_row(raw, i)
        x = int(draft[i])
        if x < 0 or (not isinstance(raw, tuple) and x >= np.asarray(raw).size):
            raise ValueError(f"rejection_verify: draft token {x} at position {i} is outside the vocabulary "
                             f"({np.asarray(raw).size})")
        ids_q, q = sparse_dist(p_dft[i])
        qs = q.sum()
        q_x = float(_weights_at(ids_q, q, np.array([x]))[0])
        if not qs > 0.0 or not np.isfinite(qs) or q_x <= 0.0:
            raise ValueError(
                f"rejection_verify: draft token {x} at position {i} has p_dft = 0; it must be sampled from p_dft"
            )
        p_x = float(_weights_at(ids_t, p, np.array([x]))[0])
        if uniform() * (q_x / qs) < p_x:
            emit(x)
            if is_eog is not None and i + 1 < d and is_eog(x):
                return VerifyResult(tokens, i + 1, False, False)
            continue
        # the residual max(0, p_tgt - p_dft) lives on the target's ids (p_tgt = 0 elsewhere)
        residual = np.maximum(p - _weights_at(ids_q, q, ids_t) / qs, 0.0)
        if not residual.sum() > 0.0:
            residual = p
        emit(int(ids_t[sample_from_probs(residual, uniform())]))
        return VerifyResult(tokens, i, True, False)

    ids_t, p = _target_row(row_of(d), d)
    emit(int(ids_t[sample_from_probs(p, uniform())]))
    return VerifyResult(tokens, d, False, True)
