"""Per-request state: slots, finish reasons, statistics and results."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import numpy as np

from . import _llama as llama
from .memory import Checkpoint, PromptCheckpoint
from .options import RequestOptions
from .stats import add_per_position
from .text import TextStream

if TYPE_CHECKING:  # pragma: no cover
    from .adaptive import DraftLengthController
    from .logprobs import ProbsSpec, TokenProb
    from .sampler import TargetSampler
    from .verify.verifiers import Verifier


class SlotState(enum.Enum):
    IDLE = "idle"
    PROMPT = "prompt"
    GENERATING = "generating"
    DONE = "done"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-generation token or a stop string
    LENGTH = "length"  # n_predict reached, or the context is full
    ABORT = "abort"  # the caller abandoned the request
    ERROR = "error"  # this request failed (its drafter, decode or verification); the message is on the result

    def __str__(self) -> str:  # pragma: no cover - cosmetic
        return self.value


@dataclass
class GenerationStats:
    n_prompt: int = 0
    #: prompt tokens reused from the slot's prompt cache (not decoded again)
    n_cached: int = 0
    n_predicted: int = 0
    #: 1 when generation ended on an end-of-generation token: not output (``n_predicted`` leaves it out), but
    #: sampled, and llama-server counts it in ``tokens_predicted`` / ``predicted_n`` / ``completion_tokens``
    n_eog: int = 0
    #: that token (llama-server lists it in ``tokens`` and the token probabilities: no text, no bytes)
    eog_token: int | None = None
    t_prompt_s: float = 0.0
    t_decode_s: float = 0.0
    n_target_decodes: int = 0
    # speculative decoding (llama.cpp server's per-slot counters, §3.4)
    n_drafted: int = 0
    n_accepted: int = 0
    n_verif_steps: int = 0
    n_accepted_per_pos: list[int] = field(default_factory=list)
    #: accepted draft tokens per drafter type (which drafter produced the accepted runs)
    n_accepted_by_type: dict = field(default_factory=dict)
    n_replays: int = 0
    n_restores: int = 0
    n_checkpoints: int = 0
    n_trims: int = 0
    #: rounds the adaptive draft length chose not to draft (expected gain below the measured cost of drafting,
    #: verifying and, on FULL / RS targets, checkpointing)
    n_draft_skipped: int = 0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.n_prompt / self.t_prompt_s if self.t_prompt_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes from the prompt's logits; the others from decode rounds
        n = max(0, self.n_predicted - 1)
        return n / self.t_decode_s if self.t_decode_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """``1 + accepted / verification steps`` (llama.cpp's "mean len")."""
        return 1.0 + self.n_accepted / self.n_verif_steps if self.n_verif_steps else 1.0

    def count_verified(self, n_accepted: int, drafter_type: str | None) -> None:
        """One verified draft of which ``n_accepted`` tokens were accepted, drafted by ``drafter_type``."""
        if drafter_type is not None and n_accepted > 0:
            self.n_accepted_by_type[drafter_type] = self.n_accepted_by_type.get(drafter_type, 0) + n_accepted
        self.n_accepted += n_accepted
        self.n_verif_steps += 1
        add_per_position(self.n_accepted_per_pos, [1] * n_accepted)

    def merge(self, other: "GenerationStats") -> None:
        for name in _NUMERIC_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for k, v in other.n_accepted_by_type.items():
            self.n_accepted_by_type[k] = self.n_accepted_by_type.get(k, 0) + v
        add_per_position(self.n_accepted_per_pos, other.n_accepted_per_pos)

    def to_dict(self) -> dict:
        return {
            "n_prompt": self.n_prompt,
            "n_cached": self.n_cached,
            "n_predicted": self.n_predicted,
            "t_prompt_ms": round(self.t_prompt_s * 1e3, 3),
            "t_decode_ms": round(self.t_decode_s * 1e3, 3),
            "prompt_tokens_per_second": round(self.prompt_tokens_per_second, 3),
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 3),
            "n_target_decodes": self.n_target_decodes,
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "n_verif_steps": self.n_verif_steps,
            "acceptance_rate": round(self.acceptance_rate, 5),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "n_accepted_by_type": dict(self.n_accepted_by_type),
            "accepted_per_pos": [round(c / self.n_verif_steps, 4) if self.n_verif_steps else 0.0 for c in self.n_accepted_per_pos],
            "n_replays": self.n_replays,
            "n_restores": self.n_restores,
            "n_checkpoints": self.n_checkpoints,
            "n_trims": self.n_trims,
            "n_draft_skipped": self.n_draft_skipped,
        }


#: the int and float fields of GenerationStats (what ``merge`` adds up)
_NUMERIC_FIELDS = tuple(f.name for f in fields(GenerationStats) if f.type in ("int", "float"))


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    prompt_tokens: list[int] = field(default_factory=list)
    #: per emitted token: True when it was a drafted token accepted by the target
    drafted_mask: list[bool] = field(default_factory=list)
    #: the error message when ``finish_reason`` is ``error``
    error: str | None = None
    #: per emitted token, its probabilities (:mod:`llamaspec.logprobs`) when the request asked for them, then
    #: those of the end-of-generation token it ended on (``stats.eog_token``), as llama-server lists them
    token_probs: "list[TokenProb] | None" = None


