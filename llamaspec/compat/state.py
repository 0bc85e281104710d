"""``llamaspec.Llama.save_state`` / ``load_state``: llama-cpp-python's ``LlamaState``, over llamaspec's slots.

llama-cpp-python's ``Llama`` has one sequence; its ``save_state()`` returns a ``LlamaState`` with the tokens in
memory (``input_ids``, ``n_tokens``), the context's state bytes (``llama_state``, ``llama_state_size``) and the
seed, and ``load_state(state)`` puts them back so that the next completion with the same prompt reuses them.
:class:`LlamaState` has the same attributes: ``input_ids`` / ``llama_state`` are those of the slot used last
(the only one with ``n_parallel=1``), and ``slots`` holds every slot's prompt cache
(:class:`~llamaspec.slot_state.SavedSlot`: tokens and the target's sequence state), which is what
``load_state`` restores, exactly. llamaspec keeps no logits: ``scores`` is empty. The draft model's memory is
not saved: after ``load_state`` the next completion that reuses a restored prompt decodes it into the draft
context first (:mod:`llamaspec.slot_state`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..slot_state import SavedSlot
from .args import CompatError

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

__all__ = ["LlamaState", "save_state", "load_state"]


@dataclass
class LlamaState:
    """llama-cpp-python's ``LlamaState`` attributes, plus ``slots`` (what :func:`load_state` restores)."""

    input_ids: np.ndarray
    scores: np.ndarray
    n_tokens: int
    llama_state: bytes
    llama_state_size: int
    seed: int
    slots: tuple[SavedSlot, ...] = field(default=())


def save_state(engine: "Engine", seed: int, n_vocab: int) -> LlamaState:
    slots = tuple(engine.slot_store.save_all())
    main = max(slots, key=lambda s: (bool(s.tokens), s.t_last))
    return LlamaState(input_ids=np.array(main.tokens, dtype=np.intc), scores=np.zeros((0, n_vocab), np.single),
                      n_tokens=len(main.tokens), llama_state=main.state, llama_state_size=len(main.state), seed=seed,
                      slots=slots)


def load_state(engine: "Engine", state: Any) -> int:
    """Restore ``state`` (a :class:`LlamaState` of this model and settings); returns its seed."""
    slots = getattr(state, "slots", None)
    if not slots:
        raise CompatError("this state was not saved by llamaspec.Llama.save_state (llama-cpp-python's LlamaState "
                          "holds a whole llama_cpp context, which llamaspec cannot load)")
    if len(slots) != engine.n_parallel:
        raise CompatError(f"this state holds {len(slots)} slots; this Llama has n_parallel={engine.n_parallel}")
    engine.slot_store.restore_all(slots)
    return int(state.seed)
