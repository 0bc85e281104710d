"""Tiny MTP (NextN) fixtures whose draft heads agree with their target on a good share of greedy tokens.

Random-weight heads never agree with their target, so a parity check on them proves little (issue 10). These
targets are built so that both the trunk and the MTP head compute (nearly) the same function:

* **Near-identity trunk.** The output projections of every trunk block (``ssm_out`` / ``attn_output`` /
  ``ffn_down``) are scaled by ``delta`` (small), so the residual stream stays close to the token embedding
  ``E[t]`` and the target's next token is nearly a fixed function ``g(t) = argmax_v out_v . rms(E[t])`` (the
  small ``delta`` keeps a little dependence on the context, so cache/state bugs still change the output).
* **A cyclic head.** ``output.weight`` row ``v`` is ``scale * unit(E[pi^-1(v)])`` for a random single cycle
  ``pi`` over the vocabulary, so ``g = pi`` and greedy text walks through every token (never one token
  repeated).
* **A head that computes the same function.** The nextn block's ``eh_proj`` is ``[I | beta*I]`` (+ noise):
  it passes the token-embedding half through and mixes in ``beta`` x the hidden half (the target's nextn
  row, or the head's own output while drafting); its attention / FFN outputs are scaled by ``delta``; the
  LM head is shared (``output.weight``), perturbed by ``head_noise`` through the nextn ``shared_head_head``.
  ``beta`` and ``head_noise`` set the agreement; the defaults land it in the 30-90% range
  (:func:`agreement` measures it).

Kinds:

* :func:`write_qwen35_mtp` - qwen35 hybrid (gated delta net + attention every 4 layers) with one nextn layer:
  an RS target (``n_rs_seq > 0``) and, loaded with ``load_mtp``, its own MTP draft context. (llama.cpp's
  qwen35 MTP graph supports exactly one nextn block.)
* :func:`write_mimo2_mtp` - mimo2 (dense, iSWA KV cache: a PART target) with ``n_nextn`` nextn layers (default
  2): the chained-heads case (``llama_set_nextn_layer_offset``). mimo2's MTP graph needs a fused ``attn_qkv``.
* ``n_nextn=0`` / :func:`write_qwen35_mtp` (..., ``nextn=False``) gives a target without nextn layers (for
  the "incompatible target" errors).

CLI: ``PYTHONPATH=tests python -m support.tiny_mtp OUTDIR`` writes ``qwen35-mtp.gguf`` and ``mimo2-mtp2.gguf`` and
prints their agreement.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from llamaspec.testing.tiny_arch import Dims, Vocab, _attn_kv, _base, _embeddings, _Model, _qwen35

__all__ = ["agreement", "greedy", "write_mimo2_mtp", "write_qwen35_mtp", "make_all", "KINDS"]

_QWEN35_DIMS = Dims(n_ff=64)
_MIMO2_DIMS = Dims(n_ff=64)


def _set(m: _Model, name: str, a: np.ndarray) -> None:
    for i, (n, _old) in enumerate(m.tensors):
        if n == name:
            m.tensors[i] = (name, np.ascontiguousarray(a, dtype=np.float32))
            return
    m.tensors.append((name, np.ascontiguousarray(a, dtype=np.float32)))


def _get(m: _Model, name: str) -> np.ndarray:
    for n, a in m.tensors:
        if n == name:
            return a
    raise KeyError(name)


def _scale(m: _Model, name: str, f: float) -> None:
    _set(m, name, _get(m, name) * np.float32(f))


def _unit(a: np.ndarray) -> np.ndarray:
    return a / np.linalg.norm(a, axis=-1, keepdims=True)


def _cycle(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random permutation of ``range(n)`` that is one single cycle (so greedy text visits every token)."""
    order = rng.permutation(n)
    pi = np.empty(n, dtype=np.int64)
    pi[order] = np.roll(order, -1)
    return pi


def _cyclic_head(m: _Model, rng: np.random.Generator, scale: float) -> np.ndarray:
    """``output.weight`` so that ``argmax out . rms(E[t]) == pi(t)``; returns it (shape ``(V, E)``)."""
    e = _get(m, "token_embd.weight")  # (V, E)
    pi = _cycle(rng, e.shape[0])
    out = np.empty_like(e)
    out[pi] = _unit(e) * np.float32(scale)
    _set(m, "output.weight", out)
    return out


