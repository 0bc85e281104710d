"""Tiny target + draft-head GGUFs whose heads *agree* with their target (EAGLE-3, DFlash, DSpark).

Random-weight heads never agree with their target (0 accepted of 120 drafted, measured natively), so a
parity check on them proves little. These fixtures are built by hand instead, on the project's GGUF writer
(:mod:`llamaspec.testing.tiny_arch`):

**Target** (``llama``, 3 layers, n_embd=128, 64 tokens). Token ``t`` embeds as ``onehot(t) + u`` (``u`` =
dimension 64, common to every token). Every block's output projections (``attn_output``, ``ffn_down``) are
zero, so each layer input is the token embedding itself and the next token is a fixed function ``g`` of the
current one: the output head maps ``onehot(x)`` to ``g(x)``. ``g`` is one 63-cycle over tokens 0..62 (token
63 is DFlash's mask token; ``g(63)`` re-enters the cycle), so greedy text runs through 63 distinct tokens.
Logit gaps are ~8, far above batch/single rounding: speculative and plain greedy output are exactly equal.

**EAGLE-3 head** (one decoder layer, one attention head of width 128). At position P it sees the token
``t[P+1]`` and ``g_P = fc(layer inputs at P)`` = ``onehot(t[P])`` and must give a prenorm state ``h_P`` that
the target's head maps to ``t[P+2]``, i.e. ``h_P = onehot(t[P+1])`` (which is also what the next draft step
feeds back as its ``g``). Attention is made to look only at the current row (query = key = the row's token
on its own rope pair, so other tokens score 0 and the row itself ~90 before softmax); the value carries
both ``onehot(t[P+1])`` (token path) and ``P_g onehot(t[P])`` (feature path, ``P_g`` = the permutation ``g``),
which agree only when the features are the right ones, plus a small residual of ``g`` itself pulling toward
a repeat. Gaussian noise on the value projection makes some drafts wrong. ``own_head=True`` writes copies of
the target's ``token_embd``/``output`` (no ``ctx_other`` needed); without them the draft context must have
``ctx_other`` = the target context.

**DFlash / DSpark heads** (one layer, one head of width 128, block size 4). The mask-token rows of a block
attend, through rope alone (query and key are constant vectors built on the common dimension ``u``, phased
so the score peaks at relative distance exactly ``d`` = 4), to the target features injected ``d`` positions
back; the value maps ``onehot(t)`` to ``onehot(g^k(t))`` so the row predicts the right token ``k`` steps
ahead. Drafts are therefore right only when the features were injected at the right target positions.
DSpark (``markov_w1/w2``) adds the Markov bias ``prev -> g(prev)`` and a confidence head
(``conf_proj``) whose confidence depends on the previous token; ``no_conf=True`` writes a DSpark without
it (``dflash.has_confidence_head = false``).

API: :func:`write_target`, :func:`write_eagle3`, :func:`write_dflash`, :func:`write_dspark`,
:func:`write_all` (``{name: path}``), :func:`cycle` (the target's ``g``); CLI:
``PYTHONPATH=tests python -m support.tiny_eagle OUTDIR``.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from llamaspec.testing.tiny_arch import Dims, Vocab, _base, _Model

__all__ = ["EMBD", "VOCAB", "MASK", "cycle", "write_target", "write_target_lfm2", "write_eagle3", "write_dflash", "write_dspark",
           "write_all", "plain_continuation"]

EMBD = 128
VOCAB = 64
MASK = VOCAB - 1  # DFlash mask token (never produced by the target's cycle)
U = VOCAB  # the dimension every token embedding shares
N_LAYER = 3
BLOCK = 4
_CYCLE_SEED = 7


def cycle(seed: int = _CYCLE_SEED) -> np.ndarray:
    """``g`` as an array: ``g[t]`` is the target's greedy successor of token ``t``."""
    order = np.random.default_rng(seed).permutation(VOCAB - 1)
    g = np.empty(VOCAB, dtype=np.int64)
    for k in range(VOCAB - 1):
        g[order[k]] = order[(k + 1) % (VOCAB - 1)]
    g[MASK] = order[0]
    return g


