"""GPU-offload, RPC and thread flags with llama.cpp's names, shared by generate / probe / bench / serve.

The flags take strings and are parsed and checked in the command body (:func:`pop_device_options`), so a
bad value is one :class:`~llamaspec.errors.UsageError` line (exit code 2), like every other usage error.
"""
from __future__ import annotations

import re

import click

from ._common import option_group

#: the keyword names the options fill in, in order
KEYS = ("n_gpu_layers", "n_gpu_layers_draft", "main_gpu", "split_mode", "tensor_split", "threads", "threads_batch",
        "threads_draft", "rpc", "rpc_draft")


def device_options(*, bench: bool = False):
    """Decorator adding ``-ngl -ngld -mg -sm -ts -t -tb -td --rpc --rpc-draft``. ``bench``: the benchmark's
    defaults (CPU)."""
    if bench:
        ngl_default = "0: every engine on the CPU"
        ngld_default = "same as -ngl"
    else:
        ngl_default = "llama.cpp's, -1 = all layers"
        ngld_default = "llama.cpp's, -1 = all layers"
    opts = [
        click.option("-ngl", "--n-gpu-layers", "--gpu-layers", "n_gpu_layers", metavar="N", default=None,
                     help=f"Layers of the target to store in VRAM: a number or 'all' (default: {ngl_default}). "
                          "A CPU-only build of llama.cpp ignores it."),
        click.option("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft", "n_gpu_layers_draft", metavar="N",
                     default=None, help=f"The same for the draft model (default: {ngld_default})."),
        click.option("-mg", "--main-gpu", "main_gpu", metavar="INDEX", default=None,
                     help="The GPU for the whole model with -sm none (default: 0)."),
        click.option("-sm", "--split-mode", "split_mode", metavar="{none,layer,row,tensor}", default=None,
                     help="How to split the model across GPUs (default: layer; tensor is experimental in llama.cpp)."),
        click.option("-ts", "--tensor-split", "tensor_split", metavar="N0,N1,...", default=None,
                     help="Proportion of the model on each GPU, e.g. 3,1 (default: by free memory)."),
        click.option("-t", "--threads", "threads", metavar="N", default=None,
                     help="CPU threads for generation (default: all available cores, or fewer for each decode where "
                          "fewer measure faster, as on a busy machine; a count given here is used as is)."),
        click.option("-tb", "--threads-batch", "threads_batch", metavar="N", default=None,
                     help="CPU threads for batch and prompt processing (default: same as -t)."),
        click.option("-td", "--threads-draft", "threads_draft", metavar="N", default=None,
                     help="CPU threads for the draft model's generation (default: same as -t)."),
        click.option("--rpc", "rpc", metavar="HOST:PORT[,...]", default=None,
                     help="llama.cpp RPC servers (ggml-rpc-server) holding the target's offloaded layers, split "
                          "by -ts in this order (needs llama.cpp built with --rpc, see docs/cli.md)."),
        click.option("--rpc-draft", "rpc_draft", metavar="HOST:PORT[,...]", default=None,
                     help="RPC servers for the draft model (default: none, the draft runs locally next to "
                          "the speculative loop)."),
    ]
    return option_group(opts)


def _int(flag: str, v: str | None, *, allow_all: bool = False) -> int | None:
    from llamaspec.errors import UsageError

    if v is None:
        return None
    s = v.strip()
    if allow_all and s == "all":
        return -1  # llama_model_params: a negative value means all layers
    try:
        return int(s)
    except ValueError:
        raise UsageError(f"{flag}: expected an integer{' or all' if allow_all else ''}, got {v!r}") from None


def parse_tensor_split(v: str | None) -> list[float] | None:
    """``-ts`` as llama.cpp parses it (proportions split on ``,`` or ``/``).

    >>> parse_tensor_split("3,1"), parse_tensor_split("1/1/2")
    ([3.0, 1.0], [1.0, 1.0, 2.0])
    """
    from llamaspec.errors import UsageError

    if v is None:
        return None
    if not v.strip():
        return []
    try:
        return [float(x) for x in re.split(r"[,/]+", v.strip())]
    except ValueError:
        raise UsageError(f"-ts: expected proportions per GPU like 3,1, got {v!r}") from None


def pop_device_options(kw: dict) -> dict:
    """Take the device flags out of ``kw`` (the command's keyword arguments), parse and check them:
    :class:`~llamaspec.engine.Engine` keyword arguments (None = llama.cpp's default)."""
    from llamaspec._llama.rpc import parse_servers as parse_rpc_servers
    from llamaspec.contexts import check_device_params

    raw = {k: kw.pop(k, None) for k in KEYS}
    out = {
        "n_gpu_layers": _int("-ngl", raw["n_gpu_layers"], allow_all=True),
        "n_gpu_layers_draft": _int("-ngld", raw["n_gpu_layers_draft"], allow_all=True),
        "main_gpu": _int("-mg", raw["main_gpu"]),
        "split_mode": raw["split_mode"].strip() if raw["split_mode"] is not None else None,
        "tensor_split": parse_tensor_split(raw["tensor_split"]),
        "n_threads": _int("-t", raw["threads"]),
        "n_threads_batch": _int("-tb", raw["threads_batch"]),
        "n_threads_draft": _int("-td", raw["threads_draft"]),
        "rpc_servers": parse_rpc_servers(raw["rpc"], flag="--rpc"),
        "rpc_servers_draft": parse_rpc_servers(raw["rpc_draft"], flag="--rpc-draft"),
    }
    check_device_params(**out)
    return out
