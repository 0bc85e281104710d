"""``llamaspec.DraftModel``: a real draft model behind llama-cpp-python's ``LlamaDraftModel`` hook, so that
existing code speculates with one changed line::

    llm = llama_cpp.Llama("target.gguf", draft_model=llamaspec.DraftModel("draft.gguf"))

llama-cpp-python calls the hook with the whole token history (``input_ids``: the committed tokens, the last
of them just sampled and not yet decoded) and verifies what it returns by sampling the target at every
drafted position and keeping the run that matches. The hook is told nothing else, so the adapter infers what
happened from the history alone, and drafts with the engine's own parts:

* the longest common prefix of the new history and what the draft context holds is what survived: the
  drafted tokens the target accepted plus everything before them. The rest is trimmed from the draft's memory
  (:class:`~llamaspec.memory.DraftRollback`, at the level probed at start-up: a memory that cannot keep a
  prefix starts over), never decoded again;
* the engine's draft-simple (:class:`~llamaspec.drafters.draft_model.DraftSimple`, keeping what it decodes:
  ``reuse_kv``) decodes only the tokens after that prefix (the target's own next token, or a new prompt's
  tail) and drafts up to ``n`` tokens greedily, each decoded on the draft as it is proposed (the last one is
  not: nothing reads its logits unless it is accepted); ``p_min`` stops a draft before a token the draft
  itself is unsure of;
* ``n`` adapts to what was accepted (``adaptive``): all of the last draft accepted -> ``n + 2``, otherwise
  ``n - 1``, between ``n_min`` and ``num_pred_tokens`` (the engine's cost-based length,
  :mod:`llamaspec.adaptive`, needs the round's measured costs, which the hook never sees);
* whether to draft at all is the engine's :class:`~llamaspec.referee.Referee`'s call (``referee``): the time
  from one call to the next is a round of llama-cpp-python's loop (the target's decode of what was drafted,
  its sampling, the draft) and the history's growth is what that round delivered, so speculative rounds are
  judged against occasional plain ones (an empty draft) on tokens per second, and the hook drafts nothing
  while speculating loses (on a busy machine ``llama_cpp.Llama`` decodes a drafted batch with
  ``n_threads_batch`` threads, all the cores by default).

Limits (llama-cpp-python's loop, not the adapter's): one sequence, match verification only (the target's
sampled token is compared with the draft's), and its ``Llama`` copies every row's logits into Python when a
draft model is set (``logits_all``), which costs ``n_ctx x n_vocab`` floats of memory. The draft must share
the target's vocabulary.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import _llama as llama
from .._llama import compat as lcp
from ..drafters.base import DraftParams
from ..drafters.draft_model import DraftSimple
from ..memory import DraftRollback, common_prefix
from ..params import DraftModelParams
from ..probe import can_seq_rm
from ..referee import Referee
from .args import CompatError

__all__ = ["DraftModel"]

SEQ = 0


class DraftModel(lcp.LlamaDraftModel):
    """A draft GGUF (path, models.toml name or a loaded :class:`~llamaspec._llama.Model`) as a
    ``llama_cpp.llama_speculative.LlamaDraftModel``. ``num_pred_tokens``: the longest draft; ``n_ctx``: the
    draft context (at least the target's; default the smaller of 4096 and the draft's training context);
    ``n_threads`` / ``n_gpu_layers``: llama.cpp's meaning; ``referee``: draft only while drafting delivers more
    tokens per second than plain rounds (False: always draft)."""

    #: lets ``llamaspec.Llama(draft_model=DraftModel(...))`` run the draft inside its own engine instead
    is_llamaspec_draft_model = True

    def __init__(self, model: "str | os.PathLike | llama.Model", *, num_pred_tokens: int = 10, n_min: int = 1,
                 adaptive: bool = True, p_min: float = 0.0, n_ctx: "int | None" = None, n_batch: int = 512,
                 n_threads: "int | None" = None, n_gpu_layers: "int | None" = None, flash_attn: "bool | None" = None,
                 referee: bool = True):
        if num_pred_tokens < 1 or not 1 <= n_min <= num_pred_tokens:
            raise CompatError(f"DraftModel needs 1 <= n_min <= num_pred_tokens, got {n_min} and {num_pred_tokens}")
        self._ctx = None
        self._own_model = None
        if isinstance(model, llama.Model):
            self.model = model
        else:
            from .drafter import draft_file

            self.model = self._own_model = llama.Model(draft_file(model), n_gpu_layers=n_gpu_layers)
        self.path = self.model.path
        self.num_pred_tokens, self.n_min, self.adaptive, self.p_min = num_pred_tokens, n_min, adaptive, p_min
        #: the current draft length
        self.n = num_pred_tokens
        if n_ctx is None:
            n_ctx = min(4096, self.model.n_ctx_train or 4096)
        # swa_full: a sliding-window cache keeps every position, so that a trim restores an exact prefix
        self._ctx = llama.Context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_seq_max=1,
                                  n_threads=n_threads, flash_attn=flash_attn, swa_full=True)
        self._mem = DraftRollback(self._ctx, can_seq_rm(self._ctx), reuse_kv=True)
        #: the draft is its own target here (one vocabulary: llama-cpp-python verifies the draft's ids)
        self._drafter = DraftSimple(1, DraftModelParams(n_max=num_pred_tokens, p_min=p_min, reuse_kv=True),
                                    self._ctx, self._ctx)
        self._n_vocab = self.model.vocab.n_tokens
        #: tokens in the draft's memory, in order (positions 0..len-1)
        self._kv: list[int] = []
        self._last_len = 0  # length of the history at the last call
        self._last_draft: list[int] = []
        #: counters: calls, drafted tokens, accepted drafted tokens, tokens decoded on the draft, calls the referee
        #: answered plainly
        self.stats = {"n_calls": 0, "n_drafted": 0, "n_accepted": 0, "n_decoded": 0, "n_trimmed": 0, "n_plain": 0}
        #: speculate or not from what the rounds delivered (None: always)
        self.referee = Referee() if referee else None
        self._clock = time.perf_counter
        self._t_last: "float | None" = None  # when the last call came
        self._hist_last: list[int] = []  # the history it had
        self._spec_last = False  # whether the referee let it draft

    # -- the hook -----------------------------------------------------------------------------------
    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        hist = [int(t) for t in np.asarray(input_ids).reshape(-1)]
        now = self._clock()
        self.stats["n_calls"] += 1
        self._judge(hist, now)
        self._learn(hist)
        self._t_last, self._hist_last, self._spec_last = now, hist, True
        n = min(self.n, self._ctx.n_ctx - len(hist))
        if not hist or max(hist) >= self._n_vocab or n < 1:
            return np.array([], dtype=np.intc)
        if self.referee is not None and not self.referee.speculate(1):
            self._spec_last, self._last_len, self._last_draft = False, len(hist), []
            self.stats["n_plain"] += 1
            return np.array([], dtype=np.intc)
        n_kv = len(self._kv)  # keep what the target accepted (the module docstring)
        self.stats["n_trimmed"] += n_kv - self._mem.keep_common_prefix(SEQ, self._kv, hist, len(hist) - 1)
        dp = DraftParams(drafting=True, n_max=n, pos0=len(hist) - 1, id_last=hist[-1], prompt=hist[:-1])
        self._drafter.draft([dp])
        n_kv = self._mem.n_positions(SEQ)  # the history, then the drafted tokens decoded
        self.stats["n_decoded"] += n_kv - len(self._kv)
        self._kv = (hist + dp.result)[:n_kv]
        self._last_len, self._last_draft = len(hist), dp.result
        self.stats["n_drafted"] += len(dp.result)
        return np.array(dp.result, dtype=np.intc)

    def _judge(self, hist: list[int], now: float) -> None:
        """Tell the referee what the round since the last call delivered, when this call continues it (the
        history grew by the accepted draft and one token; a new prompt's round is not timed)."""
        prev = self._hist_last
        if self.referee is None or self._t_last is None:
            return
        grown = len(hist) - len(prev)
        drafted = len(self._last_draft) if self._spec_last else 0
        if 1 <= grown <= drafted + 1 and hist[:len(prev)] == prev:
            self.referee.record(self._spec_last, 1, grown, now - self._t_last, drafted)

    def _learn(self, hist: list[int]) -> None:
        """What the target accepted of the last draft, read off the new history; adapt the length."""
        d, base = self._last_draft, self._last_len
        self._last_draft = []
        if not d or len(hist) <= base or self._kv[:base] != hist[:base]:
            return
        acc = common_prefix(hist[base:-1], d)
        self.stats["n_accepted"] += acc
        if self.adaptive:
            self.n = min(self.num_pred_tokens, self.n + 2) if acc == len(d) else max(self.n_min, self.n - 1)

    # -- reporting and lifetime ---------------------------------------------------------------------
    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted tokens over drafted tokens (of the calls whose outcome was seen)."""
        return self.stats["n_accepted"] / self.stats["n_drafted"] if self.stats["n_drafted"] else 0.0

    def reset(self) -> None:
        """Forget the draft's memory (the next call decodes its whole history)."""
        if self._kv:
            self._mem.release(SEQ)
        self._kv.clear()
        self._drafter.reset(SEQ)
        self._last_draft, self._last_len, self.n = [], 0, self.num_pred_tokens
        self._t_last, self._hist_last = None, []  # (the referee keeps what it measured: the machine is the same)

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
