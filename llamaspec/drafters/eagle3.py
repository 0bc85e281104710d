"""``draft-eagle3``: an EAGLE-3 head reading three target layers (§4.3).

Convention: the head's decoder at position P consumes the pair (token at P+1, ``g_P``), where ``g_P`` is the
encoder output (``fc``) of the target's hidden features at P (the inputs of the three ``target_layers``,
concatenated). The last row of every target batch cannot be written yet, because its next token is not known:
it is *deferred* (``pending_pos`` / ``pending_g`` per sequence) and written either as the first row of the
next draft (``id_last`` at ``pending_pos``) or as the bridge row of the next processed batch.

``process`` (after every target decode): encode the batch's features in chunks of the draft's ``n_ubatch``
(placeholder positions on seq 0; the encoder has no memory), then decode one batch per call holding, per
sequence, the bridge row (if the deferred row was never drafted from) and ``(token[k+1], pos[k], g[k])``
for every row but the last. ``verify_g`` keeps the batch's ``g`` rows so that ``accept`` can move the
deferred row to the last accepted position.

``draft``: per drafting sequence, drop the draft memory from ``pending_pos`` on, decode ``(id_last,
pending_pos, pending_g)``, then extend one token per step, feeding the draft's own pre-norm state (the
``nextn`` output) back as the next ``g``. Tokens are the top candidate of ``top_k(10)`` over the draft
logits (suppress tokens excluded); ``p_min`` stops a draft before a low-probability token; the length cap
is the drafter's own ``n_max`` and the request's, then ``n_min``.

``get_state``/``set_state`` (prompt checkpoints, §7.6) carry ``pending_pos`` + ``pending_g`` and are
active only for recurrent / hybrid targets.

Features: an id below the target's ``n_layer`` is that layer's input; an id equal to ``n_layer`` is the
target's nextn hidden state (``llama_get_embeddings_nextn``, unmasked). A target whose graph does not write
that state (a llama target, say) is not refused, as llama.cpp does not refuse it: the head reads the same
unwritten buffer llama.cpp reads (zeros after each reallocation, else stale outputs of earlier decodes) and
one warning says so (:func:`nextn_warning`, decided by probing the loaded target: :func:`target_writes_nextn`).
"""
from __future__ import annotations

import ctypes
import logging
import struct
from typing import Sequence

import numpy as np

from .. import _llama as llama
from .._llama import ext
from ..errors import DecodeError, LlamaSpecError, UsageError
from ..params import DraftModelParams
from .base import DraftParams, seq_spans
from .draft_model import ModelDrafter, top_candidate

log = logging.getLogger("llamaspec")

#: target architectures whose graph exposes layer inputs (§12.1). This stays a list: enabling a layer input
#: the graph does not set makes llama.cpp abort ('layer input tensor is null'), so it cannot be probed
LAYER_INP_ARCHS = frozenset({
    "llama", "qwen3", "qwen3moe", "qwen3next", "qwen35", "qwen35moe", "qwen4exp", "gemma4", "muse-glimmer",
    "deepseek4", "nemotron_h", "bailingmoe3", "gpt-oss", "lfm2", "minimax-01", "minimax-m2", "mimo2",
    "nanbeige", "hunyuan_vl",
})
#: ... and those that also give layer id == n_layer (the final hidden state) as a layer input (DFlash)
LAYER_INP_LAST_ARCHS = frozenset({"deepseek4", "mimo2", "nemotron_h"})
#: architectures whose graph writes the nextn hidden state (EAGLE-3 ids == n_layer read it). Only a fallback:
#: :func:`target_writes_nextn` asks the loaded target itself, this list answers when no scratch context can
#: be made on it
NEXTN_ARCHS = frozenset({
    "bailingmoe3", "cohere2moe", "deepseek2", "deepseek32", "deepseek4", "gemma4", "glm-dsa", "glm4moe",
    "glm5-next", "hy-v3", "mimo2", "nemotron_h", "nemotron_h_moe", "gpt-oss", "qwen35", "qwen35moe",
    "qwen3next", "step35",
})


