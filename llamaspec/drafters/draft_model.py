"""``draft-simple``: a standalone small language model as drafter (§4.2).

The draft context mirrors every target batch (``process``: same rows, output only on the last row), so its
memory holds the same committed tokens as the target. ``draft`` decodes ``id_last`` of every drafting
sequence in one batch, then extends all of them together, one token per step, taking the **top candidate**
of the draft distribution (llama.cpp's draft sampler is ``top_k(10) -> dist``, but the drafted token is
the best candidate, never the random one). ``p`` of that token is the softmax over the 10 best logits; a
draft stops before a token with ``p < p_min``.

Beyond llama.cpp (for rejection-sampling verification, :func:`llamaspec.verify.rules.rejection_verify`): when a sequence is
configured with a temperature > 0, the draft **samples** from ``top_k -> temperature`` with its own random
stream (seed XOR 0x85ebca6b) and records that distribution (sparse ``(ids, probs)`` of its top-k candidates)
per drafted token in ``DraftParams.probs``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .. import _llama as llama
from ..errors import DecodeError, UsageError, VocabMismatchError
from ..memory import SeqMemory
from ..params import DraftModelParams
from ..models.trim import SOURCE_IDS_KEY, SOURCE_N_KEY, source_ids
from .vocab_slots import VocabSlots
from ..vocab import check_vocab_compat, incompatibility_message, is_compatible
from .base import DraftParams, Drafter, drop_short, suppress_array

log = logging.getLogger("llamaspec")

DRAFT_TOP_K = 10
SEED_MIX = 0x85EBCA6B
#: :meth:`ModelDrafter._draft_steps`' ``pick(k, s, dp) -> (token, p)`` and ``next_row(k, s, dp, i, token)``
Pick = Callable[[int, int, DraftParams], "tuple[int, float]"]
NextRow = Callable[[int, int, DraftParams, int, int], llama.Row]


def top_candidate(logits: np.ndarray, need_p: bool, suppress: np.ndarray | None = None) -> tuple[int, float]:
    """Best token and its probability under softmax of the 10 best logits (temperature 1); ``suppress``
    tokens (the vocabulary's suppress list, a -inf logit bias in llama.cpp) are never picked.

    >>> top_candidate(np.array([0.0, 2.0, 1.0], dtype=np.float32), True)
    (1, 0.66524...)
    >>> top_candidate(np.array([0.0, 2.0, 1.0], dtype=np.float32), False, np.array([1]))
    (2, 1.0)
    """
    if suppress is not None and suppress.size:
        logits = logits.copy()
        logits[suppress] = -np.inf
    tok = int(logits.argmax())  # (the method: np.argmax adds three Python calls per draft token)
    if not need_p:
        return tok, 1.0
    k = min(DRAFT_TOP_K, logits.shape[0])
    top = np.partition(logits, logits.shape[0] - k)[-k:].astype(np.float64)
    m = top.max()
    e = np.exp(top - m)
    return tok, float(np.exp(float(logits[tok]) - m) / e.sum())


def _id_maps(model_tgt: llama.Model, model_dft: llama.Model) -> tuple[np.ndarray | None, np.ndarray | None, int]:
    """(draft id -> target id (-1: a free row), target id -> draft id (-1: none), the draft's unknown token)
    for a draft with a trimmed vocabulary, else (None, None, 0)."""
    if model_dft.meta(SOURCE_N_KEY) is None:
        return None, None, 0
    to_tgt = source_ids(model_dft.path)
    if to_tgt is None or to_tgt.size != model_dft.vocab.n_tokens:
        raise UsageError(f"draft {model_dft.path.name} says its vocabulary is trimmed but its {SOURCE_IDS_KEY} "
                         "does not match its tokens: derive it again (delete the file)")
    n_tgt = model_tgt.vocab.n_tokens
    unk_meta = model_dft.meta("tokenizer.ggml.unknown_token_id")
    unk = int(unk_meta) if unk_meta is not None and unk_meta.isdigit() and int(unk_meta) < to_tgt.size else 0
    to_dft = np.full(max(n_tgt, int(to_tgt.max()) + 1), -1, dtype=np.int64)
    kept = np.flatnonzero(to_tgt >= 0)
    to_dft[to_tgt[kept]] = kept
    return to_tgt, to_dft, unk


class MappedVocab:
    """A trimmed draft's vocabulary seen in the target's id space, for the compatibility rules (§11):
    its size is the source vocabulary's, special ids are mapped back, and an id it does not keep reads as
    the target's own text (only kept tokens can differ)."""

    def __init__(self, model: llama.Model, to_tgt: np.ndarray, tgt: llama.Vocab):
        vocab = model.vocab
        self._v, self._tgt = vocab, tgt
        self._text = {int(t): i for i, t in enumerate(to_tgt) if t >= 0}
        self.type, self.add_bos, self.add_eos = vocab.type, vocab.add_bos, vocab.add_eos
        self.n_tokens = int(model.meta(SOURCE_N_KEY) or to_tgt.size)
        self.bos = int(to_tgt[vocab.bos]) if 0 <= vocab.bos < to_tgt.size else vocab.bos
        self.eos = int(to_tgt[vocab.eos]) if 0 <= vocab.eos < to_tgt.size else vocab.eos

    def get_text(self, token: int) -> bytes:
        i = self._text.get(token)
        return self._v.get_text(i) if i is not None else self._tgt.get_text(token)


@dataclass
class _SampleCfg:
    temp: float
    seed: int
    rng: np.random.Generator


def _seq_groups(rows: Sequence[llama.Row]) -> Iterator[tuple[int, Sequence[llama.Row]]]:
    """``(seq_id, rows)`` for each run of consecutive rows of one sequence (a batch lays each slot's rows
    together)."""
    i, n = 0, len(rows)
    while i < n:
        seq = rows[i].seq_id
        j = i
        while j < n and rows[j].seq_id == seq:
            j += 1
        yield seq, rows[i:j]
        i = j


class ModelDrafter(Drafter):
    """What the drafters on a draft context share (draft-simple, EAGLE-3, MTP, DFlash / DSpark): the checks of
    ``params`` and of the context, the context's checked memory (``mem``: the only way to its memory), the
    tokens never proposed (``_suppress``: the vocabulary's suppress list, llama.cpp's -inf logit bias), the
    prompt check of ``begin`` and ``n_min`` after a draft."""

    #: what the draft context is called in messages
    ctx_name = "draft context"

    def __init__(self, n_seq: int, params: DraftModelParams, ctx_tgt: llama.Context, ctx_dft: llama.Context):
        super().__init__(n_seq)
        if params.n_max < 0:
            raise UsageError(f"--spec-draft-n-max must be >= 0, got {params.n_max}")
        if ctx_dft.n_seq_max != n_seq:
            raise UsageError(f"{self.ctx_name} has n_seq_max={ctx_dft.n_seq_max}, the chain needs {n_seq}")
        self.params, self.ctx_tgt, self.ctx_dft, self.n_max = params, ctx_tgt, ctx_dft, params.n_max
        self.mem = SeqMemory(ctx_dft)
        self._suppress = suppress_array(ctx_dft.model.vocab.suppress_tokens)
        n_tgt, n_dft = ctx_tgt.model.n_params, ctx_dft.model.n_params
        if n_tgt > 0 and n_dft > 0:
            self.prompt_cost_ratio = n_dft / n_tgt

    def _check_begin(self, seq_id: int, prompt: Sequence[int], lag: int = 1) -> None:
        """At ``begin``: the draft context must hold the prompt but its last ``lag`` tokens (else a warning:
        the drafts degrade)."""
        pm = self.mem.pos_max(seq_id)
        if pm < len(prompt) - lag:
            log.warning("%s: the %s of seq %d holds positions up to %d, the prompt has %d tokens (was every target "
                        "batch passed to process?)", self.type, self.ctx_name, seq_id, pm, len(prompt))

    def _draft_steps(self, params: Sequence[DraftParams], active: list[int], rows: list[llama.Row], pick: "Pick",
                     next_row: "NextRow", decode: "Callable[[list[llama.Row]], bool]") -> int:
        """Drafting one token a step (draft-simple, EAGLE-3): ``rows``, one per sequence of ``active``, are
        decoded; ``pick(k, s, dp)`` is the ``(token, p)`` of output row ``k`` (sequence ``s``). A draft stops
        before a token below its ``p_min`` and at ``n_max`` (the drafter's or the request's); the others decode
        ``next_row(k, s, dp, i, token)`` (``i``: the step) together. ``decode(rows)`` False ends them all.
        Returns the decodes made."""
        n_steps = i = 0
        while rows and decode(rows):
            n_steps += 1
            rows, still = [], []
            for k, s in enumerate(active):
                dp = params[s]
                tok, p = pick(k, s, dp)
                if p < dp.p_min_or(self.params.p_min):
                    if dp.probs is not None and len(dp.probs) > len(dp.result):
                        dp.probs.pop()  # (a sampled draft recorded the distribution of the token it drops)
                    continue
                dp.result.append(tok)
                if len(dp.result) < self.n_max and not (dp.n_max > 0 and len(dp.result) >= dp.n_max):
                    rows.append(next_row(k, s, dp, i, tok))
                    still.append(s)
            active, i = still, i + 1
        return n_steps

    def _logged(self, what: str, decode: Callable[[], object], level: int = logging.WARNING) -> bool:
        """``decode()``; a :class:`DecodeError` is logged (``<type>: <what> failed: ...``) and gives False."""
        try:
            decode()
        except DecodeError as e:
            log.log(level, "%s: %s failed: %s", self.type, what, e)
            return False
        return True

    def _drop_short(self, params: Sequence[DraftParams], seqs: Sequence[int], n_min: int | None = None) -> None:
        """``n_min`` (the request's, else ``n_min``, else the drafter's own) over the drafts of ``seqs``."""
        for s in seqs:
            drop_short(params[s], params[s].n_min_or(self.params.n_min if n_min is None else n_min))


class DraftSimple(ModelDrafter):
    type = "draft-simple"
    _out0, _t_lead = 0, 0.0

    def __init__(self, n_seq: int, params: DraftModelParams, ctx_tgt: llama.Context, ctx_dft: llama.Context):
        super().__init__(n_seq, params, ctx_tgt, ctx_dft)
        #: a trimmed draft (llamaspec.models.trim): draft id -> target id, and target id -> draft id (tokens the
        #: draft does not have enter it as its unknown token; it never proposes them)
        self._to_tgt, self._to_dft, self._unk = _id_maps(ctx_tgt.model, ctx_dft.model)
        #: a trimmed draft's run-time rows for the tokens it does not keep (None: fixed tokens only)
        self.vocab_slots = (VocabSlots.open(ctx_dft.model, self._to_tgt, self._to_dft)
                            if self._to_tgt is not None else None)
        dft_vocab = ctx_dft.model.vocab if self._to_tgt is None else MappedVocab(ctx_dft.model, self._to_tgt, ctx_tgt.model.vocab)
        rules = check_vocab_compat(ctx_tgt.model.vocab, dft_vocab)
        if not is_compatible(rules):
            raise VocabMismatchError(
                incompatibility_message(rules)
                + f" (target {ctx_tgt.model.path.name}, draft {ctx_dft.model.path.name}); pick a draft model of the same family"
            )
        self._sample: list[_SampleCfg | None] = [None] * n_seq
        #: with ``reuse_kv``: per seq, (pos0, tokens decoded in the draft context by the last draft())
        self.reuse_kv = bool(params.reuse_kv)
        self._decoded: list[tuple[int, list[int]] | None] = [None] * n_seq
        #: with ``reuse_kv``: the seqs the last draft() drafted for; the target rows of the others are not
        #: mirrored (a round where the budget chose not to draft costs no draft decode), the next draft()
        #: decodes what they miss first (``_catch_up``)
        self._drafted: set[int] = set()
        # never propose what the target cannot decode: the suppress list (llama.cpp's -inf logit bias) and,
        # for a draft with the larger (padded) vocabulary, every id past the target's
        self.n_vocab_tgt = ctx_tgt.model.vocab.n_tokens
        self._refresh_suppress()

    def _refresh_suppress(self) -> None:
        n_vocab_dft = self.ctx_dft.model.vocab.n_tokens
        to_tgt = self._to_tgt
        past = (range(self.n_vocab_tgt, n_vocab_dft) if to_tgt is None
                else np.flatnonzero((to_tgt >= self.n_vocab_tgt) | (to_tgt < 0)).tolist())  # free rows too
        self._suppress = suppress_array([*self.ctx_dft.model.vocab.suppress_tokens, *past])

    def _dft_rows(self, rows: Sequence[llama.Row], out_last: bool | None = None) -> list[llama.Row]:
        """``rows`` (target ids) in the draft's ids: a trimmed draft first gives run-time rows to tokens it
        lacks (``vocab_slots``), and reads any still without one as its unknown token. ``out_last``: output
        only on the last row (True) instead of the rows' own flags (None)."""
        n = len(rows)
        if self._to_dft is None:
            return list(rows) if out_last is None else [llama.Row(r.token, r.pos, r.seq_id, i == n - 1) for i, r in enumerate(rows)]
        toks = [r.token for r in rows]
        if self.vocab_slots is not None and self.vocab_slots.ensure(toks):
            self._refresh_suppress()
        ids = self._to_dft[np.asarray(toks, dtype=np.int64)]
        ids[ids < 0] = self._unk
        return [llama.Row(int(d), r.pos, r.seq_id, r.output if out_last is None else i == n - 1)
                for i, (d, r) in enumerate(zip(ids.tolist(), rows))]

    # -- sampling mode (rejection-sampling verification) ------------------------------------------
    def configure_sampling(self, seq_id: int, temp: float, seed: int) -> None:
        """Sample drafts for ``seq_id`` at ``temp`` and record ``q`` (temp <= 0: argmax drafts, llama.cpp's
        behaviour). The stream is rebuilt only when ``(temp, seed)`` changes."""
        cur = self._sample[seq_id]
        if temp <= 0:
            self._sample[seq_id] = None
            return
        if cur is not None and cur.temp == temp and cur.seed == seed:
            return
        dseed = seed if seed == llama.DEFAULT_SEED else (seed ^ SEED_MIX)
        rng = np.random.default_rng(None if dseed == llama.DEFAULT_SEED else dseed)
        self._sample[seq_id] = _SampleCfg(temp, seed, rng)

    def _pick(self, seq_id: int, logits: np.ndarray, dp: DraftParams) -> tuple[int, float]:
        cfg = self._sample[seq_id]
        if cfg is None:
            return top_candidate(logits, dp.p_min_or(self.params.p_min) > 0.0, self._suppress)
        if self._suppress is not None:
            logits = logits.copy()
            logits[self._suppress] = -np.inf
        k = min(DRAFT_TOP_K, logits.shape[0])
        idx = np.argpartition(logits, logits.shape[0] - k)[-k:]
        if self._to_tgt is not None:  # a trimmed draft: candidates in target ids (rows fill at run time, unordered)
            tgt = self._to_tgt[idx]
            order = np.argsort(tgt)
            idx, tgt_sorted = idx[order], tgt[order]
        else:
            idx = np.sort(idx)  # draws go by token id
            tgt_sorted = idx
        z = logits[idx].astype(np.float64) / cfg.temp
        z = np.exp(z - z.max())
        z /= z.sum()
        # inverse CDF over token ids (deterministic given the uniform)
        u = cfg.rng.random()
        c = np.cumsum(z)
        j = min(int(np.searchsorted(c, u * c[-1], side="right")), len(idx) - 1)
        if dp.probs is None:
            dp.probs = []
        dp.probs.append((tgt_sorted, z))  # p_dft, sparse: the 10 candidates (target ids < the target's vocabulary)
        return int(idx[j]), float(z[j])

    # -- protocol ---------------------------------------------------------------------------------
    def reset(self, seq_id: int) -> None:
        self._decoded[seq_id] = None

    def _skip_decoded(self, rows: Sequence[llama.Row]) -> list[llama.Row]:
        """``reuse_kv``: drop the leading rows of each seq that drafting already decoded at the same positions
        (the verification batch starts with ``id_last`` at ``pos0``, then the draft); whatever drafting decoded
        beyond the matching prefix is removed from the draft context before the rest is decoded (a refused trim
        raises :class:`~llamaspec.errors.MemoryOpError`)."""
        out: list[llama.Row] = []
        for seq, group in _seq_groups(rows):
            k = 0
            dec = self._decoded[seq]
            if dec is not None:
                pos0, toks = dec
                if group[0].pos == pos0:
                    while k < len(group) and k < len(toks) and group[k].token == toks[k] and group[k].pos == pos0 + k:
                        k += 1
                self.mem.trim(seq, pos0 + k)
                self._decoded[seq] = None
            out.extend(group[k:])
        for seq, dec in enumerate(self._decoded):  # drafted but not in this batch: drop what drafting added
            if dec is not None:
                self.mem.trim(seq, dec[0])
                self._decoded[seq] = None
        return out

    def redecode(self, seq_id: int, tokens: Sequence[int], pos0: int) -> bool:
        """After a FULL draft memory was reloaded: the committed ``tokens`` again, in the draft's ids."""
        rows = self._dft_rows([llama.Row(t, pos0 + i, seq_id, False) for i, t in enumerate(tokens)], out_last=True)
        self._decode_chunks(rows)
        return True

    def _decode_chunks(self, rows: Sequence[llama.Row]) -> None:
        """Decode draft-id ``rows`` into the draft context in chunks of ``n_batch``, the last row of each an
        output (llama.cpp wants one per decode)."""
        for chunk in llama.chunks(rows, self.ctx_dft.n_batch):
            if not chunk[-1].output:
                chunk = chunk[:-1] + [llama.Row(chunk[-1].token, chunk[-1].pos, chunk[-1].seq_id, True)]
            self.ctx_dft.decode(chunk)

    def process(self, rows: Sequence[llama.Row]) -> bool:
        if not rows:
            return True
        if self.reuse_kv and any(d is not None for d in self._decoded):
            rows = self._skip_decoded(rows)
        if self.reuse_kv:  # committed rows of seqs that did not draft: decoded when they draft next
            rows = self._to_mirror(rows)
        if not rows:
            return True
        mirrored = self._dft_rows([r for r in rows if r.token is not None], out_last=True)
        if not mirrored:
            return True
        return self._logged("mirroring a target batch into the draft context", lambda: self._decode_chunks(mirrored),
                            logging.ERROR)

    def _decode_step(self, rows: list[llama.Row], lead: Sequence[llama.Row] = ()) -> bool:
        """One drafting decode of target-id ``rows``, after the committed ``lead`` rows that ride with the first
        step (:meth:`_catch_up`; ``_out0``: the batch row of ``rows[0]``, ``_t_lead``: when that step ended); with
        ``reuse_kv`` remember what drafting put in the draft context per seq (as target ids)."""
        try:
            if self._to_dft is None and not lead:  # one output row per sequence, in the target's ids: to the batch
                self.ctx_dft.decode_next([r.token for r in rows], [r.pos for r in rows], [r.seq_id for r in rows])
            else:
                self.ctx_dft.decode(self._dft_rows([*lead, *rows]))
        except DecodeError as e:
            log.warning("draft-simple: draft decode failed: %s", e)
            return False
        self._out0 = len(lead)
        if lead:
            self._t_lead = time.perf_counter()
        if self.reuse_kv:
            for r in rows:
                dec = self._decoded[r.seq_id]
                if dec is None:
                    self._decoded[r.seq_id] = (r.pos, [r.token])
                else:
                    dec[1].append(r.token)
        return True

    def _to_mirror(self, rows: Sequence[llama.Row]) -> list[llama.Row]:
        """The rows to mirror now: those of seqs the last draft() drafted for, when they continue the draft
        memory without a gap (a seq that skipped rounds is caught up by its next draft instead)."""
        out: list[llama.Row] = []
        for seq, group in _seq_groups(rows):
            if seq in self._drafted and group[0].pos == self.mem.pos_max(seq) + 1:
                out.extend(group)
            # only the batch that verifies this seq's own draft: in the rounds after it (no draft() for the
            # seq, or none at all, as in the referee's plain rounds) its rows wait for the next catch-up
            self._drafted.discard(seq)
        return out

    def pending(self, seq_id: int, pos0: int) -> int:
        """With ``reuse_kv``, the committed tokens the draft context lacks (a new prompt, rounds it did not draft)."""
        return max(0, pos0 - self.mem.pos_max(seq_id) - 1) if self.reuse_kv else 0

    def _catch_up(self, params: Sequence[DraftParams], active: list[int]) -> "list[llama.Row] | None":
        """The committed tokens the draft context misses (rounds it did not draft), in one batched pass before
        drafting; the last of them, as many as fit beside the ``id_last`` rows, are returned to ride with the
        first drafting step instead (None: a decode failed)."""
        rows = []
        for s in active:
            dp = params[s]
            p = self.mem.pos_max(s) + 1
            rows.extend(llama.Row(t, p + j, s, False) for j, t in enumerate(dp.prompt[p:dp.pos0]))
        self.catch_up_rows = len(rows)
        cut = max(0, len(rows) - (self.ctx_dft.n_batch - len(active)))
        if max(min(self.n_max, params[s].n_max) if params[s].n_max > 0 else self.n_max for s in active) <= 1:
            # a one-step draft that carried them would leave no drafting step to time (the cost a draft
            # length is chosen by): decoded apart, so that one step is measured
            cut = len(rows)
        ok = self._logged("catching the draft context up", lambda: self._decode_chunks(self._dft_rows(rows[:cut])))
        return rows[cut:] if ok else None

    def draft(self, params: Sequence[DraftParams]) -> None:
        ctx = self.ctx_dft
        active = [s for s, dp in enumerate(params) if dp.drafting]
        self._drafted = set(active)
        if not active:
            return
        for s in active:
            self._decoded[s] = None
        t0 = time.perf_counter()
        self.catch_up_rows = 0
        lead = self._catch_up(params, active) if self.reuse_kv else []
        self.catch_up_ms = (time.perf_counter() - t0) * 1e3
        if lead is None:
            return
        t0 = time.perf_counter()
        self.last_step_ms = None

        def pick(k: int, s: int, dp: DraftParams) -> tuple[int, float]:
            tok, p = self._pick(s, ctx.logits(self._out0 + k), dp)
            return (int(self._to_tgt[tok]) if self._to_tgt is not None else tok), p

        first = [llama.Row(params[s].id_last, params[s].pos0, s, True) for s in active]
        pending = [lead]  # the catching up goes with the first decode
        n_steps = self._draft_steps(params, active, first, pick,
                                    lambda k, s, dp, i, tok: llama.Row(tok, dp.pos0 + i + 1, s, True),
                                    lambda rows: self._decode_step(rows, pending.pop() if pending else ()))
        lead_ms = None
        if lead and n_steps:  # a first step that carried the catching up is no drafting step: timed from after it
            lead_ms = (self._t_lead - t0) * 1e3
            t0, n_steps = self._t_lead, n_steps - 1
        if n_steps:
            self.last_step_ms = (time.perf_counter() - t0) * 1e3 / n_steps
        if lead_ms is not None:
            # that first step is catching up but for one drafting step: priced as the later steps, or (none) as
            # its share of the batch's rows. (A new prompt or the rounds after plain ones ride there whole:
            # counted as drafting, they priced a draft step at 1.3-2.2 target decodes on a quiet machine.)
            step = self.last_step_ms if self.last_step_ms is not None else lead_ms * len(active) / (len(lead) + len(active))
            self.catch_up_ms += max(0.0, lead_ms - step)
        self._drop_short(params, active)