@dataclass(slots=True)
class Chunk:
    """What one slot emitted in one round: new tokens and the text that became final.

    ``n_from_draft`` of the leading ``tokens`` were drafted and accepted (the last token of a verification
    is always the target's own).
    """

    slot_id: int
    tokens: list[int]
    text: str
    finished: bool = False
    n_from_draft: int = 0
    #: the id of the request that produced the chunk (chunks are delivered to it)
    request_id: int | None = None
    #: when the request asked for probabilities: one entry per token (:mod:`llamaspec.logprobs`), then
    #: ``eog``'s when there is one (``texts`` has no entry for it)
    probs: "list[TokenProb] | None" = None
    #: the text each token made final (a stream can show it token by token); ``text`` is their join, then
    #: what the end of the request released (text held back for a stop string that never came)
    texts: list[str] | None = None
    #: a prompt-progress report instead of output (no tokens, no text): only for a request that asked
    progress: "PromptProgress | None" = None
    #: the end-of-generation token that ended the request (sampled, not output: not in ``tokens``)
    eog: int | None = None


@dataclass(frozen=True)
class PromptProgress:
    """How far a slot's prompt is (llama-server's ``prompt_progress``): ``total`` prompt tokens, ``cache`` of
    them reused from the prompt cache, ``processed`` in memory now (cached ones included), ``time_ms`` since
    the prompt started."""

    total: int
    cache: int
    processed: int
    time_ms: float


def progress_chunk(slot: "Slot", request_id: int | None = None) -> Chunk:
    """The progress report of ``slot``'s prompt as it is now (a chunk without tokens or text)."""
    started = slot.n_prompt_done > slot.stats.n_cached  # nothing decoded yet: no time spent on it
    p = PromptProgress(slot.n_prompt, slot.stats.n_cached, slot.n_prompt_done,
                       (time.perf_counter() - slot.t_start) * 1e3 if started else 0.0)
    return Chunk(slot.id, [], "", request_id=request_id, progress=p)


#: an idle slot's options (no request)
_IDLE = RequestOptions()


class Slot:
    """One sequence of the target context (``seq_id == id``)."""

    def __init__(self, slot_id: int):
        self.id = slot_id
        self.seq_id = slot_id  # its sequence in both contexts (an attribute: read many times per round)
        self.state = SlotState.IDLE
        self.sampler: "TargetSampler | None" = None
        #: tokens left in memory by the last finished request (the prompt cache), and when it finished
        self.cached: list[int] = []
        #: state after all but the last token of the last prompt, where trimming cannot restore a prefix
        self.prompt_ckpt: PromptCheckpoint | None = None
        #: the target memory holds ``cached`` but the draft memory nothing (a restored slot: llamaspec.slot_state)
        self.draft_behind = False
        self.t_last = 0.0
        self.spec_ckpt = Checkpoint()
        self.reset()

    def reset(self) -> None:
        #: the committed sequence: every token in the target memory, in order (prompt + committed output)
        self.tokens: list[int] = []
        self.n_prompt = 0
        self.n_prompt_done = 0  # prompt tokens in memory (cached or decoded so far)
        self.n_prompt_chunk = 0  # prompt tokens decoded in this round's batch
        #: leave a prompt checkpoint after ``len(prompt) - 1`` tokens (the last prompt token is decoded alone)
        self.want_prompt_ckpt = False
        #: the options of the request it serves (validated: llamaspec.options), referenced, not copied
        self.options = _IDLE
        #: adaptive draft length (llamaspec.adaptive), when the engine has it on
        self.adaptive: "DraftLengthController | None" = None
        self.prompt_tokens: list[int] = []  # the prompt, kept after the slot's memory is released
        self.sampled: int | None = None  # last token sampled by the target, not yet decoded
        self.generated: list[int] = []
        self.stream: TextStream | None = None
        self.finish_reason: FinishReason | None = None
        #: why it stopped, in llama-server's words: "eos" (end-of-generation token), "word" (a stop string,
        #: ``stopping_word``), "limit" (n_predict or a full context: ``truncated`` for the context)
        self.stop_type: str | None = None
        self.stopping_word: str = ""
        self.truncated = False
        self.error: str | None = None
        self.stats = GenerationStats()
        #: when the current phase (prompt, then generation) started (perf_counter)
        self.t_start = 0.0
        # speculative state (§7.1)
        self.spec_draft: list[int] = []
        self.spec_probs: list[np.ndarray] | None = None
        self.spec_i_batch: list[int] = []
        self.spec_ckpt.drop_sampler()
        self.spec_ckpt = Checkpoint()
        self.spec_is_replay = False
        #: the draft context caught up on this request's prompt (its first catch-up: llamaspec.round)
        self.draft_entered = False
        #: the request's verification rule (chosen once at submit; see llamaspec.verify.verifiers)
        self.verifier: "Verifier | None" = None

    def clear_round(self) -> None:
        """Forget the round in progress (its draft, rows and replay), after an error or an interrupt."""
        self.spec_draft, self.spec_probs, self.spec_is_replay, self.spec_i_batch = [], None, False, []

    @property
    def sampling(self) -> "llama.SamplingParams | None":
        return self.options.sampling

    @property
    def probs(self) -> "ProbsSpec | None":
        """The token probabilities the request asked for (None: none, and nothing is computed)."""
        return self.options.probs  # type: ignore[return-value] - validated: a ProbsSpec or None

    @property
    def n_predict(self) -> int:
        return self.options.n_predict

    @property
    def n_past(self) -> int:
        """Tokens in the target memory for this sequence."""
        return len(self.tokens)

    @property
    def n_remaining(self) -> int:
        """Tokens still allowed by ``n_predict`` (-1 = unlimited)."""
        return -1 if self.n_predict < 0 else self.n_predict - len(self.generated)
