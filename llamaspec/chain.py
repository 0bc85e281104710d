"""The chain of drafters (llama.cpp's ``common_speculative``, §3).

Drafters run in priority order (§3.1). ``draft()`` relays the ``drafting`` flag: the first drafter that
returns a non-empty draft for a sequence wins it for this round; lower-priority drafters are not asked for
that sequence. ``accept()`` credits the drafter that produced the sequence's last draft (``impl_last``) and
tells every other drafter with ``is_other=True``.

This module is the relay only; the drafters are built by :mod:`llamaspec.chain_registry`.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from .drafters.base import DraftParams, Drafter
from .errors import UsageError
from .stats import Timer, add_per_position

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama

log = logging.getLogger("llamaspec")


class Chain:
    def __init__(self, impls: Sequence[Drafter], n_seq: int):
        if not impls:
            raise UsageError("a speculative chain needs at least one drafter")
        self.impls = list(impls)
        self.n_seq = n_seq
        self.impl_last: list[Drafter | None] = [None] * n_seq
        self.dparams = [DraftParams() for _ in range(n_seq)]

    @property
    def n_max(self) -> int:
        return max(max(0, d.n_max) for d in self.impls)

    @property
    def types(self) -> list[str]:
        return [d.type for d in self.impls]

    #: generating slots in the round that drafts next (the draft phase sets it: a catch-up stalls all of them)
    n_gen: int = 1

    #: the ways this chain can speculate, each an arm of the referee's (llamaspec.referee); one here
    arms: tuple[str, ...] = ("spec",)

    def use_arm(self, arm: str) -> None:
        """Speculate the way ``arm`` (one of :attr:`arms`) says in the rounds that follow."""

    def drafting_impls(self) -> list[Drafter]:
        """The drafters asked for a draft, in order (all of them here; an arm may leave some out)."""
        return self.impls

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int], owner: str | None = None) -> None:
        """A new request on ``seq_id``; ``owner`` (its tenant; None: keep the last one) goes first to every
        drafter's ``set_owner``."""
        for d in self.impls:
            if owner is not None:
                d.set_owner(seq_id, owner)
            with Timer(d.stats, "t_begin_us"):
                d.begin(seq_id, prompt)
            d.stats.n_call_begin += 1

    def process(self, rows: "Sequence[llama.Row]") -> bool:
        for d in self.impls:
            if not d.process(rows):
                return False
        return True

    def draft(self, params: Sequence[DraftParams] | None = None) -> None:
        """Relay of the drafting flag (§3.2) over ``params`` (default: the chain's own, by seq id)."""
        params = self.dparams if params is None else params
        drafting = [dp for dp in params if dp.drafting]
        for dp in drafting:
            if dp.result:
                raise AssertionError("draft result must be empty when drafting starts")
        if not drafting:
            return
        self.clear_catch_up()
        for d in self.drafting_impls():
            with Timer(d.stats, "t_draft_us"):
                d.draft(params)
            d.stats.n_call_draft += 1
            still = False
            for seq_id, dp in enumerate(params):
                if not dp.drafting:
                    continue
                if dp.result:
                    dp.drafting = False
                    if dp.n_max > 0 and len(dp.result) > dp.n_max:
                        del dp.result[dp.n_max :]
                        if dp.probs is not None:
                            del dp.probs[dp.n_max :]
                    self.impl_last[seq_id] = d
                    d.stats.n_gen_drafts += 1
                    d.stats.n_gen_tokens += len(dp.result)
                else:
                    still = True
            if not still:
                break
        for dp in params:
            dp.drafting = False

    def catch_up_ms(self) -> float:
        """Time the last :meth:`draft` spent catching draft contexts up on committed tokens (no drafting)."""
        return sum(d.catch_up_ms for d in self.impls)

    def clear_catch_up(self) -> None:
        """Forget the last catch-up time (a round that does not draft caught nothing up)."""
        for d in self.impls:
            d.catch_up_ms = 0.0

    def accept(self, seq_id: int, n_accepted: int) -> None:
        impl = self.impl_last[seq_id]
        if impl is None:
            assert n_accepted == 0, "accepted tokens without a drafter"
            return
        st = impl.stats
        with Timer(st, "t_accept_us"):
            add_per_position(st.n_acc_tokens_per_pos, [1] * n_accepted)
            if n_accepted > 0:
                st.n_acc_drafts += 1
                st.n_acc_tokens += n_accepted
            impl.accept(seq_id, n_accepted, False)
            st.n_call_accept += 1
        for d in self.impls:
            if d is not impl:
                d.accept(seq_id, n_accepted, True)

    # -- the round's requests (the round never writes the per-sequence DraftParams itself) ------------
    def request_draft(self, seq_id: int, n_max: int, pos0: int, id_last: int, prompt: Sequence[int],
                      n_min: int | None = None, p_min: float | None = None, n_left: int = -1) -> None:
        """Ask for a draft of at most ``n_max`` tokens for ``seq_id`` at the next :meth:`draft`: ``prompt``
        holds the ``pos0`` committed tokens, ``id_last`` the sampled token not yet decoded; ``n_min`` /
        ``p_min`` are a request's own settings (None: the drafter's)."""
        dp = self.dparams[seq_id]
        dp.drafting, dp.n_max, dp.pos0, dp.id_last = True, n_max, pos0, id_last
        dp.prompt, dp.result, dp.probs = tuple(prompt), [], None
        dp.n_min, dp.p_min, dp.n_left = n_min, p_min, n_left

    def result(self, seq_id: int) -> "tuple[list[int], list | None]":
        """The draft the last :meth:`draft` made for ``seq_id``: its tokens and, from a drafter that sampled
        them, each token's distribution (else None)."""
        dp = self.dparams[seq_id]
        return dp.result, dp.probs

    def drafted_by(self, seq_id: int) -> str | None:
        """The type of the drafter whose draft ``seq_id`` verified last (None: no drafter's)."""
        impl = self.impl_last[seq_id]
        return impl.type if impl is not None else None

    def stop_drafting(self, seq_id: int) -> None:
        """``seq_id`` takes no part in the next :meth:`draft`."""
        self.dparams[seq_id].drafting = False

    def reset_drafters(self, seq_id: int) -> None:
        """Every drafter forgets what it cached for ``seq_id`` (a failed decode is redone); the sequence's
        draft request and ``impl_last`` stay."""
        for d in self.impls:
            d.reset(seq_id)

    def configure_sampling(self, seq_id: int, temp: float, seed: int) -> None:
        for d in self.impls:
            d.configure_sampling(seq_id, temp, seed)

    def reset(self, seq_id: int) -> None:
        """After an error or a cancel: clear the sequence's draft request and every drafter's caches."""
        dp = self.dparams[seq_id]
        dp.drafting, dp.result, dp.probs = False, [], None
        self.impl_last[seq_id] = None
        for d in self.impls:
            d.reset(seq_id)

    def redecode(self, seq_id: int, tokens: Sequence[int], pos0: int) -> bool:
        """The drafter that owns the draft context decodes ``tokens`` at ``pos0..`` again (after a FULL draft
        memory was reloaded); False when none does."""
        return any(d.redecode(seq_id, tokens, pos0) for d in self.impls)

    def get_state(self, seq_id: int) -> bytes | None:
        for d in self.impls:
            s = d.get_state(seq_id)
            if s is not None:
                return s
        return None

    def set_state(self, seq_id: int, data: bytes) -> None:
        for d in self.impls:
            d.set_state(seq_id, data)

    # -- reporting ------------------------------------------------------------------------------
    def stats_lines(self) -> list[str]:
        return [d.stats.stats_line(d.type) for d in self.impls]

    def stats_dicts(self) -> list[dict]:
        return [{"type": d.type, **d.stats.to_dict()} for d in self.impls]

    def close(self) -> None:
        for d in self.impls:
            d.close()

