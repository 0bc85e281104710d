"""Emission: a slot's newly accepted tokens become output, with end-of-generation, stop strings and limits.

:class:`Emitter` is the last step of a round (§7.5 step 9) and of a prompt's first sample: it appends the
tokens to the slot's output until an end-of-generation token, a stop string, ``n_predict`` or the context
ends the request, and returns the :class:`~llamaspec.slot.Chunk` of text that became final. It decides that
a request finished; what happens to the slot afterwards (prompt cache or release) is the scheduler's.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .sampler import GRAMMAR_END
from .slot import Chunk, FinishReason, Slot, SlotState

if TYPE_CHECKING:  # pragma: no cover
    from . import _llama as llama
    from .logprobs import TokenProb

__all__ = ["Emitter"]

_GENERATING = SlotState.GENERATING  # read per emit: a global is cheaper than the Enum member lookup
_now = time.perf_counter


class Emitter:
    def __init__(self, vocab: "llama.Vocab", n_ctx_seq: int):
        self.vocab = vocab
        self.n_ctx_seq = n_ctx_seq
        #: --context-shift is on (llamaspec.ctx_shift): a full context is shifted, it does not end the request
        self.ctx_shift = False

    def emit(self, slot: Slot, tokens: list[int], n_from_draft: int, probs: "list[TokenProb] | None" = None) -> Chunk:
        """Commit sampled tokens to the slot's output; ``n_from_draft`` of the leading ones were drafted;
        ``probs``: one entry per token when the request asked for them (the chunk keeps those of the tokens
        it emits). The chunk has the text each token made final, then what the end released."""
        stream, generated = slot.stream, slot.generated
        is_eog, piece_of, feed = self.vocab.is_eog, self.vocab.token_to_piece, stream.feed
        n_predict = slot.n_predict  # -1: no limit
        emitted: list[int] = []
        text = ""
        texts: list[str] = []
        eog = None
        for t in tokens:
            if t == GRAMMAR_END or is_eog(t):  # the grammar allows nothing more: it ends as at EOG
                slot.finish_reason, slot.stop_type = FinishReason.STOP, "eos"
                slot.stats.n_eog = int(t != GRAMMAR_END)  # a sampled EOG token (llama-server counts it)
                eog = slot.stats.eog_token = t if t != GRAMMAR_END else None
                break
            emitted.append(t)
            generated.append(t)
            piece = feed(piece_of(t))
            text += piece
            texts.append(piece)
            if stream.stopped:
                if stream.limited:  # llama-server's n_indent / t_max_predict_ms
                    slot.finish_reason, slot.stop_type = FinishReason.LENGTH, "limit"
                    break
                slot.finish_reason, slot.stop_type = FinishReason.STOP, "word"
                slot.stopping_word = stream.stop_string
                break
            if n_predict == len(generated):  # (never for n_predict < 0)
                slot.finish_reason, slot.stop_type = FinishReason.LENGTH, "limit"
                break
        if slot.finish_reason is None and slot.n_past >= self.n_ctx_seq - 1 and not self.ctx_shift:
            # no room left to decode the sampled token
            slot.finish_reason, slot.stop_type, slot.truncated = FinishReason.LENGTH, "limit", True
        finished = slot.finish_reason is not None
        slot.sampled = None if finished else tokens[-1]
        stats = slot.stats
        stats.n_predicted = len(generated)
        if slot.state is _GENERATING and stats.t_prompt_s > 0:
            stats.t_decode_s = _now() - slot.t_start
        if finished:
            text += stream.flush()
            slot.state = SlotState.DONE
            slot.prompt_tokens = slot.tokens[: slot.n_prompt]
        return Chunk(slot.id, emitted, text, finished, min(n_from_draft, len(emitted)), eog=eog,
                     probs=probs[: len(emitted) + (eog is not None)] if probs is not None else None, texts=texts)
