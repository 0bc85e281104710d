"""Deterministic tiny random-weight GGUF models for tests.

Every model is written with the ``gguf`` package from a seeded :class:`numpy.random.Generator`, so the
same call always produces a byte-identical file (well under 1 MB, F32 weights). The kinds cover each
memory level and drafter kind that llamaspec has to handle (levels as in the capability probe, §6):

=================  ========  ===================================================================
kind               arch      what it is for
=================  ========  ===================================================================
``llama``          llama     PART (plain KV cache), 2 layers
``llama-draft``    llama     ``llama`` + Gaussian noise (0.1 x each matrix's std): a draft that is
                             right on some, not all, greedy tokens
``llama-incompat`` llama     vocabulary incompatible with ``llama`` (token texts differ from id 5
                             on, and 200 tokens instead of 64, a difference > 128)
``gemma3``         gemma3    PART with an iSWA cache (``sliding_window`` = 16); untied output head
                             (with a tied one gemma's sqrt(n_embd) embedding scale makes it repeat
                             its input token forever)
``mamba``          mamba     FULL (pure recurrent; ``n_rs_seq`` is clamped to 0)
``mamba-draft``    mamba     perturbed copy of ``mamba``
``lfm2``           lfm2      hybrid (shortconv + attention): FULL with ``n_rs_seq = 0``, RS with
                             ``n_rs_seq > 0``
``lfm2-draft``     lfm2      perturbed copy of ``lfm2``
``qwen35``         qwen35    hybrid, 4 trunk layers + 1 NextN layer: RS target with ``n_rs_seq > 0``,
                             and an MTP draft context (``load_mtp`` + ``LLAMA_CONTEXT_TYPE_MTP``)
``eagle3``         eagle3    EAGLE-3 draft head (no embeddings/output of its own)
``dflash``         dflash    DFlash block-diffusion draft (no embeddings/output of its own)
=================  ========  ===================================================================

All kinds share one vocabulary convention and the dimensions n_embd=64, n_head=2, n_ff=128,
n_vocab=64, context_length=256 and weight std 0.3 (std 0.05 gives degenerate models that repeat one
token forever; 0.3 gives tens of distinct tokens per 100 greedy steps). No ``llama4`` kind: there is no
verified recipe for it.

Partners. ``eagle3`` (``target_layers`` = 0, 1, 2) and ``dflash`` (``target_layers`` = 1, 2) read
layer inputs of a target that has at least 3 layers: use ``qwen35`` as their target (same n_embd and
vocabulary). Both need ``ctx_other = <target context>`` at context creation because they have no
``token_embd``/``output`` tensors of their own (pass ``own_head=True`` to give them one).

Vocabulary ("test" tokenizer, ``LLAMA_VOCAB_TYPE_TEST``, measured with llama-cpp-python 0.3.36):

* Tokens are ``tok_0`` .. ``tok_{V-1}``, all plain (no control tokens), scores 0.
* BOS and EOS are unset: ``llama_vocab_bos``/``llama_vocab_eos`` return -1 (``LLAMA_TOKEN_NULL``),
  ``add_bos``/``add_eos`` are false, and no token is end-of-generation, so generation only stops at
  the length limit. Pass ``eos_token_id=N`` (and/or ``bos_token_id``, ``add_bos_token``) to
  :func:`write_model` to get an EOG token.
* ``llama_tokenize`` does *not* look token texts up: it cuts the UTF-8 text into 5-byte chunks and maps
  each chunk to ``hash(chunk) % n_vocab`` (hash = h*31 + byte). So any text tokenizes, deterministically,
  but ``"tok_3 tok_5"`` gives three arbitrary ids (chunks ``"tok_3"``, ``" tok_"``, ``"5"``), not
  ``[3, 5]``.
* ``llama_token_to_piece`` returns the token id in lower-case hex (``10`` -> ``"a"``), without
  separators, so detokenized text is only good for display, not for a round trip.
* Tests that need exact prompts therefore feed token ids directly; text prompts work too (they just map
  to pseudo-random ids).

API: :func:`write_model`, :data:`KINDS`, :func:`make_all`, :func:`spec`; CLI:
``python -m llamaspec.testing.tiny_models OUTDIR [KIND ...]``.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .tiny_arch import Dims, Vocab, _base, _dflash, _eagle3, _gemma3, _lfm2, _llama, _mamba, _Model, _n_layer, _qwen35

__all__ = ["KINDS", "TinySpec", "make_all", "spec", "write_model", "model_bytes"]




@dataclass(frozen=True)
class TinySpec:
    """Declarative description of one kind: architecture builder, defaults and provenance."""

    name: str
    arch: str
    build: Callable[..., None]
    seed: int
    doc: str
    dims: Dims = field(default_factory=Dims)
    vocab: Vocab = field(default_factory=Vocab)
    params: Mapping[str, Any] = field(default_factory=dict)  # builder keyword arguments
    noise: float = 0.0  # perturbation: noise x each matrix's std, added to every 2-D tensor
    noise_seed: int = 1


# ---------------------------------------------------------------------------------------------------
# The kinds

_DRAFT_NOISE = 0.1

_SPECS: dict[str, TinySpec] = {}


def _register(s: TinySpec) -> None:
    _SPECS[s.name] = s


def _draft_of(base: str, doc: str) -> None:
    b = _SPECS[base]
    _register(dataclasses.replace(b, name=f"{base}-draft", noise=_DRAFT_NOISE, doc=doc))


_register(TinySpec("llama", "llama", _llama, seed=102, doc="PART: plain KV cache, 2 layers"))
_draft_of("llama", "perturbed llama (noise 0.1 x std): a sometimes-wrong draft for llama")
_register(TinySpec(
    "llama-incompat", "llama", _llama, seed=201,
    dims=Dims(n_vocab=200), vocab=Vocab(token_format="alt_{i}", n_common=5),
    doc="llama with a vocabulary incompatible with llama (texts differ from id 5, 200 tokens)",
))
_register(TinySpec("gemma3", "gemma3", _gemma3, seed=110, doc="PART with SWA (iSWA cache, n_swa=16)"))
_register(TinySpec("mamba", "mamba", _mamba, seed=104, doc="FULL: pure recurrent"))
_draft_of("mamba", "perturbed mamba: a sometimes-wrong draft for mamba")
_register(TinySpec("lfm2", "lfm2", _lfm2, seed=105, doc="hybrid: FULL with n_rs_seq=0, RS with n_rs_seq>0"))
_draft_of("lfm2", "perturbed lfm2: a sometimes-wrong draft for lfm2")
_register(TinySpec(
    "qwen35", "qwen35", _qwen35, seed=106, dims=Dims(n_ff=64),  # 5 layers: half-size FFN keeps it small
    doc="hybrid with a NextN layer: RS target (n_rs_seq>0) and MTP draft context (load_mtp)",
))
_register(TinySpec("eagle3", "eagle3", _eagle3, seed=107, doc="EAGLE-3 draft head; needs ctx_other (target qwen35)"))
_register(TinySpec("dflash", "dflash", _dflash, seed=108, doc="DFlash draft; needs ctx_other (target qwen35)"))

KINDS: tuple[str, ...] = tuple(_SPECS)

_DIM_FIELDS = {f.name for f in dataclasses.fields(Dims)}
_VOCAB_FIELDS = {f.name for f in dataclasses.fields(Vocab)}


def spec(kind: str) -> TinySpec:
    """The declarative spec of ``kind`` (raises ``KeyError`` with the known kinds)."""
    try:
        return _SPECS[kind]
    except KeyError:
        raise KeyError(f"unknown tiny model kind {kind!r}; known: {', '.join(KINDS)}") from None


def _builder_params(s: TinySpec) -> set[str]:
    sig = inspect.signature(s.build)
    return {n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _assemble(kind: str, seed: int | None, overrides: Mapping[str, Any]) -> _Model:
    s = spec(kind)
    dims_kw, vocab_kw, arch_kw = {}, {}, dict(s.params)
    noise, noise_seed = s.noise, s.noise_seed
    allowed = _builder_params(s)
    for k, v in overrides.items():
        if k in _DIM_FIELDS:
            dims_kw[k] = v
        elif k in _VOCAB_FIELDS:
            vocab_kw[k] = v
        elif k == "noise":
            noise = float(v)
        elif k == "noise_seed":
            noise_seed = int(v)
        elif k in allowed:
            arch_kw[k] = v
        else:
            known = sorted(_DIM_FIELDS | _VOCAB_FIELDS | allowed | {"noise", "noise_seed"})
            raise TypeError(f"unknown override {k!r} for tiny model {kind!r}; accepted: {', '.join(known)}")
    dims = dataclasses.replace(s.dims, **dims_kw)
    vocab = dataclasses.replace(s.vocab, **vocab_kw)
    if dims.n_embd % dims.n_head:
        raise ValueError("n_embd must be a multiple of n_head")
    m = _Model(s.arch, dims, s.seed if seed is None else seed, noise, noise_seed)
    _base(m, _n_layer(s.arch, arch_kw), kind, vocab)
    s.build(m, **arch_kw)
    return m


def model_bytes(kind: str, *, seed: int | None = None, **overrides: Any) -> bytes:
    """The exact bytes :func:`write_model` would write for the same arguments."""
    with tempfile.TemporaryDirectory(prefix="llamaspec-tiny-") as tmp:
        p = Path(tmp) / "m.gguf"
        _assemble(kind, seed, overrides).write(p)
        return p.read_bytes()


def write_model(kind: str, path: str | os.PathLike[str], *, seed: int | None = None, **overrides: Any) -> Path:
    """Write the tiny model ``kind`` to ``path`` and return the path.

    ``seed`` defaults to the kind's fixed seed (drafts share their target's seed and add noise from a
    second stream, so ``llama-draft`` = ``llama`` + noise). ``overrides`` may set any :class:`Dims`
    field (``n_vocab``, ``n_embd``, ``n_head``, ``n_ff``, ``n_ctx``, ``std``, ``norm_eps``), any
    :class:`Vocab` field (``token_format``, ``n_common``, ``bos_token_id``, ``eos_token_id``,
    ``add_bos_token``, ``chat_template``), ``noise``/``noise_seed``, or an architecture parameter (e.g. ``n_layer``,
    ``n_swa``, ``l_cache``, ``n_trunk``, ``n_nextn``, ``target_layers``, ``block_size``, ``own_head``).
    The file is written atomically (temporary file + rename) and is byte-identical for identical
    arguments.
    """
    return _assemble(kind, seed, overrides).write_atomic(path)


def make_all(directory: str | os.PathLike[str], kinds: Sequence[str] | None = None) -> dict[str, Path]:
    """Write every kind (default: :data:`KINDS`) as ``DIRECTORY/<kind>.gguf``; return ``{kind: path}``.

    A file that already holds exactly the bytes this version would write is left untouched.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for kind in KINDS if kinds is None else kinds:
        path = directory / f"{kind}.gguf"
        if not (path.is_file() and path.read_bytes() == model_bytes(kind)):
            write_model(kind, path)
        out[kind] = path
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m llamaspec.testing.tiny_models",
        description="Write deterministic tiny random-weight GGUF models for tests.",
    )
    ap.add_argument("outdir", help="directory to write <kind>.gguf files into")
    ap.add_argument("kinds", nargs="*", metavar="KIND", help=f"kinds to write (default: all): {', '.join(KINDS)}")
    args = ap.parse_args(argv)
    bad = [k for k in args.kinds if k not in _SPECS]
    if bad:
        ap.error(f"unknown kind(s): {', '.join(bad)}; known: {', '.join(KINDS)}")
    for kind, path in make_all(args.outdir, args.kinds or None).items():
        print(f"{kind:16s} {path.stat().st_size:8d} B  {path}  ({_SPECS[kind].doc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
