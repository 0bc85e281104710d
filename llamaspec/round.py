"""The speculative round of :class:`~llamaspec.engine.Engine` (spec §7.2-§7.5), step by step.

:class:`SpeculativeRound` is the part of the Engine that runs one round for the generating slots (and the
prompt of a new request). It reads as the spec: §7.2 draft, §7.3 after the draft, §7.4 batch layout and
decode, §7.5 verify, restore or accept, commit, emit. Memory operations belong to the rollback objects
(:mod:`llamaspec.memory`), verification rules to the request's verifier (:mod:`llamaspec.verify`); this
module only orders them. A failure is confined to the slot it belongs to (``_fail``, defined by the
Engine): a batched draft or decode that raises is retried slot by slot to find it.

Attributes it uses, set by the Engine: ``ctx``, ``chain``, ``vocab``, ``spec``, ``rollback_tgt``,
``rollback_dft``, ``n_ctx_seq``, ``_n_rows_max_per_seq``.
"""
from __future__ import annotations

import logging
import time
from typing import Iterator

from . import _llama as llama
from .adaptive import best_shared_length
from .errors import LlamaSpecError, MemoryOpError
from .level import Level
from .request import RequestState
from .slot import Chunk, FinishReason, Slot, SlotState

log = logging.getLogger("llamaspec")


