"""One speculative round (§7.2-§7.5), step by step: :class:`Round`, composed by the Engine.

It reads as llama-server's round (docs/architecture.md, §N table): §7.2 draft and §7.3 after the draft (:class:`~llamaspec.draft_phase.DraftPhase`), §7.4
batch layout and decode, §7.5 verify, restore or accept, commit, emit. How far each slot drafts is the budget's
(:mod:`llamaspec.policy`); memory operations belong to the rollback objects (:mod:`llamaspec.memory`), which say
what they did and leave the counting and the sampler to the round; verification rules to the request's verifier
(:mod:`llamaspec.verify`). A failure is confined to the slot it belongs to: a batched draft or decode that raises
is retried slot by slot to find it. The round does not know requests or the scheduler: it returns a
:class:`RoundOutcome` (the chunks, the slots that finished or failed, the prompts that reached their checkpoint)
and the Engine acts on it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

from . import _llama as llama
from .ctx_shift import ContextShift
from .draft_phase import DraftPhase
from .emit import Emitter
from .errors import LlamaSpecError, MemoryOpError
from .logprobs import RoundProbs
from .sampler import GRAMMAR_END
from .slot import Chunk, FinishReason, Slot, SlotState, progress_chunk

if TYPE_CHECKING:  # pragma: no cover
    from .adaptive import CostModel
    from .chain import Chain
    from .memory import DraftRollback, TargetRollback
    from .policy import DraftBudget
    from .referee import Referee

log = logging.getLogger("llamaspec")
#: a decode of at least this many rows that are not all outputs times a prompt row (the cost model's prompt_row_ms)
PROMPT_ROWS = 32
_GENERATING, _PROMPT = SlotState.GENERATING, SlotState.PROMPT  # read per slot per round: a global is cheaper


@dataclass
class RoundOutcome:
    """What one round did, for the Engine to act on (filled as the round goes, so that it is complete up to
    the point of an interrupt)."""

    #: every chunk emitted, in order (one per slot that emitted or finished)
    chunks: list[Chunk] = field(default_factory=list)
    #: slots whose request finished normally (stop, length): their tokens may stay as the prompt cache
    finished: list[Slot] = field(default_factory=list)
    #: slots whose request failed: their memory must be released
    failed: list[Slot] = field(default_factory=list)
    #: prompt slots that reached ``len(prompt) - 1`` tokens with a prompt checkpoint wanted (§7.6)
    prompt_checkpoints: list[Slot] = field(default_factory=list)


@dataclass
class DecodeCounters:
    """Target decodes and the busy slots in them (``/metrics``' busy slots per decode)."""

    n_decode: int = 0
    n_busy_slots: int = 0


class Round:
    """The round's order of things over the Engine's parts (all given at construction)."""

    def __init__(self, ctx: "llama.Context", chain: "Chain | None", vocab: "llama.Vocab",
                 rollback_tgt: "TargetRollback", rollback_dft: "DraftRollback", budget: "DraftBudget",
                 cost_model: "CostModel | None", replay_accept_corrected: bool, referee: "Referee | None" = None):
        self.ctx = ctx
        #: speculate or not, from the throughput delivered (llamaspec.referee); None: always as the policy says
        self.referee = referee
        self.chain = chain
        self.rollback_tgt = rollback_tgt
        self.rollback_dft = rollback_dft
        self.cost_model = cost_model
        self.replay_accept_corrected = replay_accept_corrected
        self.emitter = Emitter(vocab, ctx.n_ctx_seq)
        #: §7.2-§7.3 (llamaspec.draft_phase): None without drafters
        self.drafting = (DraftPhase(chain, vocab, rollback_tgt, rollback_dft, budget, cost_model)
                         if chain is not None else None)
        self.shift = ContextShift(rollback_tgt, rollback_dft, chain, self.emitter, getattr(vocab, "add_bos", False))
        self.counters = DecodeCounters()
        self.out = RoundOutcome()

    # -- the round -----------------------------------------------------------------------------------
    def run(self, gen: list[Slot], prompts: list[Slot], out: RoundOutcome) -> None:
        """One round: draft for the generating slots, lay out their rows, fill the rest of the batch with
        prompt chunks (continuous batching), decode, then verify / finish prompts slot by slot; everything it
        did goes into ``out``."""
        self.out = out
        gen = self.shift.run(gen, self._fail)  # --context-shift: full slots drop old tokens first
        referee = self.referee if gen and not prompts else None  # a prompt chunk's time is not the generation's
        if self.referee is not None and not gen and len(prompts) == 1:
            self.referee.new_text(1)  # a lone slot's next request: a new text to judge
        if referee is not None:
            spec = referee.speculate(len(gen))
        else:  # untimed (prompt work in the round): as the batch size last decided
            spec = self.referee.peek(len(gen)) if self.referee is not None and gen else True
        if spec and referee is not None and len(referee.arms) > 1:
            self.chain.use_arm(referee.arm)
        t0 = time.perf_counter()
        fee = 0.0
        if self.drafting is not None and gen:
            self.chain.clear_catch_up()
            self.drafting.run(gen, self._fail, allow=spec)
            fee = self._entry_fee(gen)
        live = [s for s in gen if s.state is _GENERATING]
        n_drafted = sum(len(s.spec_draft) for s in live) if referee is not None else 0
        groups = self._batches(live)
        self._plan_prompts(groups, prompts)
        for group in groups:
            for decoded in self._decode_group(group):
                for s in decoded:
                    s.stats.n_target_decodes += 1
                    try:
                        if s.state is _PROMPT:
                            self._prompt_chunk_done(s)
                        else:
                            self._verify(s)
                    except Exception as e:  # noqa: BLE001 - confined to this slot
                        self._fail(s, e)
        if referee is not None:
            n_tokens = sum(len(ch.tokens) for ch in out.chunks)
            referee.record(spec, len(live), n_tokens, time.perf_counter() - t0 - fee, n_drafted)

    def _entry_fee(self, gen: list[Slot]) -> float:
        """Seconds of this round's drafting that a lone slot's referee leaves out: the draft context's first
        catch-up in a request (its prompt), paid once whatever is decided next, so the speculative rate is
        judged on the rounds' own cost. (Counted in with one slot, a 98-token prompt's catch-up made the first
        speculative round 440 ms against 46 for a plain one, and the request fell back to plain for 27 of its
        64 tokens where the draft's tokens were all accepted.) With several slots it stays counted: requests
        come and go there, and their prompts' catch-ups recur with every new batch."""
        if len(gen) != 1 or gen[0].draft_entered:
            return 0.0
        ms = self.chain.catch_up_ms()
        if ms <= 0.0:
            return 0.0
        gen[0].draft_entered = True
        return ms / 1e3

    def _decode(self, rows: list[llama.Row]) -> None:
        """Target decode followed by ``chain.process`` (every target decode, prompt chunks included)."""
        t0 = time.perf_counter()
        self.ctx.decode(rows)
        self._decoded(t0, len(rows), len({r.seq_id for r in rows}),
                      self.cost_model is not None and all(r.output for r in rows))
        if self.chain is not None and not self.chain.process(rows):
            raise LlamaSpecError("a drafter failed to process the target batch (see the log)")

    @staticmethod
    def _plain(group: list[Slot]) -> bool:
        """Every slot of ``group`` decodes its sampled token and nothing else (no prompt chunk, no draft)."""
        for s in group:
            if s.spec_draft or s.state is not _GENERATING:
                return False
        return True

    def _decode_plain(self, group: list[Slot]) -> None:
        """:meth:`_decode` of a :meth:`_plain` group of an engine without drafters (plain decoding's hot loop):
        the same decode, timing and counts, without building rows."""
        t0 = time.perf_counter()
        self.ctx.decode_next([s.sampled for s in group], [s.n_past for s in group], [s.seq_id for s in group])
        self._decoded(t0, len(group), len(group), True)
        for i, s in enumerate(group):
            s.spec_i_batch = [i]

    def _decoded(self, t0: float, n_rows: int, n_seqs: int, verification: bool) -> None:
        """After a target decode that started at ``t0``: its cost (``verification``: every row an output, the
        v(k) of the cost model) and the counts."""
        if verification and self.cost_model is not None:
            # on an asynchronous backend (CUDA, Metal) decode returns before the work is done: time the work
            self.ctx.wait_for_outputs()
            self.cost_model.add_decode(n_rows, (time.perf_counter() - t0) * 1e3)
        elif n_rows >= PROMPT_ROWS and self.cost_model is not None:  # a prompt chunk: what a prompt row costs
            self.cost_model.add_prompt(n_rows, (time.perf_counter() - t0) * 1e3)
        self.counters.n_decode += 1
        self.counters.n_busy_slots += n_seqs

    def _prompt_chunk_done(self, s: Slot) -> None:
        s.n_prompt_done += s.n_prompt_chunk
        if s.options.progress:
            self.out.chunks.append(progress_chunk(s))
        if s.want_prompt_ckpt and s.n_prompt_done == len(s.tokens) - 1:
            self.out.prompt_checkpoints.append(s)
        if s.n_prompt_done == len(s.tokens):
            self._prompt_done(s)

    def _prompt_done(self, slot: Slot) -> None:
        """§7.1: the prompt is in memory: ``chain.begin``, the sampler sees the prompt (llama-server's
        ``init_sampler``), the first token is sampled from the prompt's last row."""
        if self.chain is not None:
            self.chain.begin(slot.seq_id, slot.tokens, slot.options.owner)
        t1 = time.perf_counter()
        slot.stats.t_prompt_s = t1 - slot.t_start
        slot.t_start = t1
        slot.state = SlotState.GENERATING
        row = slot.spec_i_batch[0]
        slot.spec_i_batch = []
        if slot.n_predict == 0:  # prompt only: nothing is sampled
            log.info("slot %d: n_predict = 0, the prompt was processed and nothing generated", slot.id)
            slot.finish_reason, slot.stop_type = FinishReason.LENGTH, "limit"
            self._emit(slot, [], 0)
            return
        slot.sampler.accept_prompt(slot.tokens)
        rp = RoundProbs(slot.probs, slot.sampler) if slot.probs is not None else None
        tok = slot.sampler.sample(self.ctx, row)
        self._emit(slot, [tok], 0, rp.entries(self.ctx, [row], [tok]) if rp is not None else None)

    def _emit(self, slot: Slot, tokens: list[int], n_from_draft: int, probs: list | None = None) -> None:
        ch = self.emitter.emit(slot, tokens, n_from_draft, probs)
        self.out.chunks.append(ch)
        if ch.finished:
            self.out.finished.append(slot)

    def _fail(self, slot: Slot, exc: BaseException) -> None:
        """Finish one slot with ``error``; its memory is released by the Engine, the other slots go on."""
        msg = str(exc) if isinstance(exc, LlamaSpecError) and str(exc) else f"{type(exc).__name__}: {exc}"
        log.error("slot %d: request failed: %s", slot.id, msg)
        if self.chain is not None:
            self.chain.reset(slot.seq_id)
        slot.clear_round()
        slot.finish_reason, slot.error = FinishReason.ERROR, msg
        slot.state = SlotState.DONE
        slot.sampled = None
        slot.prompt_tokens = slot.tokens[: slot.n_prompt]
        text = slot.stream.flush() if slot.stream is not None else ""
        self.out.chunks.append(Chunk(slot.id, [], text, True, 0))
        self.out.failed.append(slot)

    def recover(self, slots: list[Slot]) -> list[Slot]:
        """After an interrupt mid-round: every live slot's memory must hold exactly its committed tokens (the
        rollback objects put it back) and its drafters forget the round; returns the slots for which that
        was impossible (and prompts, whose chunk cannot be told apart), now ``DONE`` with ``abort``."""
        aborted = []
        for s in slots:
            if s.state not in (SlotState.PROMPT, SlotState.GENERATING):
                continue
            if self.chain is not None:
                self.chain.reset(s.seq_id)
            s.clear_round()
            if s.state is SlotState.PROMPT or not self._recover_slot(s):
                if s.state is SlotState.GENERATING:
                    log.error("could not restore memory of slot %d after an error; the slot is closed", s.id)
                s.state = SlotState.DONE
                s.finish_reason = FinishReason.ABORT
                aborted.append(s)
            s.spec_ckpt.drop_sampler()
        return aborted

    # -- §7.4 batch layout and decode ----------------------------------------------------------------
    def _batches(self, gen: list[Slot]) -> list[list[Slot]]:
        """§7.4 batch layout: slots in order, a new decode when ``n_batch`` (or the context's output rows)
        is full; a slot's rows are never split over two decodes (their outputs are verified together)."""
        limit = min(self.ctx.n_batch, self.ctx.n_outputs_max)
        groups: list[list[Slot]] = [[]]
        n_rows = 0
        for s in gen:
            need = 1 + len(s.spec_draft)
            if n_rows + need > limit and groups[-1]:
                groups.append([])
                n_rows = 0
            groups[-1].append(s)
            n_rows += need
        return [g for g in groups if g]

    def _plan_prompts(self, groups: list[list[Slot]], prompts: list[Slot]) -> None:
        """§7.4 continuous batching: prompt tokens fill what the generating slots left of ``n_batch`` in the
        last decode, so a long prompt is spread over rounds instead of stalling the others. With no room left
        (or no generating slot), prompts get a decode of their own."""
        n_batch = self.ctx.n_batch
        room = n_batch - sum(1 + len(s.spec_draft) for s in groups[-1]) if groups and prompts else 0
        for s in prompts:
            end = len(s.tokens)
            if s.want_prompt_ckpt and s.n_prompt_done < end - 1:
                end -= 1  # a prompt checkpoint is taken before the last token (§7.6)
            left = end - s.n_prompt_done
            if room <= 0:
                groups.append([])
                room = n_batch
            s.n_prompt_chunk = min(left, room)
            groups[-1].append(s)
            room -= s.n_prompt_chunk

    def _rows(self, group: list[Slot]) -> list[llama.Row]:
        """``[sampled] + draft`` of every generating slot, all with outputs, and this round's chunk of every
        prompt (an output on its last token when the prompt completes); remembers each slot's row indices."""
        rows: list[llama.Row] = []
        for s in group:
            if s.state is _PROMPT:
                p0, n = s.n_prompt_done, s.n_prompt_chunk
                last = p0 + n == len(s.tokens)
                s.spec_i_batch = [len(rows) + n - 1] if last else []
                rows.extend(llama.Row(t, p0 + j, s.seq_id, last and j == n - 1)
                            for j, t in enumerate(s.tokens[p0 : p0 + n]))
                continue
            p0, i0, seq = s.n_past, len(rows), s.seq_id
            rows.append(llama.Row(s.sampled, p0, seq, True))
            if s.spec_draft:
                rows.extend(llama.Row(t, p0 + 1 + j, seq, True) for j, t in enumerate(s.spec_draft))
            s.spec_i_batch = list(range(i0, len(rows)))
        return rows

    def _decode_group(self, group: list[Slot]) -> Iterator[list[Slot]]:
        """§7.4 decode + process of one group; yields the slots whose rows are now decoded, to be verified
        before the next decode. When the decode fails, each slot's memory is put back to its committed
        tokens and its rows are decoded alone; a slot whose rows fail again fails."""
        try:
            if self.chain is None and self._plain(group):
                self._decode_plain(group)
            else:
                self._decode(self._rows(group))
        except Exception as e:  # noqa: BLE001 - find the slot it belongs to
            if len(group) == 1:
                self._fail(group[0], e)
                return
            log.warning("a decode of %d slots failed (%s); decoding each alone", len(group), e)
        else:
            yield group
            return
        for s in group:
            try:
                if not self._recover_slot(s):
                    raise MemoryOpError(f"slot {s.id}: memory could not be restored after a failed decode")
                if self.chain is not None:
                    self.chain.reset_drafters(s.seq_id)
                self._decode(self._rows([s]))
            except Exception as e:  # noqa: BLE001 - confined to this slot
                self._fail(s, e)
                continue
            yield [s]

    def _recover_slot(self, s: Slot) -> bool:
        """Put one slot's memory back to what it holds for sure: its committed tokens (generating), or the
        prompt tokens decoded before this round (a prompt: only a trimmable memory can drop a chunk)."""
        if s.state is not SlotState.PROMPT:
            return (self.rollback_tgt.recover(s.seq_id, s.n_past, s.spec_ckpt)
                    and self.rollback_dft.recover(s.seq_id, s.n_past, s.spec_ckpt))
        return (self.rollback_tgt.recover_prompt(s.seq_id, s.n_prompt_done)
                and self.rollback_dft.recover_prompt(s.seq_id, s.n_prompt_done))

    # -- §7.5 verify, restore or accept, commit, emit ------------------------------------------------
    def _verify(self, s: Slot) -> None:
        """§7.5 verification and acceptance of one slot; a round restored for a replay emits nothing."""
        draft, rows, is_replay = s.spec_draft, s.spec_i_batch, s.spec_is_replay
        s.spec_i_batch = []
        if not draft and s.probs is None:  # one row, one pick: nothing to roll back, count or compute
            accepted = s.verifier.verify(rows, draft)
            s.tokens.append(s.sampled)
            s.spec_probs = None
            self._emit(s, accepted, 0)
            return
        # 2. verify (or replay the decisions of a restored round)
        rp = RoundProbs(s.probs, s.sampler) if s.probs is not None else None  # before the sampler moves
        if is_replay:
            accepted = s.verifier.replay(rows, draft)
        else:
            accepted = s.verifier.verify(rows, draft, s.spec_probs)
            if draft and s.adaptive is not None:
                s.adaptive.update(len(draft), len(accepted) - 1)
        # 3.-4. restore + replay when seq_rm cannot drop the rejected rows: nothing is emitted this round
        n_rollback = len(draft) + 1 - len(accepted)
        if n_rollback > 0 and self.rollback_tgt.needs_restore(n_rollback):
            if rp is not None:
                rp.close()
            known = accepted[:-1] if accepted[-1] == GRAMMAR_END else accepted  # END: no token to decode again
            self._restore(s, known)  # (the replay samples END again: the grammar's state is the same)
            if not known:  # nothing to replay: the request ends with the memory as it was before this round
                s.spec_is_replay = False
                self._emit(s, accepted, 0)
            return
        probs = rp.entries(self.ctx, rows, accepted) if rp is not None else None  # this decode's logits
        # 5.-6. statistics: the chain, then the slot (a replayed target token is not an accepted draft)
        n_from_draft = 0
        if draft:
            n_from_draft = self._count_accepted(s, len(accepted) - 1, is_replay)
        # 7. commit the accepted tokens; 8. drop the rejected rows from both contexts
        s.tokens.append(s.sampled)
        s.tokens.extend(accepted[:-1])
        s.spec_draft, s.spec_probs, s.spec_is_replay = [], None, False
        if draft:
            s.spec_ckpt.drop_sampler()
            if self.rollback_tgt.commit(s.seq_id, s.n_past):
                s.stats.n_trims += 1
            self._redecode_draft(s, self.rollback_dft.commit(s.seq_id, s.n_past, s.spec_ckpt), s.n_past)
        # 9. emit
        self._emit(s, accepted, n_from_draft, probs)

    def _restore(self, s: Slot, accepted: list[int]) -> None:
        """§7.5 step 4: back to the checkpoint, the sampler as it was; the accepted tokens are replayed next."""
        s.spec_is_replay = True
        s.spec_draft = accepted
        s.spec_probs = None
        t0 = time.perf_counter()
        ckpt = s.spec_ckpt
        self.rollback_tgt.restore(s.seq_id, ckpt)
        sampler = ckpt.take_sampler()
        if sampler is not None:
            s.sampler.copy_from(sampler)
            sampler.close()
        s.stats.n_restores += 1
        self._redecode_draft(s, self.rollback_dft.restore(s.seq_id, ckpt), ckpt.pos_max + 1)
        if self.cost_model is not None:
            self.cost_model.add_restore((time.perf_counter() - t0) * 1e3)

    def _redecode_draft(self, s: Slot, pos0: int | None, end: int) -> None:
        """A FULL draft memory went back to its checkpoint at ``pos0``: the committed tokens up to ``end``
        are decoded into it again, by the drafter that owns it (in its own ids: a trimmed vocabulary maps
        them). Where no drafter does (drafters given by the caller, a head or MTP context), the slot fails
        with :class:`MemoryOpError`: target ids are never decoded into a context whose vocabulary or inputs
        are not the target's."""
        if pos0 is None:
            return
        redo = s.tokens[pos0:end]
        if redo and not (self.chain is not None and self.chain.redecode(s.seq_id, redo, pos0)):
            raise MemoryOpError(f"slot {s.id}: the draft context cannot drop the rejected draft rows (a FULL "
                                f"memory) and no drafter decodes the {len(redo)} committed tokens into it again")

    def _count_accepted(self, s: Slot, n_accepted: int, is_replay: bool) -> int:
        """Statistics of one verified draft; returns how many emitted tokens came from a draft."""
        chain = self.chain
        if chain is not None and not self.replay_accept_corrected:
            # llama.cpp's QUIRK (§7.5 step 6): the chain hears len(accepted)-1 even in a replay round
            chain.accept(s.seq_id, n_accepted)
        if is_replay and n_accepted > 0:
            n_accepted -= 1  # the last replayed token was the target's, not a draft's
        if is_replay:
            s.stats.n_replays += 1
        if chain is not None and self.replay_accept_corrected:
            chain.accept(s.seq_id, n_accepted)
        s.stats.count_verified(n_accepted, chain.drafted_by(s.seq_id) if chain is not None else None)
        return n_accepted