def plain_continuation(first: int, n: int, seed: int = _CYCLE_SEED) -> list[int]:
    """The target's greedy continuation of a prompt ending in ``first`` (``n`` tokens)."""
    g = cycle(seed)
    out, t = [], first
    for _ in range(n):
        t = int(g[t])
        out.append(t)
    return out


def _perm(g: np.ndarray, k: int) -> np.ndarray:
    """Matrix (numpy (out, in) layout) mapping onehot(t) to onehot(g^k(t)) on the first VOCAB dims."""
    m = np.zeros((VOCAB, VOCAB), np.float32)
    for t in range(VOCAB):
        s = t
        for _ in range(k):
            s = int(g[s])
        m[s, t] = 1.0
    return m


def _embeddings() -> np.ndarray:
    e = np.zeros((VOCAB, EMBD), np.float32)  # numpy (n_vocab, n_embd) = ggml ne {n_embd, n_vocab}
    e[np.arange(VOCAB), np.arange(VOCAB)] = 1.0
    e[:, U] = 1.0
    return e


def _output(g: np.ndarray) -> np.ndarray:
    w = np.zeros((VOCAB, EMBD), np.float32)  # logit_v = w[v] . norm(h); onehot(x) -> g(x)
    for x in range(VOCAB):
        w[int(g[x]), x] = 1.0
    return w


class _Writer(_Model):
    def put(self, name: str, a: np.ndarray) -> None:
        self.tensors.append((name, np.ascontiguousarray(a, dtype=np.float32)))




def _new(arch: str, n_layer: int, name: str, n_head: int, n_ff: int = 64, seed: int = 11) -> _Writer:
    dims = Dims(n_vocab=VOCAB, n_embd=EMBD, n_head=n_head, n_ff=n_ff, n_ctx=1024, std=0.3)
    m = _Writer(arch, dims, seed, 0.0, 1)
    _base(m, n_layer, name, Vocab())
    m.u32("feed_forward_length", n_ff)
    m.u32("attention.head_count", n_head)
    m.u32("attention.head_count_kv", n_head)
    return m


def write_target(path: str | os.PathLike[str], *, block_noise: float = 0.0, seed: int = _CYCLE_SEED) -> Path:
    """The llama-arch target (3 layers). ``block_noise`` > 0 gives the blocks small random output
    projections (then the layer inputs differ slightly per layer and the text depends a little on context)."""
    g = cycle(seed)
    m = _new("llama", N_LAYER, "eagle-target", n_head=2)
    rng = np.random.default_rng(seed + 100)
    m.put("token_embd.weight", _embeddings())
    m.ones("output_norm.weight", EMBD)
    m.put("output.weight", _output(g))
    for i in range(N_LAYER):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", EMBD)
        for n in ("attn_q", "attn_k", "attn_v"):
            m.put(p + n + ".weight", rng.standard_normal((EMBD, EMBD)).astype(np.float32) * 0.3)
        m.put(p + "attn_output.weight", rng.standard_normal((EMBD, EMBD)).astype(np.float32) * block_noise)
        m.ones(p + "ffn_norm.weight", EMBD)
        m.put(p + "ffn_gate.weight", rng.standard_normal((64, EMBD)).astype(np.float32) * 0.3)
        m.put(p + "ffn_up.weight", rng.standard_normal((64, EMBD)).astype(np.float32) * 0.3)
        m.put(p + "ffn_down.weight", rng.standard_normal((EMBD, 64)).astype(np.float32) * block_noise)
    return m.write_atomic(path)


