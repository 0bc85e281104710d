"""Same-trunk draft heads given as ``-md`` files: which drafter a head GGUF selects, and which it can serve.

:func:`infer_draft_type` reads only the GGUF header (no model load), as llama.cpp's auto-detection does
(§1.1): a ``dflash`` architecture selects ``draft-dspark`` when it carries the Markov head
(``markov_w1.weight``), else ``draft-dflash``; any other architecture with NextN blocks
(``blk.{B-1}.nextn.eh_proj.weight``) selects ``draft-mtp``. Beyond llama.cpp (which finds EAGLE-3 heads
only through Hugging Face sidecars), an ``eagle3`` architecture selects ``draft-eagle3``. Anything else is a
standalone model: ``draft-simple``.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from .. import _llama as llama
    from ..params import SpecParams

HEAD_TYPES = {"eagle3": ("draft-eagle3",), "dflash": ("draft-dflash", "draft-dspark")}


def infer_draft_type(draft: "str | os.PathLike[str] | llama.Model") -> list[str]:
    """The drafter type a ``-md`` file selects when ``--spec-type`` is not given (a one-item list)."""
    from .mtp import gguf_is_mtp_draft, gguf_layout

    lay = gguf_layout(getattr(draft, "path", draft))  # (None: the model loader says what is wrong with the file)
    if lay is not None and lay[0] == "eagle3":
        return ["draft-eagle3"]
    if lay is not None and lay[0] == "dflash":
        return ["draft-dspark" if "markov_w1.weight" in lay[2] else "draft-dflash"]
    return ["draft-mtp"] if lay is not None and gguf_is_mtp_draft(None, lay) else ["draft-simple"]


def check_head_types(model_dft: "llama.Model", spec: "SpecParams") -> None:
    """One :class:`UsageError` line when a head GGUF is given to drafters that cannot use it."""
    ok = HEAD_TYPES.get(model_dft.arch, ())
    enabled = [t.type_name for t in spec.enabled()]
    wrong = [t for t in enabled if t in ("draft-simple",) or (t.startswith("draft-") and t not in ok and t != "draft-mtp")]
    if wrong or not any(t in ok for t in enabled):
        raise UsageError(
            f"draft {model_dft.path.name} is a {model_dft.arch} head, not a standalone model: use it with "
            f"--spec-type {' or '.join(ok)} (or give no --spec-type), not {', '.join(wrong or enabled) or 'none'}")


def check_head_pair(model_tgt: "llama.Model", model_dft: "llama.Model") -> None:
    """Before any context is created on the head (llama.cpp asserts while reserving its graph on a mismatched
    pair): the target's architecture exposes the layers the head reads, and the widths and vocabularies fit."""
    from .._llama import ext
    from .eagle3 import check_head_target

    kind = "EAGLE-3" if model_dft.arch == "eagle3" else "DFlash"
    ext.require("draft-eagle3" if model_dft.arch == "eagle3" else "draft-dflash")
    ids = ext.model_target_layer_ids(model_dft)
    check_head_target(kind, model_tgt, model_dft, ids, nextn_for_last=model_dft.arch == "eagle3")
    want = model_dft.meta("eagle3.target_hidden_size") if model_dft.arch == "eagle3" else None
    want = int(want) if want is not None else model_dft.n_embd
    if want != model_tgt.n_embd or model_dft.n_embd != model_tgt.n_embd:
        raise UsageError(f"{kind} draft {model_dft.path.name} was made for a target with n_embd={want}, "
                         f"{model_tgt.path.name} has n_embd={model_tgt.n_embd}: use the head made for this target")
    if model_dft.vocab.n_tokens != model_tgt.vocab.n_tokens:
        raise UsageError(f"{kind} draft {model_dft.path.name} has {model_dft.vocab.n_tokens} tokens, its target "
                         f"{model_tgt.path.name} {model_tgt.vocab.n_tokens}: use the head made for this target")


def head_support(target: "llama.Model", draft: "llama.Model | None" = None) -> dict:
    """``{type: {"supported": bool, "why": str | None}}`` for draft-eagle3 / draft-dflash / draft-dspark on this
    target (and ``-md`` file): what the target must expose, and whether the given head fits it. A supported
    EAGLE-3 pair whose head reads a layer the target does not provide (id == n_layer, no nextn output: probed
    on the loaded target) also has ``"warning"``, the line the drafter logs."""
    from .._llama import ext
    from .eagle3 import LAYER_INP_ARCHS, nextn_warning
    from .mtp import gguf_layout

    out: dict = {}
    for kind, arch in (("draft-eagle3", "eagle3"), ("draft-dflash", "dflash"), ("draft-dspark", "dflash")):
        why = None
        if target.arch not in LAYER_INP_ARCHS:
            why = f"the {target.arch} architecture does not expose layer inputs (target features)"
        elif draft is None or draft.arch != arch:
            why = f"needs a {arch} head GGUF as -md (made for this target)"
        else:
            try:
                check_head_pair(target, draft)
            except UsageError as e:
                why = str(e)
            lay = gguf_layout(draft.path) if why is None and kind == "draft-dspark" else None
            if why is None and kind == "draft-dspark" and (lay is None or "markov_w1.weight" not in lay[2]):
                why = f"{draft.path.name} has no DSpark Markov head (markov_w1): use draft-dflash"
        out[kind] = {"supported": why is None, "why": why}
        if why is None and kind == "draft-eagle3":
            warning = nextn_warning(target, draft, ext.model_target_layer_ids(draft))
            if warning:
                out[kind]["warning"] = warning
    return out

