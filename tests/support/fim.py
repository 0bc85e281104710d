"""A GGUF copy with fill-in-the-middle tokens, for testing ``/infill`` on models that have none.

The local models of models.toml (SmolLM2-135M-Instruct, Gemma 3 270M) and the tiny test models have no FIM
tokens, so llama.cpp's ``llama_vocab_fim_pre`` & co. return -1 on them and ``/infill`` answers 501, as
llama-server does. :func:`with_fim_tokens` writes a copy whose metadata names existing tokens as the FIM
ones (``tokenizer.ggml.fim_{pre,suf,mid,pad,rep,sep}_token_id``); the weights are copied byte for byte,
so the model's output is meaningless as code completion but exactly what the prompt layout asks for.

``PYTHONPATH=tests python -m support.fim SRC DEST`` writes SmolLM2's copy (its ``<issue_*>`` / ``<file_sep>`` /
``<repo_name>`` control tokens stand in for the FIM ones): the model for llama.cpp's own ``test_infill.py``
(``SRVTEST_MODEL_INFILL``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from llamaspec.models.gguf_io import kv_u32, open_gguf, write_gguf

__all__ = ["with_fim_tokens", "SMOLLM2_FIM"]

FIM_KEYS = ("pre", "suf", "mid", "pad", "rep", "sep")
#: SmolLM2's control tokens used as FIM tokens: <issue_start>, <issue_comment>, <issue_closed>,
#: <empty_output>, <repo_name>, <file_sep>
SMOLLM2_FIM = {"pre": 8, "suf": 9, "mid": 10, "pad": 16, "rep": 3, "sep": 5}


def with_fim_tokens(src: str | os.PathLike[str], dest: str | os.PathLike[str], **ids: int) -> Path:
    """Copy the GGUF ``src`` to ``dest`` with the FIM token ids ``ids`` (``pre=``, ``suf=``, ``mid=``, and
    optionally ``pad=``, ``rep=``, ``sep=``) in its metadata (any such key of ``src`` is replaced)."""
    bad = [k for k in ids if k not in FIM_KEYS]
    if bad:
        raise TypeError(f"unknown FIM token(s) {', '.join(bad)}; known: {', '.join(FIM_KEYS)}")
    keys = {f"tokenizer.ggml.fim_{k}_token_id": int(v) for k, v in ids.items()}
    dest = Path(dest)
    with open_gguf(src) as (lay, buf):
        if lay.endian != "<":
            raise ValueError(f"{src}: only little-endian GGUF files are supported")
        kv_blobs = [bytes(buf[kv.start:kv.end]) for kv in lay.kvs if kv.key not in keys]
        kv_blobs += [kv_u32(k, v) for k, v in keys.items()]

        def copy(nt, out, tick) -> None:  # the weights byte for byte
            start = lay.data_start + nt[0].offset
            out.write(buf[start:start + nt[0].nbytes])

        write_gguf(dest, lay, kv_blobs, [(t, t.ne, t.ggml_type) for t in lay.tensors], copy, f"copying {src}", None, "")
    return dest


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.fim",
                                 description="Copy a GGUF with FIM tokens in its metadata (default: SmolLM2's ids).")
    ap.add_argument("src")
    ap.add_argument("dest")
    for k in FIM_KEYS:
        ap.add_argument(f"--{k}", type=int, default=SMOLLM2_FIM[k], help=f"FIM {k} token id (default {SMOLLM2_FIM[k]})")
    a = ap.parse_args(argv)
    print(with_fim_tokens(a.src, a.dest, **{k: getattr(a, k) for k in FIM_KEYS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
