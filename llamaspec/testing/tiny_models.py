"""Deterministic tiny random-weight GGUF models for tests.

Every model is written with the ``gguf`` package from a seeded :class:`numpy.random.Generator`, so the
same call always produces a byte-identical file (well under 1 MB, F32 weights). The kinds cover each
memory level and drafter kind that llamaspec has to handle (levels as in the capability probe, spec §6):

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

import numpy as np

__all__ = ["KINDS", "TinySpec", "make_all", "spec", "write_model", "model_bytes"]


# ---------------------------------------------------------------------------------------------------
# Configuration shared by every kind


@dataclass(frozen=True)
class Dims:
    """Sizes and weight scale common to all tiny models."""

    n_vocab: int = 64
    n_embd: int = 64
    n_head: int = 2
    n_ff: int = 128
    n_ctx: int = 256
    std: float = 0.3  # weight std; 0.05 makes models that repeat one token
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class Vocab:
    """The "test" tokenizer vocabulary: ``tok_{i}`` for ids below ``n_common``, ``token_format`` above."""

    token_format: str = "tok_{i}"
    n_common: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool | None = None

    def texts(self, n_vocab: int) -> list[str]:
        return [("tok_{i}" if i < self.n_common else self.token_format).format(i=i) for i in range(n_vocab)]


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
# Writer: collects KV pairs and tensors, draws weights from one seeded generator


class _Model:
    """One model under construction.

    Tensor shapes are given in ggml order (``ne0, ne1, ...``, as in the spec's ``{a, b}`` notation);
    numpy arrays are stored with the reversed shape, which is what ``gguf`` expects.
    """

    def __init__(self, arch: str, dims: Dims, seed: int, noise: float, noise_seed: int):
        self.arch = arch
        self.d = dims
        self._rng = np.random.default_rng(seed)
        # A separate stream for the perturbation, so a draft's base weights equal its target's.
        self._noise_rng = np.random.default_rng([seed, noise_seed]) if noise else None
        self._noise = noise
        self.kv: list[tuple[str, Any, str]] = []
        self.tensors: list[tuple[str, np.ndarray]] = []

    # -- metadata ------------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"

    def u32(self, key: str, value: int) -> None:
        self.kv.append((self._key(key), int(value), "u32"))

    def f32(self, key: str, value: float) -> None:
        self.kv.append((self._key(key), float(value), "f32"))

    def string(self, key: str, value: str) -> None:
        self.kv.append((self._key(key), value, "str"))

    def flag(self, key: str, value: bool) -> None:
        self.kv.append((self._key(key), bool(value), "bool"))

    def array(self, key: str, values: Sequence[Any]) -> None:
        self.kv.append((self._key(key), list(values), "arr"))

    # -- tensors -------------------------------------------------------------------------------
    def rand(self, name: str, *ne: int, negative: bool = False) -> None:
        a = self._rng.standard_normal(tuple(reversed(ne))).astype(np.float32) * np.float32(self.d.std)
        if self._noise_rng is not None and a.ndim >= 2:
            a = a + self._noise_rng.standard_normal(a.shape).astype(np.float32) * np.float32(
                self._noise * float(a.std())
            )
        if negative:
            a = -np.abs(a)
        self.tensors.append((name, a.astype(np.float32)))

    def ones(self, name: str, n: int, value: float = 1.0) -> None:
        self.tensors.append((name, np.full(n, value, np.float32)))

    # -- output --------------------------------------------------------------------------------
    def write(self, path: Path) -> None:
        import gguf

        w = gguf.GGUFWriter(str(path), self.arch)
        for key, value, kind in self.kv:
            if kind == "u32":
                w.add_uint32(key, value)
            elif kind == "f32":
                w.add_float32(key, value)
            elif kind == "str":
                w.add_string(key, value)
            elif kind == "bool":
                w.add_bool(key, value)
            else:
                w.add_array(key, value)
        for name, a in self.tensors:
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


# ---------------------------------------------------------------------------------------------------
# Shared blocks


def _base(m: _Model, n_layer: int, name: str, vocab: Vocab) -> None:
    d = m.d
    m.string("general.name", f"llamaspec-tiny-{name}")
    m.u32("context_length", d.n_ctx)
    m.u32("embedding_length", d.n_embd)
    m.u32("block_count", n_layer)
    m.f32("attention.layer_norm_rms_epsilon", d.norm_eps)
    m.string("tokenizer.ggml.model", "test")
    m.array("tokenizer.ggml.tokens", vocab.texts(d.n_vocab))
    m.array("tokenizer.ggml.scores", [0.0] * d.n_vocab)
    if vocab.bos_token_id is not None:
        m.u32("tokenizer.ggml.bos_token_id", vocab.bos_token_id)
    if vocab.eos_token_id is not None:
        m.u32("tokenizer.ggml.eos_token_id", vocab.eos_token_id)
    if vocab.add_bos_token is not None:
        m.flag("tokenizer.ggml.add_bos_token", vocab.add_bos_token)


def _attn_kv(m: _Model, n_ff: bool = True) -> None:
    if n_ff:
        m.u32("feed_forward_length", m.d.n_ff)
    m.u32("attention.head_count", m.d.n_head)
    m.u32("attention.head_count_kv", m.d.n_head)


def _embeddings(m: _Model, out_norm: str = "output_norm.weight") -> None:
    m.rand("token_embd.weight", m.d.n_embd, m.d.n_vocab)
    m.ones(out_norm, m.d.n_embd)


def _attention(m: _Model, p: str, *, n_in: int | None = None, q_gate: bool = False, qk_norm: bool = False) -> None:
    """``attn_q/k/v/output`` (+ optional q/k norms). ``q_gate`` doubles q (qwen35's query+gate)."""
    d = m.d
    n_in = d.n_embd if n_in is None else n_in
    n_qkv = d.head_dim * d.n_head
    m.rand(p + "attn_q.weight", n_in, n_qkv * (2 if q_gate else 1))
    m.rand(p + "attn_k.weight", n_in, n_qkv)
    m.rand(p + "attn_v.weight", n_in, n_qkv)
    m.rand(p + "attn_output.weight", n_qkv, d.n_embd)
    if qk_norm:
        m.ones(p + "attn_q_norm.weight", d.head_dim)
        m.ones(p + "attn_k_norm.weight", d.head_dim)


def _ffn(m: _Model, p: str, *, norm: bool = True) -> None:
    d = m.d
    if norm:
        m.ones(p + "ffn_norm.weight", d.n_embd)
    m.rand(p + "ffn_gate.weight", d.n_embd, d.n_ff)
    m.rand(p + "ffn_up.weight", d.n_embd, d.n_ff)
    m.rand(p + "ffn_down.weight", d.n_ff, d.n_embd)


# ---------------------------------------------------------------------------------------------------
# Architectures (keyword-only parameters are the per-arch overrides accepted by write_model)


def _llama(m: _Model, *, n_layer: int = 2) -> None:
    _attn_kv(m)
    _embeddings(m)
    for i in range(n_layer):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", m.d.n_embd)
        _attention(m, p)
        _ffn(m, p)


def _gemma3(m: _Model, *, n_layer: int = 2, n_swa: int = 16, untied_output: bool = True, post_norm: float = 1.0) -> None:
    """Gemma scales the input embedding by sqrt(n_embd); with a tied output head the token's own
    embedding then dominates the logits and the model just repeats its input, so by default the head is
    a separate ``output.weight``."""
    _attn_kv(m)
    m.u32("attention.sliding_window", n_swa)
    _embeddings(m)
    if untied_output:
        m.rand("output.weight", m.d.n_embd, m.d.n_vocab)
    for i in range(n_layer):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", m.d.n_embd)
        _attention(m, p)
        m.ones(p + "post_attention_norm.weight", m.d.n_embd, post_norm)
        m.ones(p + "attn_q_norm.weight", m.d.head_dim)
        m.ones(p + "attn_k_norm.weight", m.d.head_dim)
        _ffn(m, p)
        m.ones(p + "post_ffw_norm.weight", m.d.n_embd, post_norm)


def _mamba(m: _Model, *, n_layer: int = 2, d_conv: int = 4, d_state: int = 16, dt_rank: int = 4) -> None:
    e = m.d.n_embd
    d_inner = 2 * e  # llama.cpp's mamba requires expansion 2
    m.u32("ssm.conv_kernel", d_conv)
    m.u32("ssm.inner_size", d_inner)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", dt_rank)
    _embeddings(m)
    for i in range(n_layer):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", e)
        m.rand(p + "ssm_in.weight", e, 2 * d_inner)
        m.rand(p + "ssm_conv1d.weight", d_conv, d_inner)
        m.rand(p + "ssm_conv1d.bias", d_inner)
        m.rand(p + "ssm_x.weight", d_inner, dt_rank + 2 * d_state)
        m.rand(p + "ssm_dt.weight", dt_rank, d_inner)
        m.rand(p + "ssm_dt.bias", d_inner)
        m.rand(p + "ssm_a", d_state, d_inner, negative=True)
        m.rand(p + "ssm_d", d_inner)
        m.rand(p + "ssm_out.weight", d_inner, e)


def _lfm2(m: _Model, *, n_layer: int = 2, l_cache: int = 3) -> None:
    """Even layers are short convolutions (head_count_kv = 0), odd layers attention."""
    d = m.d
    kv_heads = [d.n_head if i % 2 else 0 for i in range(n_layer)]
    m.u32("feed_forward_length", d.n_ff)
    m.array("attention.head_count", [d.n_head] * n_layer)
    m.array("attention.head_count_kv", kv_heads)
    m.u32("shortconv.l_cache", l_cache)
    _embeddings(m, out_norm="token_embd_norm.weight")
    for i in range(n_layer):
        p = f"blk.{i}."
        _ffn(m, p)
        m.ones(p + "attn_norm.weight", d.n_embd)
        if kv_heads[i]:
            m.ones(p + "attn_q_norm.weight", d.head_dim)
            m.ones(p + "attn_k_norm.weight", d.head_dim)
            _attention(m, p)
        else:
            m.rand(p + "shortconv.conv.weight", l_cache, d.n_embd)
            m.rand(p + "shortconv.in_proj.weight", d.n_embd, 3 * d.n_embd)
            m.rand(p + "shortconv.out_proj.weight", d.n_embd, d.n_embd)


def _qwen35(
    m: _Model, *, n_trunk: int = 4, n_nextn: int = 1, d_state: int = 16, n_group: int = 2, dt_rank: int = 2,
    d_conv: int = 4, full_attention_interval: int = 4,
) -> None:
    """Gated-delta-net trunk (attention every ``full_attention_interval`` layers) + NextN (MTP) layers."""
    d = m.d
    e = d.n_embd
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    conv_dim = 2 * key_dim + value_dim
    m.u32("nextn_predict_layers", n_nextn)
    _attn_kv(m)
    m.u32("ssm.conv_kernel", d_conv)
    m.u32("ssm.inner_size", value_dim)
    m.u32("ssm.state_size", d_state)
    m.u32("ssm.time_step_rank", dt_rank)
    m.u32("ssm.group_count", n_group)
    m.u32("full_attention_interval", full_attention_interval)
    m.array("rope.dimension_sections", [d.head_dim // 4] * 4)
    _embeddings(m)

    def common(p: str) -> None:
        m.ones(p + "attn_norm.weight", e)
        m.ones(p + "post_attention_norm.weight", e)
        _ffn(m, p, norm=False)

    for i in range(n_trunk + n_nextn):
        p = f"blk.{i}."
        common(p)
        if i >= n_trunk or (i + 1) % full_attention_interval == 0:
            _attention(m, p, q_gate=True, qk_norm=True)
        else:
            m.rand(p + "attn_qkv.weight", e, conv_dim)
            m.rand(p + "attn_gate.weight", e, value_dim)
            m.rand(p + "ssm_conv1d.weight", d_conv, conv_dim)
            m.rand(p + "ssm_dt.bias", dt_rank)
            m.rand(p + "ssm_a", dt_rank, negative=True)
            m.rand(p + "ssm_beta.weight", e, dt_rank)
            m.rand(p + "ssm_alpha.weight", e, dt_rank)
            m.ones(p + "ssm_norm.weight", d_state)
            m.rand(p + "ssm_out.weight", value_dim, e)
        if i >= n_trunk:
            m.rand(p + "nextn.eh_proj.weight", 2 * e, e)
            m.ones(p + "nextn.enorm.weight", e)
            m.ones(p + "nextn.hnorm.weight", e)


def _draft_head(m: _Model, target_layers: Sequence[int], target_hidden_size: int | None) -> int:
    """``target_layers`` key and ``fc`` (fuses the target's layer inputs into one n_embd vector)."""
    e_tgt = m.d.n_embd if target_hidden_size is None else target_hidden_size
    m.array("target_layers", [int(x) for x in target_layers])
    m.rand("fc.weight", len(target_layers) * e_tgt, m.d.n_embd)
    return e_tgt


def _eagle3(
    m: _Model, *, target_layers: Sequence[int] = (0, 1, 2), target_hidden_size: int | None = None,
    own_head: bool = False,
) -> None:
    d = m.d
    if len(target_layers) != 3:
        raise ValueError("eagle3 needs exactly 3 target_layers")
    _attn_kv(m)
    e_tgt = _draft_head(m, target_layers, target_hidden_size)
    m.u32("target_hidden_size", e_tgt)
    m.ones("output_norm.weight", d.n_embd)
    if own_head:
        m.rand("output.weight", d.n_embd, d.n_vocab)
        m.rand("token_embd.weight", d.n_embd, d.n_vocab)
    p = "blk.0."
    m.ones(p + "attn_norm.weight", d.n_embd)
    m.ones(p + "attn_norm_2.weight", d.n_embd)
    _attention(m, p, n_in=2 * d.n_embd)  # input = [token embedding, fused target hidden]
    _ffn(m, p)


def _dflash(
    m: _Model, *, target_layers: Sequence[int] = (1, 2), block_size: int = 4, mask_token_id: int | None = None,
    own_head: bool = False,
) -> None:
    d = m.d
    _attn_kv(m)
    m.u32("block_size", block_size)
    m.u32("tokenizer.ggml.mask_token_id", d.n_vocab - 1 if mask_token_id is None else mask_token_id)
    _draft_head(m, target_layers, None)
    m.ones("enc.output_norm.weight", d.n_embd)
    m.ones("output_norm.weight", d.n_embd)
    if own_head:
        m.rand("output.weight", d.n_embd, d.n_vocab)
        m.rand("token_embd.weight", d.n_embd, d.n_vocab)
    p = "blk.0."
    m.ones(p + "attn_norm.weight", d.n_embd)
    _attention(m, p, qk_norm=True)
    _ffn(m, p)


_N_LAYER_DEFAULT = {"eagle3": 1, "dflash": 1}


def _n_layer(arch: str, params: Mapping[str, Any]) -> int:
    if arch == "qwen35":
        return int(params.get("n_trunk", 4)) + int(params.get("n_nextn", 1))
    if arch in _N_LAYER_DEFAULT:
        return _N_LAYER_DEFAULT[arch]
    return int(params.get("n_layer", 2))


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
    ``add_bos_token``), ``noise``/``noise_seed``, or an architecture parameter (e.g. ``n_layer``,
    ``n_swa``, ``l_cache``, ``n_trunk``, ``n_nextn``, ``target_layers``, ``block_size``, ``own_head``).
    The file is written atomically (temporary file + rename) and is byte-identical for identical
    arguments.
    """
    path = Path(path)
    m = _assemble(kind, seed, overrides)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        m.write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


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