class SpeculativeRound:
    def _decode(self, rows: list[llama.Row]) -> None:
        """Target decode followed by ``chain.process`` (every target decode, prompt chunks included)."""
        t0 = time.perf_counter()
        self.ctx.decode(rows)
        if self.cost_model is not None and all(r.output for r in rows):  # verification rows: v(k)
            self.cost_model.add_decode(len(rows), (time.perf_counter() - t0) * 1e3)
        self.n_decode_total += 1
        self.n_busy_slots_total += len({r.seq_id for r in rows})
        if self.chain is not None and not self.chain.process(rows):
            raise LlamaSpecError("a drafter failed to process the target batch (see the log)")

    def _prompt_done(self, slot: Slot) -> Chunk:
        """§7.1: the prompt is in memory: ``chain.begin``, the sampler sees the prompt (llama-server's
        ``init_sampler``), the first token is sampled from the prompt's last row."""
        if self.chain is not None:
            self.chain.begin(slot.seq_id, slot.prompt)
        t1 = time.perf_counter()
        slot.stats.t_prompt_s = t1 - slot._t0
        slot._t0 = t1
        slot.state = SlotState.GENERATING
        if slot.request is not None:
            slot.request.state = RequestState.GENERATING
        row = slot.spec_i_batch[0]
        slot.spec_i_batch = []
        if slot.n_predict == 0:  # prompt only: nothing is sampled
            log.info("slot %d: n_predict = 0, the prompt was processed and nothing generated", slot.id)
            slot.finish_reason, slot.stop_type = FinishReason.LENGTH, "limit"
            return self._emit(slot, [], 0)
        slot.sampler.accept_prompt(slot.prompt)
        return self._emit(slot, [slot.sampler.sample(self.ctx, row)], 0)

    # -- the speculative round (spec §7.2-§7.5) ----------------------------------------------------
    def _n_draft_max(self, s: Slot) -> int:
        """§7.1's ``n_draft_max``, further capped so the slot's rows fit one decode (``n_batch`` and the
        per-sequence output rows) and never pass ``n_predict``."""
        n = self.n_ctx_seq - s.n_past - 2
        if s.n_remaining > 0:
            n = min(n, s.n_remaining - 1)
        return min(n, self._n_rows_max_per_seq - 1)

    def _round(self, gen: list[Slot], prompts: list[Slot], out: list[Chunk]) -> None:
        """One round: draft for the generating slots, lay out their rows, fill the rest of the batch with
        prompt chunks (continuous batching), decode, then verify / finish prompts slot by slot."""
        if self.chain is not None and gen:
            for s in self._draft(gen, out):
                try:
                    self._after_draft(s)
                except Exception as e:  # noqa: BLE001 - confined to this slot
                    out.append(self._fail(s, e))
        live = [s for s in gen if s.state is SlotState.GENERATING]
        groups = self._batches(live)
        self._plan_prompts(groups, prompts)
        for group in groups:
            for decoded in self._decode_group(group, out):
                for s in decoded:
                    s.stats.n_target_decodes += 1
                    try:
                        if s.state is SlotState.PROMPT:
                            s.n_prompt_done += s.n_prompt_chunk
                            if s.want_prompt_ckpt and s.n_prompt_done == len(s.prompt) - 1:
                                self._save_prompt_ckpt(s)
                            ch = self._prompt_done(s) if s.n_prompt_done == len(s.prompt) else None
                        else:
                            ch = self._verify(s)
                    except Exception as e:  # noqa: BLE001 - confined to this slot
                        ch = self._fail(s, e)
                    if ch is not None:
                        out.append(ch)

    def _plan_prompts(self, groups: list[list[Slot]], prompts: list[Slot]) -> None:
        """§7.4 continuous batching: prompt tokens fill what the generating slots left of ``n_batch`` in the
        last decode, so a long prompt is spread over rounds instead of stalling the others. With no room left
        (or no generating slot), prompts get a decode of their own."""
        n_batch = self.ctx.n_batch
        room = n_batch - sum(1 + len(s.spec_draft) for s in groups[-1]) if groups else 0
        for s in prompts:
            end = len(s.prompt)
            if s.want_prompt_ckpt and s.n_prompt_done < end - 1:
                end -= 1  # a prompt checkpoint is taken before the last token (§7.6)
            left = end - s.n_prompt_done
            if room <= 0:
                groups.append([])
                room = n_batch
            s.n_prompt_chunk = min(left, room)
            groups[-1].append(s)
            room -= s.n_prompt_chunk

    def _adaptive_lengths(self, caps: list[tuple[Slot, int]]) -> list[tuple[Slot, int]]:
        """Beyond llama.cpp (:mod:`llamaspec.adaptive`): the draft length that pays best now, from each slot's
        measured acceptance and the measured costs; alone a slot gets its own best length, several drafting
        slots share one (the cost of a row grows with the batch: longer batches, shorter drafts)."""
        cost, tgt = self.cost_model, self.rollback_tgt
        live = [(s, min(n, s.adaptive.k_max)) for s, n in caps if s.adaptive is not None and n > 0]
        if not live:
            return caps
        rates = [s.adaptive.rates() for s, _ in live]

        def overhead(i: int, k: int) -> float:  # checkpoint + restore of a FULL / RS target (cost-gated)
            return cost.checkpoint_overhead(rates[i], k) if tgt.needs_checkpoint(k) else 0.0

        # one slot alone is the same choice as DraftLengthController.choose (rows = k + 1, one draft step each)
        k = best_shared_length(rates, [n for _, n in live], lambda rows: cost.verify_cost(rows - 1),
                               cost.draft_step_cost(len(live)), overhead)
        chosen = {s.id: s.adaptive.explore(min(k, n), n) for s, n in live}
        for s, _ in live:
            if chosen[s.id] == 0:
                s.stats.n_draft_skipped += 1
        return [(s, chosen.get(s.id, n)) for s, n in caps]

    def _draft(self, gen: list[Slot], out: list[Chunk]) -> list[Slot]:
        """§7.2 drafting phase: one ``chain.draft()`` for every slot that may draft; replay rounds skip it.
        When the chain raises, each slot drafts alone, and the slot whose draft raises fails."""
        chain = self.chain
        requested: list[Slot] = []
        caps: list[tuple[Slot, int]] = []
        for s in gen:
            chain.dparams[s.seq_id].drafting = False
            try:
                if s.spec_draft:  # replay round: no new draft
                    self.rollback_tgt.check_replay(s)
                    continue
            except Exception as e:  # noqa: BLE001 - confined to this slot
                out.append(self._fail(s, e))
                continue
            n_max = self._n_draft_max(s)
            req = s.spec_req
            if req is not None and req.n_max is not None:
                n_max = min(n_max, req.n_max)  # per-request settings only lower the engine's
            caps.append((s, n_max))
        if self.cost_model is not None:
            caps = self._adaptive_lengths(caps)
        for s, n_max in caps:
            if n_max <= 0:
                continue
            try:
                self.rollback_tgt.mark(s)
                self.rollback_dft.before_draft(s)
            except Exception as e:  # noqa: BLE001 - confined to this slot
                out.append(self._fail(s, e))
                continue
            req = s.spec_req
            dp = chain.dparams[s.seq_id]
            dp.drafting, dp.n_max, dp.pos0, dp.id_last = True, n_max, s.n_past, s.sampled
            dp.prompt, dp.result, dp.probs = tuple(s.prompt), [], None
            dp.n_min = req.n_min if req is not None else None
            dp.p_min = req.p_min if req is not None else None
            requested.append(s)
        if not requested:
            return requested
        try:
            t0 = time.perf_counter()
            chain.draft()
            if self.cost_model is not None:
                lens = [len(chain.dparams[s.seq_id].result) for s in requested]
                self.cost_model.add_draft(sum(lens), (time.perf_counter() - t0) * 1e3, n_seqs=len(requested),
                                          n_steps=max(lens))
            return requested
        except Exception as e:  # noqa: BLE001 - find the slot it belongs to
            if len(requested) == 1:
                out.append(self._fail(requested[0], e))
                return []
            log.warning("drafting failed for %d slots together (%s); drafting each alone", len(requested), e)
        ok: list[Slot] = []
        params = [(s, chain.dparams[s.seq_id]) for s in requested]
        for s, dp in params:
            chain.reset(s.seq_id)
        for s, dp in params:
            dp.drafting, dp.pos0, dp.id_last = True, s.n_past, s.sampled  # n_max, n_min, p_min as set above
            dp.prompt, dp.result, dp.probs = tuple(s.prompt), [], None
            try:
                if not self.rollback_dft.recover(s):  # drop what the failed batch decoded
                    raise MemoryOpError(f"slot {s.id}: the draft memory could not be restored after a failed draft")
                chain.draft()
                ok.append(s)
            except Exception as e:  # noqa: BLE001 - confined to this slot
                out.append(self._fail(s, e))
        return ok

    def _after_draft(self, s: Slot) -> None:
        """§7.3 post-draft checkpointing: take the draft, roll the draft context back to the committed
        tokens, checkpoint the target when this draft's rollback will need it."""
        dp = self.chain.dparams[s.seq_id]
        draft = list(dp.result[: max(0, self._n_draft_max(s))])
        n_vocab = self.vocab.n_tokens
        bad = next((i for i, t in enumerate(draft) if not 0 <= t < n_vocab), None)
        if bad is not None:  # a token the target cannot decode ends the draft
            log.warning("slot %d: draft token %d is outside the target vocabulary; draft cut at %d",
                        s.id, draft[bad], bad)
            del draft[bad:]
        s.spec_draft = draft
        s.spec_probs = dp.probs[: len(draft)] if dp.probs is not None else None
        s.stats.n_drafted += len(s.spec_draft)
        self.rollback_dft.after_draft(s)
        n_ckpt, t0 = s.stats.n_checkpoints, time.perf_counter()
        self.rollback_tgt.checkpoint(s)
        if self.cost_model is not None and s.stats.n_checkpoints > n_ckpt:
            self.cost_model.add_checkpoint((time.perf_counter() - t0) * 1e3)

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

    def _rows(self, group: list[Slot]) -> list[llama.Row]:
        """``[sampled] + draft`` of every generating slot, all with outputs, and this round's chunk of every
        prompt (an output on its last token when the prompt completes); remembers each slot's row indices."""
        rows: list[llama.Row] = []
        for s in group:
            if s.state is SlotState.PROMPT:
                p0, n = s.n_prompt_done, s.n_prompt_chunk
                last = p0 + n == len(s.prompt)
                s.spec_i_batch = [len(rows) + n - 1] if last else []
                rows.extend(llama.Row(t, p0 + j, s.seq_id, last and j == n - 1)
                            for j, t in enumerate(s.prompt[p0 : p0 + n]))
                continue
            p0 = s.n_past
            s.spec_i_batch = list(range(len(rows), len(rows) + 1 + len(s.spec_draft)))
            rows.append(llama.Row(s.sampled, p0, s.seq_id, True))
            rows.extend(llama.Row(t, p0 + 1 + j, s.seq_id, True) for j, t in enumerate(s.spec_draft))
        return rows

    def _decode_group(self, group: list[Slot], out: list[Chunk]) -> Iterator[list[Slot]]:
        """§7.4 decode + process of one group; yields the slots whose rows are now decoded, to be verified
        before the next decode. When the decode fails, each slot's memory is put back to its committed
        tokens and its rows are decoded alone; a slot whose rows fail again fails."""
        try:
            self._decode(self._rows(group))
        except Exception as e:  # noqa: BLE001 - find the slot it belongs to
            if len(group) == 1:
                out.append(self._fail(group[0], e))
                return
            log.warning("a decode of %d slots failed (%s); decoding each alone", len(group), e)
        else:
            yield group
            return
        for s in group:
            try:
                if not self._recover_slot(s):
                    raise MemoryOpError(f"slot {s.id}: memory could not be restored after a failed decode")
                for d in (self.chain.impls if self.chain else ()):
                    d.reset(s.seq_id)
                self._decode(self._rows([s]))
            except Exception as e:  # noqa: BLE001 - confined to this slot
                out.append(self._fail(s, e))
                continue
            yield [s]

    def _verify(self, s: Slot) -> Chunk | None:
        """§7.5 verification and acceptance of one slot; ``None`` when the round is restored for a replay."""
        draft, rows, is_replay = s.spec_draft, s.spec_i_batch, s.spec_is_replay
        s.spec_i_batch = []
        # 2. verify (or replay the decisions of a restored round)
        if is_replay:
            accepted = s.verifier.replay(rows, draft)
        else:
            accepted = s.verifier.verify(rows, draft, s.spec_probs)
            if draft and s.adaptive is not None:
                s.adaptive.update(len(draft), len(accepted) - 1)
        # 3.-4. restore + replay when seq_rm cannot drop the rejected rows: nothing is emitted this round
        n_rollback = len(draft) + 1 - len(accepted)
        if n_rollback > 0 and self.rollback_tgt.needs_restore(n_rollback):
            s.spec_is_replay = True
            s.spec_draft = accepted
            s.spec_probs = None
            t0 = time.perf_counter()
            self.rollback_tgt.restore(s)
            self.rollback_dft.restore(s)
            if self.cost_model is not None:
                self.cost_model.add_restore((time.perf_counter() - t0) * 1e3)
            return None
        # 5.-6. statistics: the chain, then the slot (a replayed target token is not an accepted draft)
        if draft:
            self._count_accepted(s, len(accepted) - 1, is_replay)
        # 7. commit the accepted tokens; 8. drop the rejected rows from both contexts
        s.prompt.append(s.sampled)
        s.prompt.extend(accepted[:-1])
        s.spec_draft, s.spec_probs, s.spec_is_replay = [], None, False
        if draft:
            self.rollback_tgt.commit(s)
            self.rollback_dft.commit(s)
        # 9. emit
        return self._emit(s, accepted, len(accepted) - 1)

    def _count_accepted(self, s: Slot, n_accepted: int, is_replay: bool) -> None:
        if self.chain is not None and not self.spec.replay_accept_corrected:
            # llama.cpp's QUIRK (spec §7.5 step 6): the chain hears len(accepted)-1 even in a replay round
            self.chain.accept(s.seq_id, n_accepted)
        if is_replay and n_accepted > 0:
            n_accepted -= 1  # the last replayed token was the target's, not a draft's
        if is_replay:
            s.stats.n_replays += 1
        if self.chain is not None and self.spec.replay_accept_corrected:
            self.chain.accept(s.seq_id, n_accepted)
        st = s.stats
        impl = self.chain.impl_last[s.seq_id] if self.chain is not None else None
        if impl is not None and n_accepted > 0:
            st.n_accepted_by_type[impl.type] = st.n_accepted_by_type.get(impl.type, 0) + n_accepted
        st.n_accepted += n_accepted
        st.n_verif_steps += 1
        per = st.n_accepted_per_pos
        if len(per) < n_accepted:
            per.extend([0] * (n_accepted - len(per)))
        for i in range(n_accepted):
            per[i] += 1

    def _emit(self, slot: Slot, tokens: list[int], n_from_draft: int) -> Chunk:
        """Commit sampled tokens to the slot's output, apply EOG / stop strings / limits."""
        emitted: list[int] = []
        text = ""
        for t in tokens:
            if self.vocab.is_eog(t):
                slot.finish_reason, slot.stop_type = FinishReason.STOP, "eos"
                break
            emitted.append(t)
            slot.generated.append(t)
            text += slot.stream.feed(self.vocab.token_to_piece(t))
            if slot.stream.stopped:
                slot.finish_reason, slot.stop_type = FinishReason.STOP, "word"
                slot.stopping_word = slot.stream.stop_string
                break
            if slot.n_remaining == 0:
                slot.finish_reason, slot.stop_type = FinishReason.LENGTH, "limit"
                break
        if slot.finish_reason is None and slot.n_past >= self.n_ctx_seq - 1:
            # no room left to decode the sampled token
            slot.finish_reason, slot.stop_type, slot.truncated = FinishReason.LENGTH, "limit", True
        slot.sampled = tokens[-1] if slot.finish_reason is None else None
        slot.stats.n_predicted = len(slot.generated)
        now = time.perf_counter()
        if slot.state is SlotState.GENERATING and slot.stats.t_prompt_s > 0:
            slot.stats.t_decode_s = now - slot._t0
        finished = slot.finish_reason is not None
        if finished:
            text += slot.stream.flush()
            slot.state = SlotState.DONE
            slot.prompt_tokens = slot.prompt[: slot.n_prompt]
            self._retire(slot)
        return Chunk(slot, emitted, text, finished, min(n_from_draft, len(emitted)), slot.request)

    def _recover_slot(self, s: Slot) -> bool:
        """Put one slot's memory back to what it holds for sure: its committed tokens (generating), or the
        prompt tokens decoded before this round (a prompt: only a trimmable memory can drop a chunk)."""
        if s.state is not SlotState.PROMPT:
            return self.rollback_tgt.recover(s) and self.rollback_dft.recover(s)
        done = s.n_prompt_done
        for rb in (self.rollback_tgt, self.rollback_dft):
            if rb.ctx is None:
                continue
            memory = rb.ctx.memory
            if memory.pos_max(s.seq_id) >= done and (rb.level is not Level.PART or not memory.seq_rm(s.seq_id, done, -1)):
                return False
            if memory.pos_max(s.seq_id) != done - 1:
                return False
        return True