def check_head_target(kind: str, model_tgt: "llama.Model", model_dft: "llama.Model", ids: Sequence[int],
                      *, nextn_for_last: bool) -> None:
    """One :class:`UsageError` line when the target cannot feed the head (never a native abort).

    An EAGLE-3 id == n_layer (``nextn_for_last``) is never refused: llama.cpp reads the target's nextn
    output buffer for it whether or not the target's graph writes it (see :func:`nextn_warning`)."""
    arch = model_tgt.arch
    n_layer = model_tgt.n_layer
    name = f"{kind} draft {model_dft.path.name}"
    if arch not in LAYER_INP_ARCHS:
        raise UsageError(
            f"{name} reads target layer inputs, which the {arch} architecture of {model_tgt.path.name} does not "
            f"expose (llama.cpp supports: {', '.join(sorted(LAYER_INP_ARCHS))})")
    for lid in ids:
        if lid < 0 or lid > n_layer:
            raise UsageError(f"{name} reads target layer {lid}, but {model_tgt.path.name} has {n_layer} layers "
                             f"(valid ids 0..{n_layer - 1}): the head was made for another target")
        if lid == n_layer and not nextn_for_last and arch not in LAYER_INP_LAST_ARCHS:
            raise UsageError(f"{name} reads target layer {lid} = n_layer (the final hidden state), which the "
                             f"{arch} target {model_tgt.path.name} does not expose as a layer input "
                             "(llama.cpp would abort: 'layer input tensor is null'); use a head made for this target")


def target_writes_nextn(model: "llama.Model") -> bool | None:
    """Whether decoding on ``model`` writes the nextn hidden state (``llama_get_embeddings_nextn``), asked of
    the loaded model on a one-row scratch context; None when no such context can be made. Cached per model.

    The nextn output rows live in the context's host output buffer, which llama.cpp zero-fills only when it
    (re)allocates it; a graph that sets no nextn tensor leaves the rows as they were. The probe decodes once
    (the buffer is allocated), fills row 0 with NaN, decodes again with the same shape (no reallocation)
    and looks whether the decode overwrote the NaNs."""
    got = getattr(model, "_writes_nextn", ...)
    if got is not ...:
        return got
    got = None
    try:
        got = _probe_nextn(model)
    except LlamaSpecError as e:
        log.debug("nextn probe of %s: no scratch context (%s); using the architecture list", model.path.name, e)
    model._writes_nextn = got
    return got


def _probe_nextn(model: "llama.Model") -> bool:
    width = int(model.n_embd_out)
    tok = min(10, model.vocab.n_tokens - 1)
    n_ctx = max(16, min(64, model.n_ctx_train)) if model.n_ctx_train > 0 else 64
    get = ext.fn("llama_get_embeddings_nextn")
    with llama.Context(model, n_ctx=n_ctx, n_batch=1, n_ubatch=1, n_seq_max=1) as ctx:
        ext.set_embeddings_nextn(ctx, True, masked=False)
        ctx.decode([llama.Row(tok, 0, 0, True)])  # allocates the output buffer with its nextn rows
        p0 = get(ctx.live_ptr())
        if not p0:
            raise DecodeError("no nextn buffer after a decode with nextn enabled")
        np.ctypeslib.as_array(p0, shape=(width,))[:] = np.nan
        ctx.decode([llama.Row(tok, 1, 0, True)])
        p1 = get(ctx.live_ptr())
        row = np.ctypeslib.as_array(p1, shape=(width,)).copy()
        same = ctypes.cast(p0, ctypes.c_void_p).value == ctypes.cast(p1, ctypes.c_void_p).value
    # a reallocated buffer (not expected with the same batch shape) is zero-filled: only a write makes it non-zero
    return bool(not np.isnan(row).all()) if same else bool(np.any(row != 0))


def nextn_warning(model_tgt: "llama.Model", model_dft: "llama.Model", ids: Sequence[int]) -> str | None:
    """The warning line for an EAGLE-3 head reading id == n_layer of a target that does not write its nextn
    hidden state (None when it does, or when the head reads no such id).

    llama.cpp runs such a pair: it reads the target's nextn output buffer, which then holds zeros after each
    (re)allocation and otherwise stale bytes of earlier decodes (logits rows of a batch with more outputs,
    layer-input rows of an earlier buffer layout). The drafter reads the same buffer, so it drafts as
    llama.cpp does; acceptance is low for a head that really uses that layer."""
    n_layer = model_tgt.n_layer
    if n_layer not in ids:
        return None
    writes = target_writes_nextn(model_tgt)
    if writes is None:
        writes = model_tgt.arch in NEXTN_ARCHS
    if writes:
        return None
    return (f"EAGLE-3 draft {model_dft.path.name} reads target layer {n_layer} = n_layer (the nextn hidden state), "
            f"which the {model_tgt.arch} target {model_tgt.path.name} does not provide: that feature is the "
            "target's unwritten output buffer (zeros or stale outputs, as in llama.cpp), acceptance will be low")


