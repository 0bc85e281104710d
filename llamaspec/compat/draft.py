"""``llamaspec.DraftModel``: a real draft model behind llama-cpp-python's ``LlamaDraftModel`` hook, so that
existing code speculates with one changed line::

    llm = llama_cpp.Llama("target.gguf", draft_model=llamaspec.DraftModel("draft.gguf"))

llama-cpp-python calls the hook with the whole token history (``input_ids``: the committed tokens, the last
of them just sampled and not yet decoded) and verifies what it returns by sampling the target at every
drafted position and keeping the run that matches. The hook is told nothing else, so the adapter infers what
happened from the history alone:

* the longest common prefix of the new history and what the draft context holds is what survived: the
  drafted tokens the target accepted plus everything before them. The rest is trimmed from the draft's memory
  (through :class:`~llamaspec.memory.SeqMemory`), never decoded again;
* only the tokens after that prefix are decoded (the target's own next token, or a new prompt's tail);
* then up to ``n`` tokens are drafted greedily, each decoded on the draft as it is proposed (the last one
  is not: nothing reads its logits unless it is accepted);
* ``n`` adapts to what was accepted (``adaptive``): all of the last draft accepted -> ``n + 2``, otherwise
  ``n - 1``, between ``n_min`` and ``num_pred_tokens``; ``p_min`` stops a draft before a token the draft
  itself is unsure of.

Limits (llama-cpp-python's loop, not the adapter's): one sequence, match verification only (the target's
sampled token is compared with the draft's), and its ``Llama`` copies every row's logits into Python when a
draft model is set (``logits_all``), which costs ``n_ctx x n_vocab`` floats of memory. The draft must share
the target's vocabulary.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .. import _llama as llama
from .._llama import compat as lcp
from ..drafters.base import suppress_array
from ..drafters.draft_model import top_candidate
from ..errors import MemoryOpError
from ..memory import SeqMemory
from .args import CompatError

__all__ = ["DraftModel"]

SEQ = 0


class DraftModel(lcp.LlamaDraftModel):
    """A draft GGUF (path, models.toml name or a loaded :class:`~llamaspec._llama.Model`) as a
    ``llama_cpp.llama_speculative.LlamaDraftModel``. ``num_pred_tokens``: the longest draft; ``n_ctx``: the
    draft context (at least the target's; default the smaller of 4096 and the draft's training context);
    ``n_threads`` / ``n_gpu_layers``: llama.cpp's meaning."""

    #: lets ``llamaspec.Llama(draft_model=DraftModel(...))`` run the draft inside its own engine instead
    is_llamaspec_draft_model = True

    def __init__(self, model: "str | os.PathLike | llama.Model", *, num_pred_tokens: int = 10, n_min: int = 1,
                 adaptive: bool = True, p_min: float = 0.0, n_ctx: "int | None" = None, n_batch: int = 512,
                 n_threads: "int | None" = None, n_gpu_layers: "int | None" = None, flash_attn: "bool | None" = None):
        if num_pred_tokens < 1 or not 1 <= n_min <= num_pred_tokens:
            raise CompatError(f"DraftModel needs 1 <= n_min <= num_pred_tokens, got {n_min} and {num_pred_tokens}")
        self._ctx = None
        self._own_model = None
        if isinstance(model, llama.Model):
            self.model = model
        else:
            from .drafter import _draft_path

            self.model = self._own_model = llama.Model(_draft_path(model), n_gpu_layers=n_gpu_layers)
        self.path = self.model.path
        self.num_pred_tokens, self.n_min, self.adaptive, self.p_min = num_pred_tokens, n_min, adaptive, p_min
        #: the current draft length
        self.n = num_pred_tokens
        if n_ctx is None:
            n_ctx = min(4096, self.model.n_ctx_train or 4096)
        # swa_full: a sliding-window cache keeps every position, so that a trim restores an exact prefix
        self._ctx = llama.Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=1,
                                  n_threads=n_threads, flash_attn=flash_attn, swa_full=True)
        self._mem = SeqMemory(self._ctx)
        self._n_vocab = self.model.vocab.n_tokens
        self._suppress = suppress_array(self.model.vocab.suppress_tokens)
        #: tokens in the draft's memory, in order (positions 0..len-1)
        self._kv: list[int] = []
        self._last_len = 0  # length of the history at the last call
        self._last_draft: list[int] = []
        #: counters: calls, drafted tokens, accepted drafted tokens, tokens decoded on the draft
        self.stats = {"n_calls": 0, "n_drafted": 0, "n_accepted": 0, "n_decoded": 0, "n_trimmed": 0}

    # -- the hook -----------------------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        hist = [int(t) for t in np.asarray(input_ids).reshape(-1)]
        self.stats["n_calls"] += 1
        self._learn(hist)
        if not hist or max(hist) >= self._n_vocab:
            return np.array([], dtype=np.intc)
        room = self._ctx.n_ctx - len(hist)
        n = min(self.n, room)
        if n < 1:
            return np.array([], dtype=np.intc)
        logits = self._sync(hist)
        draft: list[int] = []
        pos = len(hist)
        while True:
            tok, p = top_candidate(logits, self.p_min > 0, self._suppress)
            if self.p_min > 0 and p < self.p_min:
                break
            draft.append(tok)
            if len(draft) >= n:
                break
            self._decode([tok], pos)
            logits = self._ctx.logits(0)
            pos += 1
        self._last_len, self._last_draft = len(hist), draft
        self.stats["n_drafted"] += len(draft)
        return np.array(draft, dtype=np.intc)

    def _learn(self, hist: list[int]) -> None:
        """What the target accepted of the last draft, read off the new history; adapt the length."""
        d, base = self._last_draft, self._last_len
        self._last_draft = []
        if not d or len(hist) <= base or self._kv[:base] != hist[:base]:
            return
        acc = 0
        for a, b in zip(hist[base:-1], d):
            if a != b:
                break
            acc += 1
        self.stats["n_accepted"] += acc
        if self.adaptive:
            self.n = min(self.num_pred_tokens, self.n + 2) if acc == len(d) else max(self.n_min, self.n - 1)

    def _sync(self, hist: list[int]) -> np.ndarray:
        """Make the draft's memory hold ``hist`` and return the logits after its last token."""
        kv = self._kv
        p = 0
        for a, b in zip(kv, hist):
            if a != b:
                break
            p += 1
        p = min(p, len(hist) - 1)  # the last token is always decoded: its logits are the ones needed
        if p < len(kv):
            try:
                self._mem.trim(SEQ, p)
            except MemoryOpError:  # a memory that cannot drop a suffix (recurrent): start over
                self._mem.trim(SEQ, 0)
                p = 0
            self.stats["n_trimmed"] += len(kv) - p
            del kv[p:]
        self._decode(hist[p:], p)
        return self._ctx.logits((len(hist) - p - 1) % self._ctx.n_batch)

    def _decode(self, tokens: list[int], pos0: int) -> None:
        self._ctx.decode_tokens(tokens, pos0, SEQ)
        self._kv.extend(tokens)
        self.stats["n_decoded"] += len(tokens)

    # -- reporting and lifetime ---------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens (of the calls whose outcome was seen)."""
        return self.stats["n_accepted"] / self.stats["n_drafted"] if self.stats["n_drafted"] else 0.0

    def reset(self) -> None:
        """Forget the draft's memory (the next call decodes its whole history)."""
        if self._kv:
            self._mem.trim(SEQ, 0)
        self._kv.clear()
        self._last_draft, self._last_len, self.n = [], 0, self.num_pred_tokens

    def close(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx is not None:
            ctx.close()
        model, self._own_model = getattr(self, "_own_model", None), None
        if model is not None:
            model.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def __repr__(self) -> str:
        return f"DraftModel({Path(self.path).name!r}, num_pred_tokens={self.num_pred_tokens}, n={self.n})"
