"""The drafter protocol (spec §1.2–§1.3) shared by every implementation in the chain."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..stats import DrafterStats

if TYPE_CHECKING:  # pragma: no cover
    from .._llama import Row


@dataclass
class DraftParams:
    """Per-sequence draft request, owned by the chain (one per seq; spec §1.2).

    ``prompt`` is the token history already in the target memory (it excludes ``id_last``, the last
    token sampled by the target and not yet decoded, which sits at position ``pos0``). ``result`` must be
    empty on entry when ``drafting`` is true. ``probs`` is filled (one row per drafted token) only by
    drafters that sample, for rejection-sampling verification; n-gram drafters leave it ``None``.
    """

    drafting: bool = False
    n_max: int = -1
    pos0: int = 0
    id_last: int = -1
    prompt: Sequence[int] = field(default_factory=list)
    result: list[int] = field(default_factory=list)
    probs: list[np.ndarray] | None = None


class Drafter:
    """Base class: ``begin / process / draft / accept`` with no-op defaults.

    Subclasses set ``type`` (llama.cpp's type name, e.g. ``"ngram-mod"``) and ``n_max`` (the effective
    maximum draft length after implementation-specific clamping). The chain owns ``stats`` updates and
    timing; implementations only do their work.
    """

    type: str = "none"

    def __init__(self, n_seq: int):
        self.n_seq = n_seq
        self.n_max = 0
        self.stats = DrafterStats()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        """Once per new generation, after the prompt was processed (``prompt`` = tokens in the target)."""

    def process(self, rows: "Sequence[Row]") -> bool:
        """Called after every successful target decode with the same rows. False = fatal."""
        return True

    def draft(self, params: Sequence[DraftParams]) -> None:
        """Fill ``params[seq].result`` for every seq with ``drafting`` true (``params`` indexed by seq id)."""
        raise NotImplementedError

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """Feedback after verification; ``is_other`` = another implementation produced the draft."""

    def get_state(self, seq_id: int) -> bytes | None:
        return None

    def set_state(self, seq_id: int, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass
