"""What ``Llama(draft_model=...)`` may be, turned into the Engine's ``draft`` / ``drafters`` arguments.

* a GGUF path or a models.toml name: the draft model (llamaspec's draft-simple, adaptive length);
* a :class:`~llamaspec.compat.draft.DraftModel`: its GGUF, run by the engine itself (not through the hook);
* a llamaspec :class:`~llamaspec.drafters.base.Drafter`: used as the chain;
* any other llama-cpp-python ``LlamaDraftModel`` (``LlamaPromptLookupDecoding``, your own): called with the
  token history each round, as llama-cpp-python calls it (:class:`LlamaDraftModelDrafter`).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .._llama import compat as lcp
from ..drafters.base import DraftParams, Drafter
from ..params import SpecParams
from .args import CompatError

__all__ = ["LlamaDraftModelDrafter", "draft_file", "model_file", "resolve_draft"]

#: the longest draft asked of a ``LlamaDraftModel`` that does not say (``num_pred_tokens``)
DEFAULT_N_MAX = 10


class LlamaDraftModelDrafter(Drafter):
    """A llama-cpp-python ``LlamaDraftModel`` as a llamaspec drafter: called with ``prompt + [id_last]`` (the
    history llama-cpp-python hands it), its answer cut to the round's length."""

    type = "llama-draft-model"

    def __init__(self, model: Any, n_seq: int):
        super().__init__(n_seq)
        self.model = model
        self.n_max = int(getattr(model, "num_pred_tokens", DEFAULT_N_MAX) or DEFAULT_N_MAX)

    def draft(self, params: Sequence[DraftParams]) -> None:
        for dp in params:
            if not dp.drafting:
                continue
            ids = np.fromiter((*dp.prompt, dp.id_last), dtype=np.intc, count=len(dp.prompt) + 1)
            out = np.asarray(self.model(ids)).reshape(-1)
            n = self.n_max if dp.n_max < 0 else min(dp.n_max, self.n_max)
            dp.result.extend(int(t) for t in out[:n])


def model_file(value: "str | os.PathLike", refusal: "Callable[[Exception], str]") -> Path:
    """An existing file, else a name from models.toml (fetched on first use), else ``CompatError(refusal(why))``."""
    p = Path(value).expanduser()
    if p.exists():
        return p
    from .. import models

    try:
        return Path(models.resolve_model(str(value)))
    except Exception as e:  # noqa: BLE001 - not a registry name either
        raise CompatError(refusal(e)) from None


def draft_file(value: "str | os.PathLike") -> Path:
    return model_file(value, lambda e: f"draft_model {str(value)!r} is neither a file nor a model name in "
                                       f"models.toml: {e}")


def resolve_draft(draft_model: Any, spec: "SpecParams | None", n_parallel: int
                  ) -> "tuple[Path | None, list[Drafter] | None, SpecParams | None]":
    """``(draft, drafters, spec)`` for the Engine."""
    if draft_model is None:
        return None, None, spec
    if isinstance(draft_model, (str, os.PathLike)):
        return draft_file(draft_model), None, spec
    path = getattr(draft_model, "path", None)
    if getattr(draft_model, "is_llamaspec_draft_model", False) and path is not None:
        return Path(path), None, spec
    if isinstance(draft_model, Drafter):
        if draft_model.n_seq != n_parallel:
            raise CompatError(f"draft_model serves {draft_model.n_seq} sequences, the Llama has n_parallel={n_parallel}")
        return None, [draft_model], spec
    if isinstance(draft_model, lcp.LlamaDraftModel) or callable(draft_model):
        if n_parallel != 1:
            raise CompatError("a llama_cpp LlamaDraftModel drafts for one sequence: use n_parallel=1")
        return None, [LlamaDraftModelDrafter(draft_model, n_parallel)], spec
    raise CompatError(f"draft_model must be a path, a model name, a llamaspec DraftModel or drafter, or a "
                      f"llama_cpp LlamaDraftModel; got {type(draft_model).__name__}")