def _nextn_head(m: _Model, rng: np.random.Generator, p: str, out: np.ndarray, *, beta: float, eh_noise: float,
                head_noise: float) -> None:
    e = m.d.n_embd
    eye = np.eye(e, dtype=np.float32)
    w = np.concatenate([eye, np.float32(beta) * eye], axis=1)  # (E, 2E): [token half | hidden half]
    w = w + rng.standard_normal(w.shape).astype(np.float32) * np.float32(eh_noise)
    _set(m, p + "nextn.eh_proj.weight", w)
    if head_noise:
        h = out + rng.standard_normal(out.shape).astype(np.float32) * np.float32(head_noise * float(np.abs(out).mean()))
        _set(m, p + "nextn.shared_head_head.weight", h)




def write_qwen35_mtp(
    path: str | os.PathLike[str], *, seed: int = 310, n_trunk: int = 4, nextn: bool = True, delta: float = 0.04,
    beta: float = 0.5, eh_noise: float = 0.05, head_noise: float = 2.5, scale: float = 1.0,
    eos_token_id: int | None = None, mtp_only: bool = False,
) -> Path:
    """qwen35 hybrid target with one nextn (MTP) layer that agrees with the target on part of the tokens.

    ``mtp_only=True`` writes only the MTP head of the same model (no trunk blocks: a separate MTP GGUF for
    ``-md``; its weights equal the built-in head's)."""
    n_nextn = 1 if nextn else 0
    m = _Model("qwen35", _QWEN35_DIMS, seed, 0.0, 1)
    _base(m, n_trunk + n_nextn, "qwen35-mtp", Vocab(eos_token_id=eos_token_id))
    _qwen35(m, n_trunk=n_trunk, n_nextn=n_nextn)
    rng = np.random.default_rng([seed, 7])
    out = _cyclic_head(m, rng, scale)
    for i in range(n_trunk + n_nextn):
        p = f"blk.{i}."
        names = [n for n, _ in m.tensors if n.startswith(p) and n.endswith(("ssm_out.weight", "attn_output.weight", "ffn_down.weight"))]
        for n in names:
            _scale(m, n, delta)
    if nextn:
        _nextn_head(m, rng, f"blk.{n_trunk}.", out, beta=beta, eh_noise=eh_noise, head_noise=head_noise)
    if mtp_only:
        trunk = tuple(f"blk.{i}." for i in range(n_trunk))
        m.tensors = [(n, a) for n, a in m.tensors if not n.startswith(trunk)]
    return m.write_atomic(path)


def write_mimo2_mtp(
    path: str | os.PathLike[str], *, seed: int = 320, n_trunk: int = 2, n_nextn: int = 2, delta: float = 0.04,
    beta: float = 0.5, eh_noise: float = 0.05, head_noise: float = 2.5, scale: float = 1.0, n_swa: int = 256,
    eos_token_id: int | None = None,
) -> Path:
    """mimo2 (dense, iSWA) target with ``n_nextn`` nextn layers (chained MTP heads)."""
    d = _MIMO2_DIMS
    m = _Model("mimo2", d, seed, 0.0, 1)
    n_all = n_trunk + n_nextn
    _base(m, n_all, "mimo2-mtp", Vocab(eos_token_id=eos_token_id))
    _attn_kv(m)
    m.u32("nextn_predict_layers", n_nextn)
    m.u32("expert_feed_forward_length", d.n_ff)
    m.u32("attention.sliding_window", n_swa)
    m.array("attention.sliding_window_pattern", [1 if i == 0 else 0 for i in range(n_all)])
    _embeddings(m)
    e, n_qkv = d.n_embd, d.head_dim * d.n_head
    for i in range(n_all):
        p = f"blk.{i}."
        m.ones(p + "attn_norm.weight", e)
        m.rand(p + "attn_qkv.weight", e, 3 * n_qkv)
        m.rand(p + "attn_output.weight", n_qkv, e)
        m.ones(p + "ffn_norm.weight", e)
        m.rand(p + "ffn_gate.weight", e, d.n_ff)
        m.rand(p + "ffn_up.weight", e, d.n_ff)
        m.rand(p + "ffn_down.weight", d.n_ff, e)
        if i >= n_trunk:
            m.ones(p + "nextn.enorm.weight", e)
            m.ones(p + "nextn.hnorm.weight", e)
    rng = np.random.default_rng([seed, 7])
    out = _cyclic_head(m, rng, scale)
    for i in range(n_all):
        p = f"blk.{i}."
        _scale(m, p + "attn_output.weight", delta)
        _scale(m, p + "ffn_down.weight", delta)
    for k in range(n_nextn):
        _nextn_head(m, rng, f"blk.{n_trunk + k}.", out, beta=beta, eh_noise=eh_noise, head_noise=head_noise)
    return m.write_atomic(path)


