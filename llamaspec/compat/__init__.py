"""llama-cpp-python compatibility, both ways.

* :class:`~llamaspec.compat.llama.Llama` (``llamaspec.Llama``): the ``llama_cpp.Llama`` interface over
  llamaspec's speculative :class:`~llamaspec.engine.Engine`;
* :class:`~llamaspec.compat.draft.DraftModel` (``llamaspec.DraftModel``): a real draft model for
  ``llama_cpp.Llama(..., draft_model=...)``, llama-cpp-python's own speculative hook.

Modules: :mod:`.llama` (the class), :mod:`.completion` (completions), :mod:`.chat` (chat handlers),
:mod:`.lowlevel` (``eval`` / ``sample`` / ``generate``), :mod:`.scoring` (every row's logits: ``echo`` logprobs,
``scores``), :mod:`.args` (arguments not served), :mod:`.drafter` (what ``draft_model`` may be), :mod:`.draft`
(the hook), :mod:`.hub` (``from_pretrained``).
"""
from __future__ import annotations

from .args import CompatError, CompatWarning
from .draft import DraftModel
from .llama import Llama

__all__ = ["CompatError", "CompatWarning", "DraftModel", "Llama"]
