"""Same-trunk draft heads given as ``-md`` files: which drafter a head GGUF selects, and which it can serve.

:func:`infer_draft_type` reads only the GGUF header (no model load), as llama.cpp's auto-detection does
(spec §1.1): a ``dflash`` architecture selects ``draft-dspark`` when it carries the Markov head
(``markov_w1.weight``), else ``draft-dflash``; any other architecture with NextN blocks
(``blk.{B-1}.nextn.eh_proj.weight``) selects ``draft-mtp``. Beyond llama.cpp (which finds EAGLE-3 heads
only through Hugging Face sidecars), an ``eagle3`` architecture selects ``draft-eagle3``. Anything else is a
standalone model: ``draft-simple``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import LlamaSpecError, UsageError

if TYPE_CHECKING:  # pragma: no cover
    from .. import _llama as llama
    from ..params import SpecParams

HEAD_TYPES = {"eagle3": ("draft-eagle3",), "dflash": ("draft-dflash", "draft-dspark")}


def infer_draft_type(draft: "str | os.PathLike[str] | llama.Model") -> list[str]:
    """The drafter type a ``-md`` file selects when ``--spec-type`` is not given (a one-item list)."""
    from ..models.gguf_io import open_gguf

    path = getattr(draft, "path", draft)
    try:
        with open_gguf(path) as (lay, _):
            arch = lay.get("general.architecture")
            if arch == "eagle3":
                return ["draft-eagle3"]
            names = {t.name for t in lay.tensors}
            if arch == "dflash":
                return ["draft-dspark" if "markov_w1.weight" in names else "draft-dflash"]
            n = lay.get(f"{arch}.block_count") if isinstance(arch, str) else None
            if isinstance(n, int) and n > 0 and f"blk.{n - 1}.nextn.eh_proj.weight" in names:
                return ["draft-mtp"]
    except (LlamaSpecError, OSError):
        pass  # let the model loader report what is wrong with the file
    return ["draft-simple"]


def check_head_types(model_dft: "llama.Model", spec: "SpecParams") -> None:
    """One :class:`UsageError` line when a head GGUF is given to drafters that cannot use it."""
    ok = HEAD_TYPES.get(model_dft.arch, ())
    enabled = [t.type_name for t in spec.enabled()]
    wrong = [t for t in enabled if t in ("draft-simple",) or (t.startswith("draft-") and t not in ok and t != "draft-mtp")]
    if wrong or not any(t in ok for t in enabled):
        raise UsageError(
            f"draft {model_dft.path.name} is a {model_dft.arch} head, not a standalone model: use it with "
            f"--spec-type {' or '.join(ok)} (or give no --spec-type), not {', '.join(wrong or enabled) or 'none'}")