KINDS = {"qwen35-mtp": write_qwen35_mtp, "mimo2-mtp2": write_mimo2_mtp}


def make_all(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Write every kind as ``DIRECTORY/<kind>.gguf`` (rewritten only when the bytes differ)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind, write in KINDS.items():
        path = directory / f"{kind}.gguf"
        with tempfile.TemporaryDirectory(prefix="llamaspec-mtp-") as tmp:
            fresh = write(Path(tmp) / "m.gguf")
            if not (path.is_file() and path.read_bytes() == fresh.read_bytes()):
                os.replace(fresh, path)
        out[kind] = path
    return out


# ---------------------------------------------------------------------------------------------------
# Measurements


def greedy(model, prompt: Sequence[int], n: int, *, n_ctx: int = 256) -> list[int]:
    """Plain greedy continuation of ``prompt`` by ``model`` (a loaded :class:`llamaspec._llama.Model`)."""
    from llamaspec import _llama as L

    with L.Context(model, L.ContextParams(n_ctx=n_ctx, n_batch=64, n_seq_max=1, kv_f32=True, n_threads=1)) as ctx:
        ctx.decode_tokens(list(prompt), 0)
        out: list[int] = []
        pos = len(prompt)
        row = len(prompt) - 1 - (len(prompt) - 1) // ctx.n_batch * ctx.n_batch
        for _ in range(n):
            t = int(np.argmax(ctx.logits(row)))
            out.append(t)
            ctx.decode([L.Row(t, pos, 0, True)])
            pos += 1
            row = 0
        return out


def agreement(path: str | os.PathLike[str], prompt: Sequence[int] = (1, 2, 3, 4), n: int = 64) -> dict:
    """How often each MTP head's greedy token equals the target's next greedy token, teacher-forced.

    Runs the target on ``prompt`` + its own ``n`` greedy tokens with nextn extraction on, then the head
    (offset ``k``) on the pairs (target nextn row ``i-1``, token ``i``) and compares its argmax with token
    ``i+1``. Returns ``{"n_distinct": distinct tokens in the greedy text, "heads": [share per head], "n": n}``.
    """
    from llamaspec import _llama as L
    from llamaspec._llama import ext

    model = L.Model(path, load_mtp=True)
    try:
        toks = list(prompt) + greedy(model, prompt, n)
        cp = dict(n_ctx=256, n_batch=128, n_seq_max=1, kv_f32=True, n_threads=1)
        with L.Context(model, L.ContextParams(**cp)) as tgt, L.Context(model, L.ContextParams(ctx_type=L.CONTEXT_TYPE_MTP, **cp)) as dft:
            ext.set_embeddings_nextn(tgt, True, False)
            ext.set_embeddings_nextn(dft, True, True)
            tgt.decode([L.Row(t, i, 0, False) for i, t in enumerate(toks)])
            h = ext.get_embeddings_nextn(tgt, len(toks))
            shares = []
            for k in range(max(1, model.n_layer_nextn)):
                dft.memory.clear()
                if model.n_layer_nextn > 1:
                    ext.set_nextn_layer_offset(dft, k)
                rows = [L.Row(toks[i], i, 0, True, embd=h[i - 1]) for i in range(1, len(toks) - 1)]
                dft.decode(rows)
                start = len(prompt) - 1  # judge the generated part only
                hits = [int(np.argmax(dft.logits(j))) == toks[j + 2] for j in range(start, len(rows))]
                shares.append(sum(hits) / len(hits))
            return {"n_distinct": len(set(toks[len(prompt):])), "heads": shares, "n": n}
    finally:
        model.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m support.tiny_mtp OUTDIR", file=sys.stderr)
        return 2
    for kind, path in make_all(args[0]).items():
        print(f"{kind:12s} {path}  {agreement(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