def write_target_lfm2(path: str | os.PathLike[str], *, seed: int = _CYCLE_SEED) -> Path:
    """The same target function on ``lfm2`` (hybrid: short convolutions + attention; FULL with ``n_rs_seq``
    = 0, RS with ``n_rs_seq`` > 0), layers conv / attention / conv with zero output projections."""
    g = cycle(seed)
    kinds = [0, 2, 0]  # head_count_kv per layer: 0 marks a short-convolution layer
    m = _Writer("lfm2", Dims(n_vocab=VOCAB, n_embd=EMBD, n_head=2, n_ff=64, n_ctx=1024), 11, 0.0, 1)
    _base(m, N_LAYER, "eagle-target-lfm2", Vocab())
    m.u32("feed_forward_length", 64)
    m.array("attention.head_count", [2] * N_LAYER)
    m.array("attention.head_count_kv", kinds)
    m.u32("shortconv.l_cache", 3)
    rng = np.random.default_rng(seed + 200)
    m.put("token_embd.weight", _embeddings())
    m.ones("token_embd_norm.weight", EMBD)
    m.put("output.weight", _output(g))
    hd = EMBD // 2
    for i, kv in enumerate(kinds):
        p = f"blk.{i}."
        m.ones(p + "ffn_norm.weight", EMBD)
        m.put(p + "ffn_gate.weight", rng.standard_normal((64, EMBD)).astype(np.float32) * 0.3)
        m.put(p + "ffn_up.weight", rng.standard_normal((64, EMBD)).astype(np.float32) * 0.3)
        m.put(p + "ffn_down.weight", np.zeros((EMBD, 64), np.float32))
        m.ones(p + "attn_norm.weight", EMBD)
        if kv:
            m.ones(p + "attn_q_norm.weight", hd)
            m.ones(p + "attn_k_norm.weight", hd)
            for n in ("attn_q", "attn_k", "attn_v"):
                m.put(p + n + ".weight", rng.standard_normal((EMBD, EMBD)).astype(np.float32) * 0.3)
            m.put(p + "attn_output.weight", np.zeros((EMBD, EMBD), np.float32))
        else:
            m.put(p + "shortconv.conv.weight", rng.standard_normal((EMBD, 3)).astype(np.float32) * 0.3)
            m.put(p + "shortconv.in_proj.weight", rng.standard_normal((3 * EMBD, EMBD)).astype(np.float32) * 0.3)
            m.put(p + "shortconv.out_proj.weight", np.zeros((EMBD, EMBD), np.float32))
    return m.write_atomic(path)


def write_eagle3(path: str | os.PathLike[str], *, own_head: bool = False, noise: float = 0.35,
                 target_layers: Sequence[int] = (0, 1, 2), noise_seed: int = 3, seed: int = _CYCLE_SEED,
                 slot_weights: Sequence[float] = (1.0, 0.0, 0.0)) -> Path:
    """EAGLE-3 head for :func:`write_target` (see the module docstring); ``noise`` = std of the Gaussian
    noise on the value projection (0 = drafts always right); ``slot_weights[k]`` scales the identity block of
    ``fc`` that reads feature slot ``k`` (the input of ``target_layers[k]``); by default only slot 0 counts."""
    if len(target_layers) != 3:
        raise ValueError("eagle3 needs exactly 3 target layers")
    g = cycle(seed)
    m = _new("eagle3", 1, "eagle3-head" + ("-own" if own_head else ""), n_head=1)
    m.array("target_layers", [int(x) for x in target_layers])
    m.u32("target_hidden_size", EMBD)
    m.flag("norm_before_residual", True)
    rng = np.random.default_rng(noise_seed)
    fc = np.zeros((EMBD, 3 * EMBD), np.float32)  # g_P = layer-0-slot input at P: onehot(t[P]) (+ u)
    for k, w in enumerate(slot_weights):
        fc[:, k * EMBD:(k + 1) * EMBD] = np.eye(EMBD, dtype=np.float32) * float(w)
    m.put("fc.weight", fc)
    m.ones("output_norm.weight", EMBD)
    if own_head:
        m.put("output.weight", _output(g))
        m.put("token_embd.weight", _embeddings())
    p = "blk.0."
    m.ones(p + "attn_norm.weight", EMBD)
    m.ones(p + "attn_norm_2.weight", EMBD, 1.0 / 16)  # residual of g (pulls toward a repeat) stays small
    # concat input = [rmsnorm(embd(tok)) (8 onehot(tok) + 8 u), rmsnorm(g) / 16 (onehot(t[P]) / 2 + u / 2)]
    qk = np.zeros((EMBD, 2 * EMBD), np.float32)
    for t in range(VOCAB):
        qk[2 * t, t] = 4.0  # token t on its own rope pair (NORM rope: dims 2t, 2t+1)
    m.put(p + "attn_q.weight", qk)
    m.put(p + "attn_k.weight", qk)
    wv = np.zeros((EMBD, 2 * EMBD), np.float32)
    wv[:VOCAB, :VOCAB] = np.eye(VOCAB, dtype=np.float32) * (1.0 / 8.0)  # token path: onehot(t[P+1])
    wv[:VOCAB, EMBD:EMBD + VOCAB] = _perm(g, 1) * 2.0  # feature path: onehot(g(t[P]))
    wv[:VOCAB] += rng.standard_normal((VOCAB, 2 * EMBD)).astype(np.float32) * (noise / 8.0)
    m.put(p + "attn_v.weight", wv)
    wo = np.zeros((EMBD, EMBD), np.float32)
    wo[:VOCAB, :VOCAB] = np.eye(VOCAB, dtype=np.float32)
    m.put(p + "attn_output.weight", wo)
    m.ones(p + "ffn_norm.weight", EMBD)
    m.put(p + "ffn_gate.weight", np.zeros((64, EMBD), np.float32))
    m.put(p + "ffn_up.weight", np.zeros((64, EMBD), np.float32))
    m.put(p + "ffn_down.weight", np.zeros((EMBD, 64), np.float32))
    return m.write_atomic(path)


