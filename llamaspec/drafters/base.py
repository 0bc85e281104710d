"""The drafter protocol (§1.2–§1.3) shared by every implementation in the chain."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from ..stats import DrafterStats

if TYPE_CHECKING:  # pragma: no cover
    from .._llama import Row


@dataclass
class DraftParams:
    """Per-sequence draft request, owned by the chain (one per seq; §1.2).

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
    probs: "list[np.ndarray | tuple[np.ndarray, np.ndarray]] | None" = None
    #: per-request overrides of the drafter's own ``n_min`` / ``p_min`` (None = the drafter's setting)
    n_min: int | None = None
    p_min: float | None = None
    #: tokens the request may still generate (``n_predict`` less what it generated; -1: not bounded)
    n_left: int = -1

    def n_min_or(self, default: int) -> int:
        """The request's ``n_min``, else the drafter's ``default``."""
        return default if self.n_min is None else self.n_min

    def p_min_or(self, default: float) -> float:
        """The request's ``p_min``, else the drafter's ``default``."""
        return default if self.p_min is None else self.p_min


class Drafter:
    """The whole protocol the chain and the engine use; everything but ``draft`` has a no-op default.

    llama.cpp's four calls (§1.3): ``begin`` once per request, ``process`` after every target decode,
    ``draft`` for every sequence with ``drafting`` set, ``accept`` after verification. Beyond llama.cpp:

    - ``configure_sampling(seq_id, temp, seed)``: at submit, the temperature drafts of ``seq_id`` should be
      sampled at (> 0 only for rejection-sampling verification; 0 = llama.cpp's argmax drafts). Drafters
      that sample fill ``DraftParams.probs``; the default ignores it (n-gram drafts are deterministic).
    - ``reuse_kv``: True when the drafter keeps what it decoded while drafting in the draft context and
      skips those rows in ``process`` (the engine then does not trim the draft context after drafting).
      The engine sets it to False where the draft memory cannot be trimmed.
    - ``reset(seq_id)``: forget per-sequence caches after an error in the round (the engine has rolled
      memory back to the committed tokens) or when a request is cancelled.
    - ``get_state / set_state``: per-sequence state saved with prompt checkpoints (§7.6).

    Subclasses set ``type`` (llama.cpp's type name, e.g. ``"ngram-mod"``) and ``n_max`` (the effective
    maximum draft length after implementation-specific clamping). The chain owns ``stats`` updates and
    timing; implementations only do their work.
    """

    type: str = "none"
    reuse_kv: bool = False
    #: ms of one drafting step in the last ``draft()``, without the catching up before it (draft models set it;
    #: None: not measured, the caller times the whole call): what the auto gate prices a drafted token at
    last_step_ms: "float | None" = None
    #: time the last draft() spent catching its context up on committed tokens (not drafting: the cost model
    #: leaves it out of a draft's price)
    catch_up_ms: float = 0.0
    #: rows the last draft() caught its context up on (with ``catch_up_ms``: what a row of catching up costs)
    catch_up_rows: int = 0
    #: the drafter's prompt rows cost about this many times the target's (draft models: their parameters over
    #: the target's, a prompt row being compute-bound)
    prompt_cost_ratio: float = 1.0

    def __init__(self, n_seq: int):
        self.n_seq = n_seq
        self.n_max = 0
        self.stats = DrafterStats()

    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        """Once per new generation, after the prompt was processed (``prompt`` = tokens in the target)."""

    def set_owner(self, seq_id: int, owner: str) -> None:
        """The tenant of ``seq_id``'s next request (before ``begin``): drafters that share what they saw across
        requests (ngram-lookup's pool) draft only from the same owner's text unless told to share."""

    def process(self, rows: "Sequence[Row]") -> bool:
        """Called after every successful target decode with the same rows. False = fatal."""
        return True

    def draft(self, params: Sequence[DraftParams]) -> None:
        """Fill ``params[seq].result`` for every seq with ``drafting`` true (``params`` indexed by seq id);
        by default with :meth:`draft_one` of each."""
        for seq_id, dp in enumerate(params):
            if dp.drafting:
                dp.result.extend(self.draft_one(seq_id, dp.prompt, dp.id_last))

    def draft_one(self, seq_id: int, prompt: Sequence[int], id_last: int) -> list[int]:
        """The draft of one sequence (what the default :meth:`draft` asks of a drafter that drafts them one by
        one): the tokens after ``prompt + [id_last]``."""
        raise NotImplementedError

    def pending(self, seq_id: int, pos0: int) -> int:
        """Committed tokens (of the ``pos0`` before ``id_last``) that the drafter's context must decode before it
        can draft for ``seq_id``: rounds it did not draft in, or a new prompt (draft models with ``reuse_kv``);
        0 by default."""
        return 0

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        """Feedback after verification; ``is_other`` = another implementation produced the draft."""

    def configure_sampling(self, seq_id: int, temp: float, seed: int) -> None:
        """Draft temperature for ``seq_id`` (see the class docstring); default: argmax drafts only."""

    def reset(self, seq_id: int) -> None:
        """Drop per-sequence caches that may no longer match memory (after an error or a cancel)."""

    def redecode(self, seq_id: int, tokens: Sequence[int], pos0: int) -> bool:
        """A FULL draft memory was reloaded from its checkpoint: decode the committed ``tokens`` (target ids)
        at positions ``pos0..`` into the drafter's own context again. True when this drafter owns the draft
        context and did it (it maps the ids, e.g. for a trimmed vocabulary); default: not its context."""
        return False

    def get_state(self, seq_id: int) -> bytes | None:
        return None

    def set_state(self, seq_id: int, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def seq_spans(rows: "Sequence[Row]") -> dict[int, list[int]]:
    """``{seq_id: [first row index, last row index]}`` of a target batch (the heads' ``process`` reads the
    target's features per sequence; a sequence's rows are contiguous in llamaspec's batches).

    >>> from collections import namedtuple
    >>> R = namedtuple("R", "seq_id")
    >>> seq_spans([R(1), R(1), R(0), R(0), R(0)])
    {1: [0, 1], 0: [2, 4]}
    """
    spans: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        sp = spans.get(r.seq_id)
        if sp is None:
            spans[r.seq_id] = [i, i]
        else:
            sp[1] = i
    return spans


# -- shared by the model drafters (draft-simple, MTP, EAGLE-3, DFlash) ----------------------------------------

def suppress_array(tokens: Iterable[int]) -> np.ndarray | None:
    """The token ids a drafter must never propose (the vocabulary's suppress list, llama.cpp's -inf logit
    bias, plus any the drafter adds), sorted and unique, as the ``suppress`` argument of
    :func:`~llamaspec.drafters.draft_model.top_candidate`; None when there are none.

    >>> suppress_array([7, 3, 7]), suppress_array([])
    (array([3, 7]), None)
    """
    ids = sorted({int(t) for t in tokens})
    return np.array(ids, dtype=np.int64) if ids else None


def drop_short(dp: DraftParams, n_min: int) -> None:
    """``n_min`` (llama.cpp's ``draft.n_min``): a draft shorter than ``n_min`` tokens is no draft (its
    ``probs`` go with it). ``n_min <= 0``: every draft is kept.

    >>> dp = DraftParams(result=[4, 5], probs=[None, None])
    >>> drop_short(dp, 2); dp.result
    [4, 5]
    >>> drop_short(dp, 3); dp.result, dp.probs
    ([], [])
    """
    if n_min > 0 and len(dp.result) < n_min:
        dp.result.clear()
        if dp.probs is not None:
            dp.probs.clear()
