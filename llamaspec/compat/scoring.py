"""Every row's logits of a token sequence, for what llama-cpp-python reads from ``logits_all=True``: the prompt's
log-probabilities of ``echo=True`` with ``logprobs``, and ``Llama.scores`` after :meth:`eval`.

The engine samples from the rows it needs and keeps no others, so a :class:`Scorer` decodes the sequence again
on a second context of the same model (same flash-attention and KV-cache settings), with an output on each
row; it keeps its memory between calls and decodes only what differs from the previous sequence. Rows are
handed out one at a time (a prompt's full ``n x n_vocab`` matrix is never held), in decode chunks of at most
:data:`N_BATCH` rows, so its output buffer stays small even with a 262k-token vocabulary.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from .. import _llama as llama
from ..logprobs import TokenProb, legacy_logprobs, raw_entry
from ..memory import Rollback
from ..probe import can_seq_rm

__all__ = ["CompletionLogprobs", "N_BATCH", "Scorer"]

#: rows per decode on the scoring context (its logits buffer holds N_BATCH x n_vocab floats)
N_BATCH = 64


class Scorer:
    """A second context on ``llm``'s target model (created on first use, freed by :meth:`close`)."""

    def __init__(self, llm: Any):
        self.llm = llm
        self.ctx: "llama.Context | None" = None
        self.memory: "Rollback | None" = None
        self.tokens: list[int] = []  # what the context's memory holds, in order

    def _context(self) -> "llama.Context":
        if self.ctx is None:
            llm = self.llm
            engine = llm._require_engine()
            p = engine.ctx.params
            self.ctx = llama.Context(llm._model, n_ctx=llm.n_ctx(), n_batch=N_BATCH, n_ubatch=N_BATCH,
                                     n_seq_max=1, n_threads=llm.n_threads, n_threads_batch=llm.n_threads_batch,
                                     flash_attn=p.flash_attn, kv_f32=p.kv_f32)
            self.memory = Rollback(self.ctx, can_seq_rm(self.ctx))
        return self.ctx

    def rows(self, tokens: Sequence[int], start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """``(i, logits)`` for ``i`` in ``start..len(tokens)-1``: the logits after ``tokens[: i + 1]``, each a
        view valid until the next row is asked for (copy it to keep it)."""
        tokens = [int(t) for t in tokens]
        ctx = self._context()
        keep = self.memory.keep_common_prefix(0, self.tokens, tokens, start)
        for c0 in range(keep, len(tokens), N_BATCH):
            chunk = tokens[c0:c0 + N_BATCH]
            ctx.decode([llama.Row(t, c0 + j, 0, c0 + j >= start) for j, t in enumerate(chunk)])
            self.tokens.extend(chunk)
            ctx.wait_for_outputs()
            for j in range(max(0, start - c0), len(chunk)):
                yield c0 + j, ctx.logits(j)  # llama.cpp maps the batch row to its output

    def close(self) -> None:
        ctx, self.ctx, self.memory = self.ctx, None, None
        self.tokens = []
        if ctx is not None:
            ctx.close()


class CompletionLogprobs:
    """llama-cpp-python's ``logprobs`` object of a completion (:func:`~llamaspec.logprobs.legacy_logprobs`, in
    its text offset unit), filled token by token; :meth:`take` hands out what was added since its last call.
    With ``echo`` the prompt's tokens come first (:meth:`add_prompt`) and offsets count from 0, else from the
    prompt's length."""

    def __init__(self, llm: Any, prompt: "str | Sequence[int]", echo: bool = False):
        self.llm = llm
        self.base = 0 if echo else len(prompt)
        self.tokens: list[int] = []  # the listed tokens, with their entries
        self.entries: "list[TokenProb | None]" = []
        self._taken = 0  # how many of them take() handed out

    def _piece(self, token: int) -> bytes:
        return self.llm.detokenize([token])

    def _from(self, i: int) -> dict:
        return legacy_logprobs(self.tokens[i:], self.entries[i:], self._piece, start=self.base,
                               before=b"".join(map(self._piece, self.tokens[:i])))

    @property
    def all(self) -> dict:
        return self._from(0)

    def add(self, token: int, tp: "TokenProb | None") -> None:
        """One token with its entry (None: listed without log-probabilities, as the first echoed token)."""
        if token != self.llm._vocab.bos:  # llama-cpp-python leaves BOS out
            self.tokens.append(token)
            self.entries.append(tp)

    def add_prompt(self, tokens: Sequence[int], n_probs: int) -> None:
        """The prompt's tokens (``echo``): each with the model's distribution after the tokens before it, the
        first listed one (BOS is not listed) with ``None`` as OpenAI's API has it."""
        tokens = [int(t) for t in tokens]
        first = 1 if tokens and tokens[0] == self.llm._vocab.bos else 0
        if first >= len(tokens):
            return
        self.add(tokens[first], None)
        for i, logits in self.llm._scorer().rows(tokens[:-1], start=first):
            self.add(tokens[i + 1], raw_entry(logits, tokens[i + 1], n_probs))

    def take(self) -> dict:
        out, self._taken = self._from(self._taken), len(self.tokens)
        return out
