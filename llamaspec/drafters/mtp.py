"""``draft-mtp``: multi-token-prediction (NextN) heads as drafter (§4.4).

The head is a context of type ``LLAMA_CONTEXT_TYPE_MTP``, either on the **target model itself** (loaded with
``load_mtp``; no ``-md`` needed) or on a separate MTP GGUF. It reads the target's *nextn hidden state*: MTP
position ``p+1`` takes the pair (target hidden state at ``p``, token at ``p+1``) and predicts the token at
``p+2``.

* ``process(rows)`` runs after every target decode (prompt chunks and verification batches): every row of the
  batch is decoded into the MTP context (no outputs) with, as its embedding, the target's nextn row of the
  previous batch row, or ``pending_h[seq]`` (the last hidden state of the previous call) for the first row
  of each sequence. The target rows of each sequence are kept (``verify_h``) and the last one becomes
  ``pending_h``.
* ``draft`` decodes ``(id_last, pos0)`` with ``pending_h``, then each drafted token with the head's own
  hidden output, taking the top candidate each step (``p_min`` / ``n_min`` as every model drafter).
* ``accept(seq, n)``: ``pending_h = verify_h[min(n, rows-1)]`` (the hidden state of the last accepted row).
* **Chained heads** (``n_layer_nextn > 1``, e.g. mimo2 / step35): one head per draft step
  (``llama_set_nextn_layer_offset``), ``n_max`` clamped to the number of heads; each step re-decodes the
  whole draft prefix under its head (positions ``pos0..``) and ``process`` decodes the batch once per head.
* **Memory shared with the target** (``ctx_other`` is the target, gemma4-assistant): no catch-up decode;
  every draft step sits at ``pos0``.

:func:`mtp_support` says, before any native call, whether a model can carry an MTP context (llama.cpp aborts
on a qwen35-family model with more than one nextn block, and on nextn blocks that were not loaded).
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from .. import _llama as llama
from .._llama import ext
from ..errors import DecodeError, LlamaSpecError, UsageError
from ..params import DraftModelParams
from .base import DraftParams
from .draft_model import ModelDrafter, top_candidate

log = logging.getLogger("llamaspec")

#: architectures with an MTP graph (``LLM_GRAPH_TYPE_DECODER_MTP``; §12.1)
MTP_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4-moe", "glm5-next",
    "hy-v3", "mimo2", "nemotron_h_moe", "qwen35", "qwen35moe", "qwen3next", "step35", "gemma4-assistant",
})
#: of those, the ones whose MTP graph asserts (aborts) unless there is exactly one nextn block
MTP_SINGLE_BLOCK = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "glm-dsa", "glm4-moe", "nemotron_h_moe",
    "qwen35", "qwen35moe", "qwen3next",
})


def mtp_support(model: "llama.Model", *, loaded_with_mtp: bool | None = None) -> str | None:
    """None when an MTP context can be created on ``model``; otherwise why not (one line).

    ``loaded_with_mtp``: whether the model was loaded with ``load_mtp=True`` (None = read the model's
    ``load_mtp`` attribute; False when it has none)."""
    name = model.path.name
    if model.arch not in MTP_ARCHS:
        return f"{name} is a {model.arch} model: llama.cpp has no MTP (nextn) head for that architecture"
    if model.arch != "gemma4-assistant" and model.n_layer_nextn <= 0:
        return f"{name} ({model.arch}) has no nextn (MTP) layers"
    if model.arch in MTP_SINGLE_BLOCK and model.n_layer_nextn > 1:
        return (f"{name} has {model.n_layer_nextn} nextn layers, but llama.cpp's {model.arch} MTP graph supports exactly "
                "one (chained heads need mimo2, step35 or hy-v3)")
    if model.arch != "gemma4-assistant" and not gguf_is_mtp_draft(model.path):
        return (f"{name} declares {model.n_layer_nextn} nextn layer(s) but has no nextn tensors (blk.N.nextn.eh_proj): "
                "the MTP head was stripped from this file")
    if loaded_with_mtp is None:
        loaded_with_mtp = bool(getattr(model, "load_mtp", False))
    if not loaded_with_mtp and model.arch != "gemma4-assistant":
        return f"{name} was loaded without its nextn layers: load it with load_mtp=True"
    gone = ext.missing(ext.NEEDS["draft-mtp"])
    if gone:
        return f"this llama.cpp build does not export {', '.join(gone)}"
    return None


def gguf_layout(path):
    """``(architecture, header getter, tensor names)`` of a GGUF (header only), or None when unreadable."""
    from ..models.gguf_io import open_gguf

    try:
        with open_gguf(path) as (lay, _):
            arch = lay.get("general.architecture")
            return (arch if isinstance(arch, str) else None), lay.get, {t.name for t in lay.tensors}
    except (LlamaSpecError, OSError):
        return None


def gguf_is_mtp_head_only(path) -> bool:
    """Whether the GGUF at ``path`` holds only an MTP head (nextn blocks, no trunk: ``blk.0.attn_norm.weight``
    missing, as llama.cpp's loaders test). Such a file runs only as ``-md`` of draft-mtp: any other context on it
    has no trunk weights and crashes llama.cpp."""
    lay = gguf_layout(path)
    if lay is None or lay[0] is None:
        return False
    arch, get, names = lay
    n = get(f"{arch}.nextn_predict_layers")
    return isinstance(n, int) and n > 0 and "blk.0.attn_norm.weight" not in names


def gguf_is_mtp_draft(path, lay=None) -> bool:
    """llama.cpp's draft-type detection for a ``-md`` file (§1.1): an architecture other than dflash whose
    last block (``<arch>.block_count - 1``) has ``nextn.eh_proj.weight`` (``lay``: its :func:`gguf_layout`)."""
    lay = gguf_layout(path) if lay is None else lay
    if lay is None or lay[0] is None or lay[0] == "dflash":
        return False
    arch, get, names = lay
    n = get(f"{arch}.block_count")
    return isinstance(n, int) and n > 0 and f"blk.{n - 1}.nextn.eh_proj.weight" in names


class DraftMTP(ModelDrafter):
    """The MTP context's memory (``mem``): chained heads re-decode a sequence's rows under each head after
    trimming it (a KV cache always can: a refusal is a bug and raises MemoryOpError). A memory shared with the
    target (gemma4-assistant) is never trimmed here: its draft steps all sit at ``pos0``, and the draft
    rollback's trims of it are no-ops that succeed (§6.2)."""

    type = "draft-mtp"
    ctx_name = "MTP context"

    def __init__(self, n_seq: int, params: DraftModelParams, ctx_tgt: llama.Context, ctx_dft: llama.Context):
        super().__init__(n_seq, params, ctx_tgt, ctx_dft)
        ext.require("draft-mtp")
        if ctx_dft.params.ctx_type != llama.CONTEXT_TYPE_MTP:
            raise UsageError("draft-mtp needs an MTP context (ctx_type=CONTEXT_TYPE_MTP) as its draft context")
        self.n_embd = int(ctx_dft.model.n_embd_out)
        if self.n_embd != int(ctx_tgt.model.n_embd_out):
            raise UsageError(
                f"draft-mtp: the MTP head {ctx_dft.model.path.name} reads rows of width {self.n_embd}, the target "
                f"{ctx_tgt.model.path.name} gives {ctx_tgt.model.n_embd_out}: the head does not belong to this target"
            )
        if ctx_tgt.n_batch > ctx_dft.n_batch:
            raise UsageError(f"draft-mtp: the MTP context's batch ({ctx_dft.n_batch}) is smaller than the target's "
                             f"({ctx_tgt.n_batch})")
        self.n_mtp_layers = max(1, int(ctx_dft.model.n_layer_nextn))
        ext.set_embeddings_nextn(ctx_tgt, True, False)
        ext.set_embeddings_nextn(ctx_dft, True, True)
        self.is_mem_shared = ext.ctx_other_is(ctx_dft, ctx_tgt)
        self.chain_heads = self.n_mtp_layers > 1 and not self.is_mem_shared
        if self.chain_heads:
            self.n_max = min(self.n_max, self.n_mtp_layers)
        z = np.zeros(self.n_embd, dtype=np.float32)
        self.pending_h = [z.copy() for _ in range(n_seq)]
        self.verify_h: list[np.ndarray | None] = [None] * n_seq
        self.verify_rows = [0] * n_seq
        self.i_last = [-1] * n_seq

    # -- protocol ---------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        if not self.is_mem_shared:
            self._check_begin(seq_id, prompt)

    def _set_offset(self, off: int) -> None:
        ext.set_nextn_layer_offset(self.ctx_dft, off)

    def process(self, rows: Sequence[llama.Row]) -> bool:
        n = len(rows)
        if n == 0 or rows[0].token is None or rows[0].embd is not None:
            return True
        beg = [-1] * self.n_seq
        end = [-1] * self.n_seq
        for k, r in enumerate(rows):
            s = r.seq_id
            if 0 <= s < self.n_seq:
                end[s] = k
                if beg[s] < 0:
                    beg[s] = k
        try:
            h_tgt = ext.get_embeddings_nextn(self.ctx_tgt, n, self.n_embd)
        except LlamaSpecError as e:
            log.error("draft-mtp: no nextn rows from the target decode: %s", e)
            return False
        if not self.is_mem_shared:
            batch = [
                llama.Row(r.token, r.pos, r.seq_id, False,
                          embd=self.pending_h[r.seq_id] if k == beg[r.seq_id] else h_tgt[k - 1])
                for k, r in enumerate(rows)
            ]
            try:
                for head in range(self.n_mtp_layers):
                    if self.chain_heads:
                        for s in range(self.n_seq):
                            if beg[s] >= 0:
                                self.mem.trim(s, rows[beg[s]].pos)
                        self._set_offset(head)
                    self.ctx_dft.decode(batch)
            except DecodeError as e:
                log.error("draft-mtp: MTP catch-up decode failed (pos %d): %s", rows[0].pos, e)
                return False
            finally:
                if self.chain_heads:
                    self._set_offset(0)
        for s in range(self.n_seq):
            if end[s] < 0:
                continue
            vh = h_tgt[beg[s] : end[s] + 1].copy()
            self.verify_rows[s] = len(vh)
            self.verify_h[s] = vh
            self.pending_h[s] = vh[-1].copy()
        return True

    def draft(self, params: Sequence[DraftParams]) -> None:
        ctx = self.ctx_dft
        drafting = [False] * self.n_seq
        requested: list[int] = []
        batch: list[llama.Row] = []
        chain_h: dict[int, list[np.ndarray]] = {}
        for s, dp in enumerate(params):
            if not dp.drafting:
                continue
            drafting[s] = True
            requested.append(s)
            self.i_last[s] = len(batch)
            batch.append(llama.Row(dp.id_last, dp.pos0, s, True, embd=self.pending_h[s]))
            if self.chain_heads:
                chain_h[s] = [self.pending_h[s]]
        if not requested:
            return
        n_drafting = len(requested)
        i = 0
        try:
            while n_drafting > 0:
                if self.chain_heads:
                    for s in requested:
                        if drafting[s]:
                            self.mem.trim(s, params[s].pos0)
                    self._set_offset(i)
                try:
                    ctx.decode(batch)
                except DecodeError as e:
                    log.warning("draft-mtp: draft decode %d failed: %s", i, e)
                    break
                batch = []
                for s in requested:
                    if not drafting[s]:
                        continue
                    dp = params[s]
                    p_min = dp.p_min_or(self.params.p_min)
                    tok, p = top_candidate(ctx.logits(self.i_last[s]), p_min > 0.0, self._suppress)
                    h = ext.get_embeddings_nextn_ith(ctx, self.i_last[s], self.n_embd)
                    if p < p_min:
                        drafting[s] = False
                        n_drafting -= 1
                        continue
                    dp.result.append(tok)
                    # llama.cpp stops at its own n_max; the caller's cap (dp.n_max) is applied by the chain, and
                    # stopping there too changes no draft
                    if len(dp.result) >= self.n_max or (dp.n_max > 0 and len(dp.result) >= dp.n_max):
                        drafting[s] = False
                        n_drafting -= 1
                        continue
                    if self.chain_heads:
                        chain_h[s].append(h)
                        k = len(dp.result) + 1
                        for t in range(k):
                            tt = dp.id_last if t == 0 else dp.result[t - 1]
                            self.i_last[s] = len(batch)
                            batch.append(llama.Row(tt, dp.pos0 + t, s, t == k - 1, embd=chain_h[s][t]))
                    elif self.is_mem_shared:
                        self.i_last[s] = len(batch)
                        batch.append(llama.Row(tok, dp.pos0, s, True, embd=h))
                    else:
                        self.i_last[s] = len(batch)
                        batch.append(llama.Row(tok, dp.pos0 + i + 1, s, True, embd=h))
                if not batch:
                    break
                i += 1
        finally:
            if self.chain_heads:
                self._set_offset(0)
        self._drop_short(params, requested)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        if not 0 <= seq_id < self.n_seq:
            return
        n = self.verify_rows[seq_id]
        if n <= 0 or self.verify_h[seq_id] is None:
            return
        self.pending_h[seq_id] = self.verify_h[seq_id][min(n_accepted, n - 1)].copy()

    def reset(self, seq_id: int) -> None:
        self.verify_rows[seq_id] = 0
        self.verify_h[seq_id] = None


def mtp_context(model: "llama.Model", ctx_tgt: llama.Context, n_parallel: int, common: dict) -> llama.Context:
    """The draft context of draft-mtp (§5.3): type MTP on ``model`` (the target itself, or an MTP GGUF),
    ``n_ctx`` of the target context, no recurrent snapshots, one output row per sequence, ``ctx_other`` = the
    target. :class:`UsageError` (one line, before any native call) when ``model`` cannot carry one."""
    why = mtp_support(model)
    if why is not None:
        raise UsageError(f"draft-mtp: {why}")
    if model is not ctx_tgt.model and int(model.n_embd_out) != int(ctx_tgt.model.n_embd_out):
        raise UsageError(f"draft-mtp: {model.path.name} (n_embd_out {model.n_embd_out}) is not an MTP head of "
                         f"{ctx_tgt.model.path.name} (n_embd_out {ctx_tgt.model.n_embd_out})")
    kw = dict(common)
    kw["n_ctx"] = ctx_tgt.n_ctx
    return llama.Context(model, llama.ContextParams(ctx_type=llama.CONTEXT_TYPE_MTP, n_rs_seq=0,
                                                    n_outputs_max=n_parallel, n_outputs_max_per_seq=1, **kw),
                         ctx_other=ctx_tgt)
