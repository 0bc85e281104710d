"""``draft-dflash`` and ``draft-dspark``: block-diffusion drafts reading target layers (§4.5 / §4.6).

One implementation; ``dspark`` selects DSpark (DFlash + a Markov head biasing the block's logits, and an
optional confidence head).

``process`` (after every target decode): the target's layer inputs for the ``target_layers`` are gathered
row by row and *injected* into the draft context at the target's own positions: an embedding batch (width
``len(ids) * n_embd_tgt``, no outputs) that the draft graph fuses (fc + norm) and writes into its KV cache.

``draft``: one block per drafting sequence, ``id_last`` at ``pos0`` followed by mask tokens, decoded in one
batch with non-causal attention (unless the head says ``dflash.attention.causal``). Then per sequence:

* DFlash: rows 1.. are the drafts (top candidate, stop before ``p < p_min``);
* DSpark: rows from 0 (``sample_from_anchor``, the default) or 1, the Markov-biased top candidate without a
  ``p`` check; with ``p_min > 0`` the confidence head's value of a row below ``p_min`` ends the draft;
* DFlash2 (a selector lattice, ``selector_top_k > 0``): candidates and pairwise scores come from the nextn
  rows; the best path is followed greedily, and with ``p_min > 0`` a low-confidence step ends the draft.

Clamps (llama.cpp): ``n_max`` and ``n_min`` are at most ``block_size`` (DSpark sampling from the anchor) or
``block_size - 1``. DSpark with ``p_min > 0`` needs a confidence head. No per-sequence state.
"""
from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from .. import _llama as llama
from .._llama import ext
from ..errors import DecodeError, UsageError
from ..params import DraftModelParams
from .base import DraftParams, drop_short, seq_spans
from .draft_model import ModelDrafter, top_candidate
from .eagle3 import check_head_target

log = logging.getLogger("llamaspec")


