"""The engine: one loop for 1..N slots (design.md, "one loop").

Each slot is one sequence (``seq_id`` = slot id) of the target context. A slot goes through
``PROMPT`` (its prompt is decoded in chunks of ``n_batch``; the first token is sampled from the last row),
``GENERATING`` (each round decodes the slot's ``sampled`` token at ``n_past`` and samples the next one)
and ``DONE`` (its sequence is removed from memory so the slot can be reused).

Vocabulary follows llama.cpp: ``sampled`` is the last token sampled by the target and **not yet decoded**;
``n_past`` is the number of tokens in the target memory for the sequence, so after every round
``seq_pos_max(seq) == n_past - 1`` (checked by tests, restored on every exit path).

Speculative decoding plugs into :meth:`Engine.step` (draft, checkpoint, one batched decode of
``[sampled] + draft`` per slot, process, verify, roll back, emit); plain generation is the same round with
empty drafts.
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from . import _llama as L
from .errors import ContextOverflowError, LlamaSpecError, UsageError
from .text import TextStream

log = logging.getLogger("llamaspec")

DEFAULT_N_CTX = 4096


class SlotState(enum.Enum):
    IDLE = "idle"
    PROMPT = "prompt"
    GENERATING = "generating"
    DONE = "done"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # n_predict reached, or the context is full
    ABORT = "abort"  # the caller abandoned the request

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


@dataclass
class GenerationStats:
    n_prompt: int = 0
    n_predicted: int = 0
    t_prompt_s: float = 0.0
    t_decode_s: float = 0.0
    n_target_decodes: int = 0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.n_prompt / self.t_prompt_s if self.t_prompt_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes from the prompt's logits; the others from decode rounds
        n = max(0, self.n_predicted - 1)
        return n / self.t_decode_s if self.t_decode_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "n_prompt": self.n_prompt,
            "n_predicted": self.n_predicted,
            "t_prompt_ms": round(self.t_prompt_s * 1e3, 3),
            "t_decode_ms": round(self.t_decode_s * 1e3, 3),
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "n_target_decodes": self.n_target_decodes,
        }


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)


@dataclass
class Chunk:
    """What one slot emitted in one round: new tokens and the text that became final."""

    slot: "Slot"
    tokens: list[int]
    text: str
    finished: bool = False


class Slot:
    """One sequence of the target context (``seq_id == id``)."""

    def __init__(self, slot_id: int):
        self.id = slot_id
        self.state = SlotState.IDLE
        self.reset()

    def reset(self) -> None:
        self.prompt: list[int] = []  # tokens in the target memory, in order (prompt + committed output)
        self.n_prompt = 0
        self.n_past = 0
        self.sampled: int | None = None
        self.generated: list[int] = []
        self.n_predict = -1
        self.sampler: L.Sampler | None = None
        self.stream: TextStream | None = None
        self.finish_reason: FinishReason | None = None
        self.stats = GenerationStats()
        self._t0 = 0.0

    @property
    def seq_id(self) -> int:
        return self.id

    @property
    def n_remaining(self) -> int:
        """Tokens still allowed by ``n_predict`` (-1 = unlimited)."""
        return -1 if self.n_predict < 0 else self.n_predict - len(self.generated)


class Engine:
    """Owns the target model and context and drives N slots.

    >>> # doctest: +SKIP
    >>> with Engine("model.gguf") as eng:
    ...     print(eng.generate("def fibonacci(n):", n_predict=32).text)
    """

    def __init__(
        self,
        target: L.Model | str | Path,
        *,
        n_ctx: int = DEFAULT_N_CTX,
        n_parallel: int = 1,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        flash_attn: bool | None = None,
        kv_f32: bool = False,
    ):
        if n_parallel < 1:
            raise UsageError(f"n_parallel must be >= 1, got {n_parallel}")
        if n_ctx < 8:
            raise UsageError(f"context size must be >= 8, got {n_ctx}")
        if n_batch < 1:
            raise UsageError(f"batch size must be >= 1, got {n_batch}")
        self._owns_model = not isinstance(target, L.Model)
        self.model = L.Model(target) if self._owns_model else target
        try:
            if self.model.n_ctx_train > 0 and n_ctx > self.model.n_ctx_train:
                log.info("n_ctx %d > n_ctx_train %d of %s: clamped", n_ctx, self.model.n_ctx_train, self.model.path.name)
                n_ctx = self.model.n_ctx_train
            self.n_parallel = n_parallel
            n_out_max, _ = L.output_limits(n_batch, n_parallel, 0)
            self.ctx = L.Context(
                self.model,
                L.ContextParams(
                    n_ctx=n_ctx,
                    n_batch=n_batch,
                    n_ubatch=n_ubatch or n_batch,
                    n_seq_max=n_parallel,
                    n_outputs_max=n_out_max,
                    n_outputs_max_per_seq=1,
                    n_threads=n_threads,
                    flash_attn=flash_attn,
                    kv_f32=kv_f32,
                ),
            )
        except BaseException:
            if self._owns_model:
                self.model.close()
            raise
        self.vocab = self.model.vocab
        self.slots = [Slot(i) for i in range(n_parallel)]

    # ------------------------------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------------------------------
    def close(self) -> None:
        for s in getattr(self, "slots", []):
            if s.sampler is not None:
                s.sampler.close()
                s.sampler = None
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.close()
        if getattr(self, "_owns_model", False) and getattr(self, "model", None) is not None:
            self.model.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------
    # requests
    # ------------------------------------------------------------------------------------------
    @property
    def n_ctx_seq(self) -> int:
        return self.ctx.n_ctx_seq

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.vocab.tokenize(text, add_special=add_special, parse_special=parse_special)

    def submit(
        self,
        prompt: str | Sequence[int],
        *,
        n_predict: int = -1,
        sampling: L.SamplingParams | None = None,
        stop: Sequence[str] = (),
        parse_special: bool = False,
    ) -> Slot:
        """Queue a request on a free slot; its prompt is decoded by the next :meth:`step`."""
        slot = next((s for s in self.slots if s.state in (SlotState.IDLE, SlotState.DONE)), None)
        if slot is None:
            raise UsageError(f"all {self.n_parallel} slots are busy; raise n_parallel or wait for one to finish")
        tokens = self.tokenize(prompt, parse_special=parse_special) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise UsageError("the prompt is empty (and the model adds no BOS token): give at least one token")
        bad = [t for t in tokens if not 0 <= t < self.vocab.n_tokens]
        if bad:
            raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab.n_tokens - 1})")
        if len(tokens) >= self.n_ctx_seq:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx_seq} per sequence; "
                f"shorten the prompt or raise --ctx-size (this model was trained for {self.model.n_ctx_train})"
            )
        if n_predict < -1:
            raise UsageError(f"n_predict must be >= -1 (-1 = until end of generation or context), got {n_predict}")
        sampling = sampling or L.SamplingParams(temp=0.0)
        sampler = L.Sampler.from_params(self.vocab, sampling)
        self._release(slot)
        slot.reset()
        slot.prompt = tokens
        slot.n_prompt = len(tokens)
        slot.n_predict = n_predict
        slot.sampler = sampler
        slot.stream = TextStream(stop)
        slot.state = SlotState.PROMPT
        slot.stats.n_prompt = len(tokens)
        return slot

    def cancel(self, slot: Slot) -> None:
        """Abandon a request: its memory is freed and the slot becomes reusable."""
        if slot.state in (SlotState.PROMPT, SlotState.GENERATING):
            slot.finish_reason = FinishReason.ABORT
            slot.state = SlotState.DONE
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        if self.ctx.memory is not None and self.ctx.ptr:
            self.ctx.memory.seq_rm(slot.seq_id, 0, -1)
        slot.n_past = 0
        if slot.sampler is not None:
            slot.sampler.close()
            slot.sampler = None

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if s.state in (SlotState.PROMPT, SlotState.GENERATING)]

    # ------------------------------------------------------------------------------------------
    # one round
    # ------------------------------------------------------------------------------------------
    def step(self) -> list[Chunk]:
        """Run one round for every active slot and return what each emitted."""
        out: list[Chunk] = []
        try:
            for slot in [s for s in self.slots if s.state is SlotState.PROMPT]:
                out.append(self._process_prompt(slot))
            gen = [s for s in self.slots if s.state is SlotState.GENERATING and s.sampled is not None]
            if gen:
                out.extend(self._decode_round(gen))
        except BaseException:
            self._restore_invariant()
            raise
        return out

    def _restore_invariant(self) -> None:
        """After an exception mid-round: drop anything past ``n_past`` so memory matches bookkeeping."""
        if self.ctx.memory is None or not self.ctx.ptr:
            return
        for s in self.slots:
            if s.state in (SlotState.PROMPT, SlotState.GENERATING):
                self.ctx.memory.seq_rm(s.seq_id, s.n_past, -1)

    def _process_prompt(self, slot: Slot) -> Chunk:
        slot._t0 = time.perf_counter()
        self.ctx.decode_tokens(slot.prompt, 0, slot.seq_id, output_last=True)
        slot.stats.n_target_decodes += -(-len(slot.prompt) // self.ctx.n_batch)
        slot.n_past = len(slot.prompt)
        # the last prompt row is the last row of the last chunk
        last_idx = (len(slot.prompt) - 1) % self.ctx.n_batch
        token = slot.sampler.sample(self.ctx, last_idx)
        t1 = time.perf_counter()
        slot.stats.t_prompt_s = t1 - slot._t0
        slot._t0 = t1
        slot.state = SlotState.GENERATING
        return self._emit(slot, [token])

    def _decode_round(self, slots: list[Slot]) -> list[Chunk]:
        rows = [L.Row(s.sampled, s.n_past, s.seq_id, True) for s in slots]
        self.ctx.decode(rows)
        out = []
        for i, s in enumerate(slots):
            s.stats.n_target_decodes += 1
            s.prompt.append(s.sampled)
            s.n_past += 1
            token = s.sampler.sample(self.ctx, i)
            out.append(self._emit(s, [token]))
        return out

    def _emit(self, slot: Slot, tokens: list[int]) -> Chunk:
        """Commit sampled tokens to the slot's output, apply EOG / stop strings / limits."""
        emitted: list[int] = []
        text = ""
        for t in tokens:
            if self.vocab.is_eog(t):
                slot.finish_reason = FinishReason.STOP
                break
            emitted.append(t)
            slot.generated.append(t)
            text += slot.stream.feed(self.vocab.token_to_piece(t))
            if slot.stream.stopped:
                slot.finish_reason = FinishReason.STOP
                break
            if slot.n_remaining == 0:
                slot.finish_reason = FinishReason.LENGTH
                break
            if slot.n_past >= self.n_ctx_seq - 1:  # no room left to decode the next sampled token
                slot.finish_reason = FinishReason.LENGTH
                break
        slot.sampled = tokens[-1] if slot.finish_reason is None else None
        slot.stats.n_predicted = len(slot.generated)
        now = time.perf_counter()
        if slot.state is SlotState.GENERATING and slot.stats.t_prompt_s > 0:
            slot.stats.t_decode_s = now - slot._t0
        finished = slot.finish_reason is not None
        if finished:
            text += slot.stream.flush()
            slot.state = SlotState.DONE
            self._release(slot)
        return Chunk(slot, emitted, text, finished)

    # ------------------------------------------------------------------------------------------
    # convenience: one prompt
    # ------------------------------------------------------------------------------------------
    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        n_predict: int = -1,
        sampling: L.SamplingParams | None = None,
        stop: Sequence[str] = (),
        parse_special: bool = False,
    ) -> Iterator[Chunk]:
        """Generate for one prompt, yielding a :class:`Chunk` per round. Abandoning the iterator frees
        the slot and leaves memory consistent."""
        slot = self.submit(prompt, n_predict=n_predict, sampling=sampling, stop=stop, parse_special=parse_special)
        try:
            while slot.state in (SlotState.PROMPT, SlotState.GENERATING):
                for ch in self.step():
                    if ch.slot is slot:
                        yield ch
        finally:
            if slot.state is not SlotState.DONE:
                self.cancel(slot)

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        n_predict: int = -1,
        sampling: L.SamplingParams | None = None,
        stop: Sequence[str] = (),
        parse_special: bool = False,
        on_chunk: Callable[[Chunk], None] | None = None,
    ) -> GenerationResult:
        tokens: list[int] = []
        text = ""
        slot = None
        for ch in self.stream(prompt, n_predict=n_predict, sampling=sampling, stop=stop, parse_special=parse_special):
            slot = ch.slot
            tokens += ch.tokens
            text += ch.text
            if on_chunk is not None:
                on_chunk(ch)
        if slot is None:  # pragma: no cover - stream always yields at least once
            raise LlamaSpecError("generation produced no output")
        return GenerationResult(tokens, text, slot.finish_reason or FinishReason.STOP, slot.stats, slot.prompt[: slot.n_prompt])

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        n_predict: int = -1,
        sampling: L.SamplingParams | Sequence[L.SamplingParams] | None = None,
        stop: Sequence[str] = (),
    ) -> list[GenerationResult]:
        """Generate for several prompts, ``n_parallel`` at a time, in one batched loop."""
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise UsageError("give one sampling setting, or one per prompt")
        results: list[GenerationResult | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        running: dict[int, tuple[int, list[int], list[str]]] = {}  # slot id -> (prompt index, tokens, texts)
        try:
            while pending or running:
                while pending and any(s.state in (SlotState.IDLE, SlotState.DONE) for s in self.slots):
                    i = pending.pop(0)
                    s = self.submit(prompts[i], n_predict=n_predict, sampling=samplings[i], stop=stop)
                    running[s.id] = (i, [], [])
                for ch in self.step():
                    i, toks, texts = running[ch.slot.id]
                    toks += ch.tokens
                    texts.append(ch.text)
                    if ch.finished:
                        s = ch.slot
                        results[i] = GenerationResult(toks, "".join(texts), s.finish_reason, s.stats, s.prompt[: s.n_prompt])
                        del running[ch.slot.id]
        finally:
            for sid in list(running):
                self.cancel(self.slots[sid])
        return results  # type: ignore[return-value]