def _rope_qk(d: int, n_pairs: int = 16, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """Constant query/key (NEOX rope, one head of width EMBD) whose score peaks at relative distance ``d``
    (query position - key position), using the ``n_pairs`` fastest-turning rope pairs."""
    half = EMBD // 2
    q = np.zeros(EMBD, np.float32)
    k = np.zeros(EMBD, np.float32)
    for j in range(n_pairs):
        theta = base ** (-2.0 * j / EMBD)
        k[j], k[j + half] = 1.0, 0.0
        # q0 = R(-theta d) k0: ggml's rope makes the score q(pq)^T k(pk) = cos(theta (d - (pq - pk)))
        q[j], q[j + half] = np.cos(theta * d), -np.sin(theta * d)
    return q, k


def _dflash(path, *, dspark: bool, noise: float, noise_seed: int, target_layers: Sequence[int], no_conf: bool,
            block_size: int, seed: int, sample_from_anchor: bool | None) -> Path:
    g = cycle(seed)
    name = "dspark-head" if dspark else "dflash-head"
    m = _new("dflash", 1, name, n_head=1)
    m.u32("block_size", block_size)
    m.u32("tokenizer.ggml.mask_token_id", MASK)
    m.array("target_layers", [int(x) for x in target_layers])
    if sample_from_anchor is not None:
        m.string("sample_from_anchor", "true" if sample_from_anchor else "false")
    if dspark and no_conf:
        m.flag("has_confidence_head", False)
    rng = np.random.default_rng(noise_seed)
    d = block_size  # rows attend d positions back: always an injected target position
    anchor = dspark and (sample_from_anchor is None or sample_from_anchor)
    ahead = d + 1 if anchor else d  # row i predicts position pos0+i (+1 when sampling from the anchor)
    fc = np.zeros((EMBD, len(target_layers) * EMBD), np.float32)
    fc[:, :EMBD] = np.eye(EMBD, dtype=np.float32)
    m.put("fc.weight", fc)
    m.ones("enc.output_norm.weight", EMBD)
    m.ones("output_norm.weight", EMBD)
    p = "blk.0."
    m.ones(p + "attn_norm.weight", EMBD)
    q, k = _rope_qk(d)
    wq = np.zeros((EMBD, EMBD), np.float32)
    wk = np.zeros((EMBD, EMBD), np.float32)
    wq[:, U] = q
    wk[:, U] = k
    m.put(p + "attn_q.weight", wq)
    m.put(p + "attn_k.weight", wk)
    wv = np.zeros((EMBD, EMBD), np.float32)
    wv[:VOCAB, :VOCAB] = _perm(g, ahead - 1) * (1.0 / 8.0)  # inp_g = 8 onehot(t) + 8 u
    wv[:VOCAB] += rng.standard_normal((VOCAB, EMBD)).astype(np.float32) * (noise / 8.0)
    m.put(p + "attn_v.weight", wv)
    wo = np.zeros((EMBD, EMBD), np.float32)
    wo[:VOCAB, :VOCAB] = np.eye(VOCAB, dtype=np.float32) * 8.0  # dominates the mask row's own embedding
    m.put(p + "attn_output.weight", wo)
    m.ones(p + "attn_q_norm.weight", 128, 3.0)
    m.ones(p + "attn_k_norm.weight", 128, 3.0)
    m.ones(p + "ffn_norm.weight", EMBD)
    m.put(p + "ffn_gate.weight", np.zeros((64, EMBD), np.float32))
    m.put(p + "ffn_up.weight", np.zeros((64, EMBD), np.float32))
    m.put(p + "ffn_down.weight", np.zeros((EMBD, 64), np.float32))
    if dspark:
        rank = VOCAB
        m.put("markov_w1.weight", np.eye(VOCAB, dtype=np.float32))  # ne {R, V}: w1[prev] = onehot(prev)
        w2 = _perm(g, 1) * 2.0  # ne {R, V}: bias_v = w2[v, prev] -> favours g(prev)
        m.put("markov_w2.weight", w2)
        if not no_conf:
            w = np.zeros((1, EMBD + rank), np.float32)
            w[0, EMBD:] = rng.uniform(-1.0, 3.0, rank).astype(np.float32)  # confidence by previous token
            m.put("conf_proj.weight", w)
            m.put("conf_proj.bias", np.zeros(1, np.float32))
    return m.write_atomic(path)


def write_dflash(path: str | os.PathLike[str], *, noise: float = 0.2, noise_seed: int = 5,
                 target_layers: Sequence[int] = (1, 2), block_size: int = BLOCK, seed: int = _CYCLE_SEED) -> Path:
    """DFlash head for :func:`write_target` (block size 4: at most 3 drafts a round)."""
    return _dflash(path, dspark=False, noise=noise, noise_seed=noise_seed, target_layers=target_layers,
                   no_conf=False, block_size=block_size, seed=seed, sample_from_anchor=None)


def write_dspark(path: str | os.PathLike[str], *, noise: float = 0.45, noise_seed: int = 9,
                 target_layers: Sequence[int] = (1, 2), no_conf: bool = False, block_size: int = BLOCK,
                 sample_from_anchor: bool | None = None, seed: int = _CYCLE_SEED) -> Path:
    """DSpark head (DFlash + Markov head + confidence head) for :func:`write_target`."""
    return _dflash(path, dspark=True, noise=noise, noise_seed=noise_seed, target_layers=target_layers,
                   no_conf=no_conf, block_size=block_size, seed=seed, sample_from_anchor=sample_from_anchor)


def write_all(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Every fixture as ``DIRECTORY/<name>.gguf``; returns ``{name: path}``."""
    d = Path(directory)
    return {
        "target": write_target(d / "eagle-target.gguf"),
        "target-lfm2": write_target_lfm2(d / "eagle-target-lfm2.gguf"),
        "eagle3": write_eagle3(d / "eagle3-head.gguf"),
        "eagle3-own": write_eagle3(d / "eagle3-own-head.gguf", own_head=True),
        "dflash": write_dflash(d / "dflash-head.gguf"),
        "dspark": write_dspark(d / "dspark-head.gguf"),
        "dspark-noconf": write_dspark(d / "dspark-noconf-head.gguf", no_conf=True),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m support.tiny_eagle",
                                 description="Write the tiny target + EAGLE-3 / DFlash / DSpark head fixtures.")
    ap.add_argument("outdir")
    args = ap.parse_args(argv)
    for name, path in write_all(args.outdir).items():
        print(f"{name:14s} {path.stat().st_size:8d} B  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