class DFlash(ModelDrafter):
    type = "draft-dflash"

    def __init__(self, n_seq: int, params: DraftModelParams, ctx_tgt: llama.Context, ctx_dft: llama.Context,
                 *, dspark: bool = False):
        if dspark:
            self.type = "draft-dspark"
        super().__init__(n_seq, params, ctx_tgt, ctx_dft)
        m_tgt, m_dft = ctx_tgt.model, ctx_dft.model
        if m_dft.arch != "dflash":
            raise UsageError(f"{self.type} needs a DFlash head as draft (-md), {m_dft.path.name} is {m_dft.arch}")
        ext.require(self.type)
        ids = ext.model_target_layer_ids(m_dft)
        if not ids:
            raise UsageError(f"DFlash draft {m_dft.path.name} has no target layer ids (dflash.target_layers)")
        check_head_target("DFlash", m_tgt, m_dft, ids, nextn_for_last=False)
        self.dspark = dspark
        self.ids = list(ids)
        self.n_embd_tgt = m_tgt.n_embd
        self.n_embd_dec = m_dft.n_embd
        bs = m_dft.meta("dflash.block_size")
        try:
            self.block_size = int(bs) if bs is not None else 16
        except ValueError:
            self.block_size = 0
        if self.block_size < 1:
            raise UsageError(f"DFlash draft {m_dft.path.name} has an invalid dflash.block_size {bs!r}")
        anchor = m_dft.meta("dflash.sample_from_anchor")
        self.sample_from_anchor = anchor is None or anchor == "true"
        self.causal_attn = m_dft.meta("dflash.attention.causal") == "true"
        self.selector_top_k = ext.dflash_selector_top_k(m_dft)
        self.is_dflash2 = self.selector_top_k > 0
        self.mask_token = ext.vocab_mask(m_dft)
        if self.mask_token < 0:
            raise UsageError(f"DFlash draft {m_dft.path.name} has no mask token (tokenizer.ggml.mask_token_id)")
        if dspark and params.p_min > 0:
            conf = m_dft.meta("dflash.has_confidence_head")
            if conf is not None and conf != "true":
                raise UsageError("DSpark draft has no confidence head: please set --spec-draft-p-min 0")
        n_draft_max = self.block_size if (dspark and self.sample_from_anchor) else self.block_size - 1
        self.n_min = params.n_min
        if self.n_max > n_draft_max:
            log.warning("%s: n_max %d clamped to %d (block size %d)", self.type, self.n_max, n_draft_max, self.block_size)
            self.n_max = n_draft_max
        if self.n_min > n_draft_max:
            log.warning("%s: n_min %d clamped to %d (block size %d)", self.type, self.n_min, n_draft_max, self.block_size)
            self.n_min = n_draft_max
        n_block = self.n_max + (0 if (dspark and self.sample_from_anchor) else 1)
        if dspark and n_seq * n_block > ctx_dft.n_ubatch:  # llama.cpp asserts on a block split across ubatches
            raise UsageError(f"draft-dspark decodes {n_seq} blocks of {n_block} rows in one ubatch, the draft context "
                             f"has n_ubatch={ctx_dft.n_ubatch}: raise -ub or lower -np / --spec-draft-n-max")
        for lid in self.ids:
            ext.set_embeddings_layer_inp(ctx_tgt, lid, True)
        ext.set_embeddings_nextn(ctx_dft, True, masked=not self.is_dflash2)
        ext.set_causal_attn(ctx_dft, self.causal_attn)

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        self._check_begin(seq_id, prompt)  # (read only: the draft rollback trims)

    def process(self, rows: Sequence[llama.Row]) -> bool:
        if not rows:
            return True
        has_tok = rows[0].token is not None
        has_embd = rows[0].embd is not None
        if has_tok == has_embd:
            return True
        n = len(rows)
        spans = seq_spans(rows)
        try:
            feats = np.concatenate([ext.get_embeddings_layer_inp(self.ctx_tgt, lid, n, self.n_embd_tgt)
                                    for lid in self.ids], axis=1)
        except (DecodeError, UsageError) as e:
            log.error("%s: reading the target features failed: %s", self.type, e)
            return False
        ctx = self.ctx_dft
        step = max(1, min(ctx.n_ubatch, ctx.n_batch))
        try:
            for seq, (beg, end) in spans.items():
                n_rows = end - beg + 1
                if has_embd and n_rows > 1 and rows[beg].pos == rows[end].pos:
                    continue  # an image pinned to one position (M-RoPE)
                for off in range(0, n_rows, step):
                    k = min(step, n_rows - off)
                    ctx.decode([llama.Row(None, rows[beg + off + i].pos, seq, False, embd=feats[beg + off + i])
                                for i in range(k)])
        except DecodeError as e:
            log.error("%s: injecting the target features into the draft context failed: %s", self.type, e)
            return False
        return True

    def draft(self, params: Sequence[DraftParams]) -> None:
        ctx = self.ctx_dft
        active = [s for s, dp in enumerate(params) if dp.drafting]
        if not active:
            return
        anchor_block = self.dspark and self.sample_from_anchor
        n_block = self.n_max + (0 if anchor_block else 1)
        if n_block < 1:
            return
        out = not self.is_dflash2
        rows: list[llama.Row] = []
        beg: dict[int, int] = {}
        for s in active:
            dp = params[s]
            beg[s] = len(rows)
            for i in range(n_block):
                rows.append(llama.Row(dp.id_last if i == 0 else self.mask_token, dp.pos0 + i, s, out))
        if not self._logged("draft decode", lambda: ctx.decode(rows)):
            return
        n_rows = len(rows)
        for s in active:
            dp = params[s]
            b = beg[s]
            p_min = dp.p_min_or(self.params.p_min)
            if self.is_dflash2:
                self._draft_lattice(dp, b, n_block, n_rows, p_min)
            elif self.dspark:
                conf = ext.get_embeddings_nextn(ctx, n_rows, self.n_embd_dec) if p_min > 0 else None
                for i in range(0 if self.sample_from_anchor else 1, n_block):
                    idx = b + i
                    if conf is not None and conf[idx, 0] < p_min:
                        break
                    tok, _ = top_candidate(ctx.logits(idx), False, self._suppress)
                    dp.result.append(tok)
            else:
                for i in range(1, n_block):
                    tok, p = top_candidate(ctx.logits(b + i), p_min > 0.0, self._suppress)
                    if p < p_min:
                        break
                    dp.result.append(tok)
            drop_short(dp, dp.n_min_or(self.n_min))

    def _draft_lattice(self, dp: DraftParams, b: int, n_block: int, n_rows: int, p_min: float) -> None:
        """DFlash2: row i of the nextn output holds K candidate ids, then K x K transition scores."""
        K = self.selector_top_k
        lat = ext.get_embeddings_nextn(self.ctx_dft, n_rows, self.n_embd_dec)
        pred = 0
        for i in range(1, n_block):
            row = lat[b + i]
            scores = row[K + pred * K: K + pred * K + K].astype(np.float64)
            pred = int(np.argmax(scores))
            if p_min > 0:
                conf = 1.0 / float(np.exp(scores - scores[pred]).sum())
                if conf < p_min:
                    break
            dp.result.append(int(row[pred]))
