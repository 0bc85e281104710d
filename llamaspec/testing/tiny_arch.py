"""Building blocks of the tiny random-weight GGUFs (:mod:`llamaspec.testing.tiny_models`): dimensions,
vocabulary, the GGUF writer that draws weights from one seeded generator, and one builder per architecture.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

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
    #: ``tokenizer.chat_template`` (None: the model has none)
    chat_template: str | None = None

    def texts(self, n_vocab: int) -> list[str]:
        return [("tok_{i}" if i < self.n_common else self.token_format).format(i=i) for i in range(n_vocab)]

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

    def write_atomic(self, path: "str | os.PathLike[str]") -> Path:
        """:meth:`write` to a temporary file next to ``path``, renamed over it when complete (a reader never
        sees half a model; an interrupted write leaves the old file); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        try:
            self.write(Path(tmp))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


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
    if vocab.chat_template is not None:
        m.string("tokenizer.chat_template", vocab.chat_template)


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
