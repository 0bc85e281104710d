"""Context shift (llama-server's ``--context-shift``): a generating slot whose context is full keeps going by
discarding old tokens instead of stopping with ``length``.

Before a round, every generating slot with ``n_past + 1 >= n_ctx_seq`` (no room to decode its sampled token)
is shifted as llama-server does it: the first ``n_keep`` tokens stay (the request's ``n_keep``, default 0, -1 for
the whole prompt, plus the BOS token when the model adds one; at most ``n_ctx_seq - 4``), the next ``n_discard``
(the request's, default 0: half of the rest) are removed from the target and draft memories, the tokens after them move down by ``n_discard``
positions, the slot's token list follows, and the request is marked ``truncated``. The drafters start over
from the shifted tokens (``chain.reset`` + ``chain.begin``): an n-gram drafter re-indexes them, draft-simple's
draft context was shifted with the target's.

It needs memories whose positions can move (a trimmable KV cache: :meth:`~llamaspec.memory.Rollback.can_shift`)
and drafters without per-position state of their own (draft-simple and the n-gram drafters);
:func:`unsupported` says why not otherwise.

>>> keep_discard(255, 256, add_bos=False)
(0, 127)
>>> keep_discard(255, 256, add_bos=True)
(1, 127)
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .slot import Slot, SlotState

if TYPE_CHECKING:  # pragma: no cover
    from typing import Callable

    from .chain import Chain
    from .emit import Emitter
    from .memory import DraftRollback, TargetRollback

__all__ = ["ContextShift", "keep_discard", "unsupported"]

log = logging.getLogger("llamaspec")

#: drafters that follow a shifted sequence (no per-position state beyond the draft context's KV)
SHIFTABLE_DRAFTERS = ("draft-simple", "ngram-cache", "ngram-lookup", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
                      "ngram-simple")


def keep_discard(n_past: int, n_ctx_seq: int, *, add_bos: bool, n_keep: int = 0, n_discard: int = 0,
                 n_prompt: int = 0) -> tuple[int, int]:
    """llama-server's ``(n_keep, n_discard)`` for a sequence of ``n_past`` tokens in ``n_ctx_seq``: the
    request's ``n_keep`` (-1: the ``n_prompt`` prompt tokens) plus the BOS token, at most ``n_ctx_seq - 4``;
    its ``n_discard`` (0: half of the rest), at most all but one of the rest.

    >>> keep_discard(255, 256, add_bos=False, n_keep=10, n_discard=20)
    (10, 20)
    >>> keep_discard(255, 256, add_bos=True, n_keep=-1, n_prompt=200, n_discard=100)
    (201, 53)
    """
    keep = min(n_ctx_seq - 4, (n_prompt if n_keep < 0 else n_keep) + (1 if add_bos else 0))
    n_left = n_past - keep
    return keep, max(0, min(max(0, n_discard) or n_left // 2, n_left - 1))


def unsupported(rollback_tgt: "TargetRollback", rollback_dft: "DraftRollback", chain: "Chain | None") -> str | None:
    """Why this engine cannot shift its context (None: it can)."""
    if not rollback_tgt.can_shift():
        return "the target model's memory cannot move positions (a recurrent or hybrid model)"
    if not rollback_dft.can_shift():
        return "the draft model's memory cannot move positions (a recurrent or hybrid draft model)"
    bad = [t for t in (chain.types if chain is not None else []) if t not in SHIFTABLE_DRAFTERS]
    if bad:
        return f"the {bad[0]} drafter keeps per-position state that a shift would break"
    return None


class ContextShift:
    """Shifts the full slots before a round (module docstring); off until :meth:`enable` (the Round owns one:
    ``emitter`` is its emitter, which stops ending requests on a full context once the shift is on)."""

    def __init__(self, rollback_tgt: "TargetRollback", rollback_dft: "DraftRollback", chain: "Chain | None",
                 emitter: "Emitter", add_bos: bool):
        self.rollback_tgt, self.rollback_dft, self.chain, self.emitter = rollback_tgt, rollback_dft, chain, emitter
        self.n_ctx_seq, self.add_bos = emitter.n_ctx_seq, add_bos
        self.enabled = False
        #: context shifts done (all slots)
        self.n_shifts = 0

    def enable(self, on: bool = True) -> bool:
        """Turn the shift on (where the engine can: else a warning saying why); returns whether it is on."""
        why = unsupported(self.rollback_tgt, self.rollback_dft, self.chain) if on else None
        if why is not None:
            log.warning("context shift is not available: %s; a request that fills its context stops with "
                        "finish_reason \"length\"", why)
        self.enabled = self.emitter.ctx_shift = on and why is None
        return self.enabled

    def run(self, gen: list[Slot], fail: "Callable[[Slot, BaseException], None]") -> list[Slot]:
        """Shift every slot of ``gen`` that is due (one whose memory refuses goes to ``fail``); the slots of
        ``gen`` still generating."""
        if not self.enabled:
            return gen
        for s in gen:
            if self.due(s):
                try:
                    self.shift(s)
                except Exception as e:  # noqa: BLE001 - this slot fails, the others go on
                    fail(s, e)
        return [s for s in gen if s.state is SlotState.GENERATING]

    def due(self, s: Slot) -> bool:
        """``s`` has no room to decode its sampled token (and is not in the middle of a replay)."""
        return (self.enabled and s.state is SlotState.GENERATING and s.sampled is not None and not s.spec_draft
                and s.n_past + 1 >= self.n_ctx_seq)

    def shift(self, s: Slot) -> None:
        """Shift ``s`` (due); raises when a memory refuses (the caller fails the slot)."""
        n_past = s.n_past
        n_keep, n_discard = keep_discard(n_past, self.n_ctx_seq, add_bos=self.add_bos, n_keep=s.options.shift.n_keep,
                                         n_discard=s.options.shift.n_discard, n_prompt=s.n_prompt)
        log.info("slot %d: context shift, n_keep = %d, n_left = %d, n_discard = %d", s.id, n_keep, n_past - n_keep,
                 n_discard)
        self.rollback_tgt.shift(s.seq_id, n_keep, n_discard, n_past)
        self.rollback_dft.shift(s.seq_id, n_keep, n_discard, n_past)
        del s.tokens[n_keep:n_keep + n_discard]
        s.truncated = True
        self.n_shifts += 1
        if self.chain is not None:
            self.chain.reset(s.seq_id)
            self.chain.begin(s.seq_id, s.tokens)
