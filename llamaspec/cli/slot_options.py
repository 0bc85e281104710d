"""``llamaspec serve``'s ``--slot-save-path DIR`` (``POST /slots/{id}?action=save|restore`` files live there;
without it the route answers 501, as llama-server) and ``--spm-infill`` (``/infill`` prompts in
suffix/prefix/middle order), with llama-server's meaning."""
from __future__ import annotations

import os

import click

from llamaspec.errors import UsageError


def slot_options(f):
    """Decorator adding ``--slot-save-path`` and ``--spm-infill``."""
    f = click.option("--spm-infill", "spm_infill", is_flag=True,
                     help="Infill prompts in Suffix/Prefix/Middle order instead of Prefix/Suffix/Middle (some models "
                          "prefer it).")(f)
    return click.option("--slot-save-path", "slot_save_path", default=None, metavar="DIR",
                        help="Directory of the slot files of POST /slots/{id}?action=save|restore (default: disabled, "
                             "501).")(f)


def pop_slot_options(kw: dict) -> dict:
    """Take the two flags out of ``kw`` (the command's keyword arguments): ``ServerConfig`` keywords. A
    ``--slot-save-path`` that is not a directory is a usage error, as in llama-server."""
    path, spm = kw.pop("slot_save_path", None), bool(kw.pop("spm_infill", False))
    if path is not None and not os.path.isdir(path):
        raise UsageError(f"--slot-save-path: not a directory: {path}")
    return {"slot_save_path": os.path.abspath(path) if path is not None else None, "spm_infill": spm}