class Eagle3(ModelDrafter):
    type = "draft-eagle3"

    def __init__(self, n_seq: int, params: DraftModelParams, ctx_tgt: llama.Context, ctx_dft: llama.Context):
        super().__init__(n_seq, params, ctx_tgt, ctx_dft)
        m_tgt, m_dft = ctx_tgt.model, ctx_dft.model
        if m_dft.arch != "eagle3":
            raise UsageError(f"draft-eagle3 needs an EAGLE-3 head as draft (-md), {m_dft.path.name} is {m_dft.arch}")
        ext.require("draft-eagle3")
        ids = ext.model_target_layer_ids(m_dft)
        if len(ids) != 3:
            raise UsageError(f"draft model {m_dft.path.name} is not eagle3: it has {len(ids)} target layer ids, not 3")
        check_head_target("EAGLE-3", m_tgt, m_dft, ids, nextn_for_last=True)
        warning = nextn_warning(m_tgt, m_dft, ids)
        if warning:
            log.warning("draft-eagle3: %s", warning)
        hidden = m_dft.meta("eagle3.target_hidden_size")
        if hidden is not None and int(hidden) != m_tgt.n_embd:
            raise UsageError(f"EAGLE-3 draft {m_dft.path.name} was made for a target with n_embd={hidden}, "
                             f"{m_tgt.path.name} has {m_tgt.n_embd}: use the head made for this target")
        self.ids = list(ids)
        self.n_layer_tgt = m_tgt.n_layer
        self.n_embd_tgt = m_tgt.n_embd
        self.n_embd_dec = m_dft.n_embd
        for lid in self.ids:
            if lid < self.n_layer_tgt:
                ext.set_embeddings_layer_inp(ctx_tgt, lid, True)
            else:
                ext.set_embeddings_nextn(ctx_tgt, True, masked=False)
        ext.set_embeddings_nextn(ctx_dft, True, masked=True)
        self.stateful = bool(m_tgt.is_recurrent or m_tgt.is_hybrid)
        z = np.zeros(self.n_embd_dec, np.float32)
        self.pending_g = [z.copy() for _ in range(n_seq)]
        self.pending_pos = [-1] * n_seq
        self.verify_g: list[np.ndarray | None] = [None] * n_seq
        self.verify_pos_first = [-1] * n_seq
        self.verify_rows = [0] * n_seq

    # -- features -------------------------------------------------------------------------------
    def _features(self, n: int) -> np.ndarray:
        parts = []
        for lid in self.ids:
            if lid < self.n_layer_tgt:
                parts.append(ext.get_embeddings_layer_inp(self.ctx_tgt, lid, n, self.n_embd_tgt))
            else:
                parts.append(ext.get_embeddings_nextn(self.ctx_tgt, n, self.n_embd_tgt))
        return np.concatenate(parts, axis=1)

    def _encode(self, feats: np.ndarray) -> np.ndarray:
        """``g`` rows of the draft encoder (fc) for ``feats``, in chunks of the draft's ``n_ubatch``.

        Every chunk goes on sequence 0 at placeholder positions from ``pos_max(seq 0) + 1``, whatever the
        sequences of the rows: that is llama.cpp's own encode batch (§4.3), kept as is. The encoder
        (fc) has no memory and its output row ``i`` depends only on feature row ``i``, so neither the
        sequence nor the position of a row changes ``g``; ``process`` reads the rows back by batch index."""
        ctx = self.ctx_dft
        n = feats.shape[0]
        g = np.empty((n, self.n_embd_dec), np.float32)
        step = max(1, min(ctx.n_ubatch, ctx.n_batch))
        for i0 in range(0, n, step):
            k = min(step, n - i0)
            p0 = self.mem.pos_max(0) + 1
            rows = [llama.Row(None, p0 + j, 0, True, embd=feats[i0 + j]) for j in range(k)]
            ctx.decode(rows, kind=llama.PROCESS_ENCODE)
            g[i0:i0 + k] = ext.get_embeddings_nextn(ctx, k, self.n_embd_dec)
        return g

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, seq_id: int, prompt: Sequence[int]) -> None:
        self._check_begin(seq_id, prompt, lag=2)  # (the last row is deferred)

    def reset(self, seq_id: int) -> None:
        self.pending_pos[seq_id] = -1
        self.pending_g[seq_id] = np.zeros(self.n_embd_dec, np.float32)
        self.verify_rows[seq_id] = 0
        self.verify_g[seq_id] = None
        self.verify_pos_first[seq_id] = -1

    def process(self, rows: Sequence[llama.Row]) -> bool:
        if not rows or rows[0].token is None or rows[0].embd is not None:
            return True
        n = len(rows)
        spans = seq_spans(rows)
        try:
            g = self._encode(self._features(n))
        except (DecodeError, UsageError) as e:
            log.error("draft-eagle3: encoding the target features failed: %s", e)
            return False
        mem = self.mem
        out: list[llama.Row] = []
        for seq, (beg, end) in spans.items():
            pp = self.pending_pos[seq]
            if pp >= 0 and pp + 1 == rows[beg].pos and pp > mem.pos_max(seq):
                out.append(llama.Row(rows[beg].token, pp, seq, False, embd=self.pending_g[seq]))
            for k in range(beg, end):
                out.append(llama.Row(rows[k + 1].token, rows[k].pos, seq, False, embd=g[k]))
            self.verify_pos_first[seq] = rows[beg].pos
            self.pending_pos[seq] = rows[end].pos
            self.verify_rows[seq] = end - beg + 1
            self.verify_g[seq] = g[beg:end + 1].copy()
            self.pending_g[seq] = g[end].copy()
        def decode() -> None:
            for chunk in llama.chunks(out, self.ctx_dft.n_batch):
                self.ctx_dft.decode(chunk)

        return self._logged("decoding the target batch into the draft context", decode, logging.ERROR)

    def draft(self, params: Sequence[DraftParams]) -> None:
        ctx = self.ctx_dft
        requested = [s for s, dp in enumerate(params) if dp.drafting]
        active = [s for s in requested if self.pending_pos[s] >= 0]
        if not active:
            return
        rows = []
        for s in active:
            self.mem.trim(s, self.pending_pos[s])
            rows.append(llama.Row(params[s].id_last, self.pending_pos[s], s, True, embd=self.pending_g[s]))

        def pick(k: int, s: int, dp: DraftParams) -> tuple[int, float]:
            return top_candidate(ctx.logits(k), dp.p_min_or(self.params.p_min) > 0.0, self._suppress)

        def next_row(k: int, s: int, dp: DraftParams, i: int, tok: int) -> llama.Row:
            # the draft's own pre-norm state (its nextn output) is the next g
            prenorm = ext.get_embeddings_nextn_ith(ctx, k, self.n_embd_dec)
            return llama.Row(tok, self.pending_pos[s] + i + 1, s, True, embd=prenorm)

        self._draft_steps(params, active, rows, pick, next_row,
                          lambda rows: self._logged("draft decode", lambda: ctx.decode(rows)))
        self._drop_short(params, requested)

    def accept(self, seq_id: int, n_accepted: int, is_other: bool) -> None:
        rows = self.verify_rows[seq_id]
        if rows > 0 and self.verify_g[seq_id] is not None:
            i = min(n_accepted, rows - 1)
            self.pending_pos[seq_id] = self.verify_pos_first[seq_id] + i
            self.pending_g[seq_id] = self.verify_g[seq_id][i].copy()

    def get_state(self, seq_id: int) -> bytes | None:
        if not self.stateful or self.pending_pos[seq_id] < 0:
            return None
        return struct.pack("<i", self.pending_pos[seq_id]) + self.pending_g[seq_id].astype("<f4").tobytes()

    def set_state(self, seq_id: int, data: bytes) -> None:
        if not self.stateful or len(data) != 4 + 4 * self.n_embd_dec:
            return
        self.pending_pos[seq_id] = struct.unpack("<i", data[:4])[0]
        self.pending_g[seq_id] = np.frombuffer(data[4:], dtype="<f4").astype(np.float32)
