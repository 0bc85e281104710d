"""The engine: one loop for 1..N slots (design.md, "one loop"), plain and speculative.

Each slot is one sequence (``seq_id`` = slot id) of the target context. A slot goes through ``PROMPT`` (its
prompt is decoded in chunks of ``n_batch``, each chunk followed by ``chain.process``; then ``chain.begin``
and the first token is sampled from the last row), ``GENERATING`` and ``DONE`` (its sequence is removed
from memory so the slot can be reused).

One round of :meth:`Engine.step` for the generating slots follows llama.cpp's server (spec §7.2–§7.5):

1. **draft**: every slot that may draft gets a request; one ``chain.draft()`` call serves all of them;
2. **checkpoint**: drafted tokens are removed from the draft context; a target checkpoint is taken when
   the memory level needs one for this draft length (FULL, or RS beyond ``n_rs_seq``);
3. **decode**: one batched target decode of every slot's ``[sampled] + draft`` rows (all with logits),
   followed by ``chain.process(rows)``;
4. **verify**: sample-and-match (default), rejection sampling, replay of a restored round, or synthetic
   acceptance;
5. **roll back**: trim rejected rows (``seq_rm``) or restore the checkpoint and replay next round;
6. **emit** the accepted tokens (EOG, stop strings and limits apply).

Vocabulary follows llama.cpp: ``sampled`` is the last token sampled by the target and **not yet decoded**;
``n_past`` is the number of tokens in the target memory for the sequence, so after every round
``seq_pos_max(seq) == n_past - 1`` on the target and the draft context (restored on every exit path).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from . import _llama as L
from .chain import Chain, build_chain
from .drafters.base import Drafter
from .errors import ContextOverflowError, LlamaSpecError, MemoryOpError, UsageError
from .memory import Rollback, rollback_for
from .params import SpecParams
from .probe import Level, can_seq_rm
from .slot import Chunk, FinishReason, GenerationResult, GenerationStats, Slot, SlotState
from .text import TextStream

__all__ = ["Engine", "Chunk", "FinishReason", "GenerationResult", "GenerationStats", "Slot", "SlotState"]

log = logging.getLogger("llamaspec")

DEFAULT_N_CTX = 4096
VERIFY_MODES = ("match", "rejection")
DRAFT_HEAD_ARCHS = ("eagle3", "dflash")


class Engine:
    """Owns the target (and optional draft) model and context, the chain, and N slots.

    >>> # doctest: +SKIP
    >>> with Engine("target.gguf", draft="draft.gguf") as eng:
    ...     print(eng.generate("def fibonacci(n):", n_predict=32).text)
    """

    def __init__(
        self,
        target: L.Model | str | Path,
        *,
        draft: L.Model | str | Path | None = None,
        spec: SpecParams | None = None,
        verify: str = "match",
        n_ctx: int = DEFAULT_N_CTX,
        n_parallel: int = 1,
        n_batch: int = 512,
        n_ubatch: int | None = None,
        n_threads: int | None = None,
        n_threads_draft: int | None = None,
        flash_attn: bool | None = None,
        kv_f32: bool = False,
        n_rs_seq: int | None = None,
        drafters: "Sequence[Drafter] | None" = None,
    ):
        """``drafters``: your own :class:`~llamaspec.drafters.base.Drafter` objects, in priority order, used
        instead of the chain that ``spec`` describes (their ``n_seq`` must equal ``n_parallel``)."""
        if n_parallel < 1:
            raise UsageError(f"n_parallel must be >= 1, got {n_parallel}")
        if n_ctx < 8:
            raise UsageError(f"context size must be >= 8, got {n_ctx}")
        if n_batch < 1:
            raise UsageError(f"batch size must be >= 1, got {n_batch}")
        if verify not in VERIFY_MODES:
            raise UsageError(f"unknown verification mode {verify!r} (valid: {', '.join(VERIFY_MODES)})")
        spec = spec or SpecParams()
        if draft is not None and spec.types_are_default:
            spec.add_types("draft-simple")
        if spec.draft.n_max < 0:
            raise UsageError(f"--spec-draft-n-max must be >= 0, got {spec.draft.n_max}")
        self.spec = spec
        self.verify = verify
        self.n_parallel = n_parallel
        self._owned: list = []
        self.ctx_dft: L.Context | None = None
        self.model_dft: L.Model | None = None
        self.chain: Chain | None = None
        self.synth_cond: list[float] | None = None
        try:
            self.model = self._own_model(target)
            if self.model.arch in DRAFT_HEAD_ARCHS:
                raise UsageError(f"{self.model.path.name} is a {self.model.arch} draft head, not a standalone model: "
                                 "use it as a draft for its target model")
            if self.model.n_ctx_train > 0 and n_ctx > self.model.n_ctx_train:
                log.info("n_ctx %d > n_ctx_train %d of %s: clamped", n_ctx, self.model.n_ctx_train, self.model.path.name)
                n_ctx = self.model.n_ctx_train
            speculating = not spec.types_are_default or spec.has_synth() or bool(drafters)
            n_draft = spec.n_max_of_types() if speculating else 0
            if drafters:
                n_draft = max([n_draft] + [max(0, d.n_max) for d in drafters])
            n_out, n_out_seq = L.output_limits(n_batch, n_parallel, n_draft)
            common = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch or n_batch, n_seq_max=n_parallel,
                          n_threads=n_threads, flash_attn=flash_attn, kv_f32=kv_f32)
            self.ctx = self._own(L.Context(self.model, L.ContextParams(
                n_rs_seq=spec.need_n_rs_seq() if n_rs_seq is None else n_rs_seq,
                n_outputs_max=n_out, n_outputs_max_per_seq=n_out_seq, **common)))
            self.tgt_level = can_seq_rm(self.ctx) if speculating else Level.PART
            if speculating and self.tgt_level is Level.NO:
                log.warning("the target context has no memory to roll back (level NO): speculative decoding is off")
                speculating = False
            if speculating and draft is not None:
                self.model_dft = self._own_model(draft)
                if self.model_dft.arch in DRAFT_HEAD_ARCHS:
                    raise UsageError(f"draft {self.model_dft.path.name} is a {self.model_dft.arch} head; its drafter "
                                     f"(draft-{self.model_dft.arch}) is not implemented yet in llamaspec: use a small "
                                     "standalone model of the target's family as the draft")
                common["n_threads"] = n_threads_draft or n_threads
                self.ctx_dft = self._own(L.Context(self.model_dft, L.ContextParams(
                    n_rs_seq=0, n_outputs_max=n_parallel, n_outputs_max_per_seq=1, **common)))
            if speculating and drafters:
                bad = [d for d in drafters if d.n_seq != n_parallel]
                if bad:
                    raise UsageError(f"drafter {bad[0].type} was built for n_seq={bad[0].n_seq}, the engine has {n_parallel} slots")
                self.chain = Chain(list(drafters), n_parallel)
            elif speculating:
                self.chain = build_chain(spec, n_parallel, self.ctx, self.ctx_dft)
                if self.chain is not None:
                    self._owned.append(self.chain)
            self.dft_level = can_seq_rm(self.ctx_dft) if (self.chain and self.ctx_dft) else Level.NO
            if self.chain is None and self.ctx_dft is not None:
                self.ctx_dft.close()
                self.ctx_dft = None
            if self.chain is not None and spec.has_synth():
                from .synth import conditional_probs, resolve_synth_rates

                rates = resolve_synth_rates(spec.synth_len, spec.synth_rates, self.chain.n_max)
                self.synth_cond = conditional_probs(rates) if rates else None
        except BaseException:
            self.close()
            raise
        # draft-KV reuse (beyond llama.cpp) only where the draft memory can be trimmed afterwards
        self._keep_draft_kv = False
        for d in (self.chain.impls if self.chain else []):
            if getattr(d, "reuse_kv", False):
                if self.dft_level is Level.PART:
                    self._keep_draft_kv = True
                else:
                    d.reuse_kv = False
                    log.info("draft KV reuse needs a trimmable (PART) draft memory; using llama.cpp's re-decode")
        self.rb_tgt: Rollback = rollback_for(self.tgt_level, self.ctx)
        self.rb_dft: Rollback | None = rollback_for(self.dft_level, self.ctx_dft) if self.ctx_dft else None
        self.vocab = self.model.vocab
        self.slots = [Slot(i) for i in range(n_parallel)]

    def _own_model(self, m: L.Model | str | Path) -> L.Model:
        if isinstance(m, L.Model):
            return m
        return self._own(L.Model(m))

    def _own(self, obj):
        self._owned.append(obj)
        return obj

    # ------------------------------------------------------------------------------------------
    # lifetime
    # ------------------------------------------------------------------------------------------
    def close(self) -> None:
        for s in getattr(self, "slots", []):
            if s.sampler is not None:
                s.sampler.close()
                s.sampler = None
        for obj in reversed(getattr(self, "_owned", [])):
            obj.close()
        self._owned = []

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def speculative(self) -> bool:
        return self.chain is not None

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
        slot.sampler = sampler
        slot.sampling = sampling
        slot.prompt = tokens
        slot.n_prompt = len(tokens)
        slot.n_predict = n_predict
        slot.stream = TextStream(stop)
        slot.state = SlotState.PROMPT
        slot.stats.n_prompt = len(tokens)
        if self.synth_cond is not None:
            from .synth import Mt19937Uniform

            slot.synth_rng = Mt19937Uniform(sampling.seed)
        # rejection sampling computes the target distribution in numpy from the logits; a grammar or
        # repetition penalties live inside llama.cpp's sampler chain, so those requests verify by
        # sample-and-match instead (still exact in distribution for greedy drafts)
        rejection = (self.verify == "rejection" and not sampling.greedy and not sampling.grammar
                     and sampling.repeat_penalty == 1.0 and not sampling.frequency_penalty and not sampling.presence_penalty)
        if self.verify == "rejection" and not rejection and not sampling.greedy:
            log.info("slot %d: grammar or penalties set, verifying by sample-and-match", slot.id)
        if rejection:
            seed = None if sampling.seed == L.DEFAULT_SEED else sampling.seed
            slot.rng = np.random.Generator(np.random.MT19937(seed))
        if self.chain is not None:
            for d in self.chain.impls:
                cfg = getattr(d, "configure_sampling", None)
                if cfg is not None:
                    cfg(slot.seq_id, sampling.temp if rejection else 0.0, sampling.seed)
        return slot

    def cancel(self, slot: Slot) -> None:
        """Abandon a request: its memory is freed and the slot becomes reusable."""
        if slot.state in (SlotState.PROMPT, SlotState.GENERATING):
            slot.finish_reason = FinishReason.ABORT
            slot.state = SlotState.DONE
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        for ctx in (self.ctx, self.ctx_dft):
            if ctx is not None and ctx.ptr and ctx.memory is not None:
                ctx.memory.seq_rm(slot.seq_id, 0, -1)
        slot.prompt = []
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
                out.extend(self._round(gen))
        except BaseException:
            self._restore_invariant()
            raise
        return out

    def _restore_invariant(self) -> None:
        """After an exception mid-round: drop anything past ``n_past`` so memory matches bookkeeping.

        FULL memories cannot trim: when their tail is ahead of the bookkeeping, the slot's checkpoint (taken
        at ``n_past``) is restored first.
        """
        for s in self.slots:
            if s.state not in (SlotState.PROMPT, SlotState.GENERATING):
                continue
            if s.state is SlotState.PROMPT:
                self._release(s)
                s.prompt = []
                s.state = SlotState.DONE
                s.finish_reason = FinishReason.ABORT
                continue
            s.spec_draft, s.spec_is_replay, s.spec_i_batch = [], False, []
            for ctx, loader in ((self.ctx, s.spec_ckpt.load_tgt), (self.ctx_dft, s.spec_ckpt.load_dft)):
                if ctx is None or not ctx.ptr or ctx.memory is None:
                    continue
                if ctx.memory.pos_max(s.seq_id) < s.n_past:
                    continue
                if not ctx.memory.seq_rm(s.seq_id, s.n_past, -1):
                    if s.spec_ckpt.n_tokens == s.n_past:
                        loader(ctx, s.seq_id)
                    if not ctx.memory.seq_rm(s.seq_id, s.n_past, -1):
                        log.error("could not restore memory of slot %d after an error; the slot is closed", s.id)
                        self._release(s)
                        s.state = SlotState.DONE
                        s.finish_reason = FinishReason.ABORT

    def _decode(self, rows: list[L.Row]) -> None:
        """Target decode followed by ``chain.process`` (every target decode, prompt chunks included)."""
        self.ctx.decode(rows)
        if self.chain is not None and not self.chain.process(rows):
            raise LlamaSpecError("a drafter failed to process the target batch (see the log)")

    def _process_prompt(self, slot: Slot) -> Chunk:
        slot._t0 = time.perf_counter()
        toks = slot.prompt
        nb = self.ctx.n_batch
        for start in range(0, len(toks), nb):
            chunk = toks[start : start + nb]
            last = start + len(chunk) == len(toks)
            self._decode([L.Row(t, start + j, slot.seq_id, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
            slot.stats.n_target_decodes += 1
        if self.chain is not None:
            self.chain.begin(slot.seq_id, slot.prompt)
        token = slot.sampler.sample(self.ctx, (len(toks) - 1) % nb)
        t1 = time.perf_counter()
        slot.stats.t_prompt_s = t1 - slot._t0
        slot._t0 = t1
        slot.state = SlotState.GENERATING
        return self._emit(slot, [token], 0)

    # -- the speculative round ---------------------------------------------------------------------
    def _n_draft_max(self, s: Slot) -> int:
        n = self.n_ctx_seq - s.n_past - 2
        if s.n_remaining > 0:
            n = min(n, s.n_remaining - 1)
        return n

    def _round(self, gen: list[Slot]) -> list[Chunk]:
        chain = self.chain
        # 1. drafting phase (spec §7.2)
        requested: list[Slot] = []
        if chain is not None:
            for s in gen:
                dp = chain.dparams[s.seq_id]
                dp.drafting = False
                s.spec_requested = False
                if s.spec_draft:  # replay round: no new draft
                    if self.tgt_level is Level.FULL and s.spec_ckpt.empty:
                        raise MemoryOpError(f"slot {s.id}: replay round without a target checkpoint")
                    continue
                n_max = self._n_draft_max(s)
                if n_max <= 0:
                    continue
                s.spec_ckpt.update_pos(s.n_past, self.ctx.memory.pos_min(s.seq_id), self.ctx.memory.pos_max(s.seq_id))
                if self.dft_level is Level.FULL:
                    s.spec_ckpt.update_dft(self.ctx_dft, s.seq_id)
                dp.drafting, dp.n_max, dp.pos0, dp.id_last = True, n_max, s.n_past, s.sampled
                dp.prompt, dp.result, dp.probs = s.prompt, [], None
                s.spec_requested = True
                requested.append(s)
            if requested:
                chain.draft()
        # 2. post-draft checkpointing (spec §7.3)
        for s in requested:
            dp = chain.dparams[s.seq_id]
            s.spec_draft = list(dp.result)
            s.spec_probs = dp.probs
            s.stats.n_drafted += len(s.spec_draft)
            if self.ctx_dft is not None:
                if self.dft_level is Level.FULL:
                    s.spec_ckpt.load_dft(self.ctx_dft, s.seq_id)
                if not self._keep_draft_kv:
                    self.rb_dft.trim(s.seq_id, s.spec_ckpt.pos_max + 1)
            if s.spec_draft and self.rb_tgt.needs_checkpoint(len(s.spec_draft)):
                s.spec_ckpt.update_tgt(self.ctx, s.seq_id)
                s.stats.n_checkpoints += 1
        # 3. batch layout: each slot's rows stay in one decode call
        groups: list[list[Slot]] = [[]]
        n_rows = 0
        for s in gen:
            need = 1 + len(s.spec_draft)
            if n_rows + need > self.ctx.n_batch and groups[-1]:
                groups.append([])
                n_rows = 0
            groups[-1].append(s)
            n_rows += need
        out: list[Chunk] = []
        for group in groups:
            rows: list[L.Row] = []
            for s in group:
                p0 = s.n_past
                has_draft = bool(s.spec_draft)
                s.spec_i_batch = list(range(len(rows), len(rows) + 1 + len(s.spec_draft)))
                rows.append(L.Row(s.sampled, p0, s.seq_id, True))
                for j, t in enumerate(s.spec_draft):
                    rows.append(L.Row(t, p0 + 1 + j, s.seq_id, has_draft))
            self._decode(rows)
            # 4.-6. verify, roll back, emit (spec §7.5)
            for s in group:
                s.stats.n_target_decodes += 1
                ch = self._verify(s)
                if ch is not None:
                    out.append(ch)
        return out

    def _verify(self, s: Slot) -> Chunk | None:
        draft = s.spec_draft
        idx = s.spec_i_batch
        sampler = s.sampler
        ctx = self.ctx
        if not draft:  # plain decoding step
            s.prompt.append(s.sampled)
            s.spec_i_batch = []
            return self._emit(s, [sampler.sample(ctx, idx[0])], 0)
        n_draft = len(draft)
        is_replay = s.spec_is_replay
        smpl_save = sampler.clone() if (not is_replay and self.rb_tgt.needs_checkpoint(n_draft)) else None
        try:
            accepted = self._accept(s, draft, idx, is_replay)
            s.spec_i_batch = []
            n_rollback = n_draft + 1 - len(accepted)
            if n_rollback > 0 and self.rb_tgt.needs_restore(n_rollback):
                # restore + replay (spec §7.5 step 4): nothing is emitted this round
                if s.spec_ckpt.empty:
                    raise MemoryOpError(f"slot {s.id}: partial acceptance needs a checkpoint, none was taken")
                s.spec_is_replay = True
                s.spec_draft = accepted
                s.spec_probs = None
                s.spec_ckpt.load_tgt(ctx, s.seq_id)
                self.rb_tgt.trim(s.seq_id, s.spec_ckpt.pos_max + 1)
                if self.ctx_dft is not None:
                    s.spec_ckpt.load_dft(self.ctx_dft, s.seq_id)
                    self._trim_dft(s, s.spec_ckpt.pos_max + 1)
                del s.prompt[s.spec_ckpt.n_tokens :]
                if smpl_save is not None:
                    sampler.copy_from(smpl_save)
                s.stats.n_restores += 1
                self.rb_tgt.n_restores += 1
                return None
        finally:
            if smpl_save is not None:
                smpl_save.close()
        ids = accepted
        n_accepted = len(ids) - 1
        if is_replay and n_accepted > 0:
            n_accepted -= 1  # the last replayed token was the target's, not a draft's
        if is_replay:
            s.stats.n_replays += 1
        s.spec_is_replay = False
        if self.chain is not None:
            # llama.cpp tells the chain len(accepted)-1 here even in a replay round (counting the target's own
            # token); the corrected count is used so that a replay is not a new draft in the statistics
            self.chain.accept(s.seq_id, n_accepted)
        st = s.stats
        st.n_accepted += n_accepted
        st.n_verif_steps += 1
        per = st.n_accepted_per_pos
        if len(per) < n_accepted:
            per.extend([0] * (n_accepted - len(per)))
        for i in range(n_accepted):
            per[i] += 1
        # commit: the draft rows are replaced by the accepted ones
        s.prompt.append(s.sampled)
        s.prompt.extend(ids[:-1])
        s.spec_draft = []
        s.spec_probs = None
        pos_next = s.n_past
        if self.rb_tgt.trim(s.seq_id, pos_next):
            s.stats.n_trims += 1
        if self.ctx_dft is not None:
            self._trim_dft(s, pos_next)
        return self._emit(s, ids, len(ids) - 1)

    def _trim_dft(self, s: Slot, pos: int) -> None:
        """Draft-context rollback. A FULL draft memory cannot trim: restore its checkpoint and re-decode the
        committed tokens instead (llama.cpp aborts here; spec §7.5, "upstream limitation")."""
        ctx = self.ctx_dft
        if ctx.memory.seq_rm(s.seq_id, pos, -1):
            return
        ck = s.spec_ckpt
        if self.dft_level is not Level.FULL or not ck.data_dft:
            raise MemoryOpError(f"seq_rm on the draft context was refused (slot {s.id}, pos {pos})")
        ck.load_dft(ctx, s.seq_id)
        if not ctx.memory.seq_rm(s.seq_id, ck.pos_max + 1, -1):
            raise MemoryOpError(f"could not roll back the draft context of slot {s.id}")
        redo = s.prompt[ck.n_tokens : pos]
        if redo:
            ctx.decode_tokens(redo, ck.n_tokens, s.seq_id, output_last=True)

    def _accept(self, s: Slot, draft: list[int], idx: list[int], is_replay: bool) -> list[int]:
        """Run the verification rule for one slot; returns the accepted list (length 1..len(draft)+1)."""
        from . import verify as V

        sampler, ctx, vocab = s.sampler, self.ctx, self.vocab

        def sample_row(i: int) -> int:
            return sampler.sample(ctx, idx[i])

        if self.synth_cond is not None:
            from .synth import synth_accept

            # synthetic acceptance: sample without accepting, then accept the token actually emitted (§8.2)
            return synth_accept(lambda i: sampler.sample_no_accept(ctx, idx[i]), vocab.is_eog,
                                lambda tok, generated: sampler.accept(tok), draft, self.synth_cond, s.synth_rng,
                                is_replay)
        if is_replay:
            def advance_row(i: int, known: int) -> None:
                # the decision was made in the first pass: advance the sampler as it did, keep the known token
                if s.rng is None:
                    sampler.sample_no_accept(ctx, idx[i])
                sampler.accept(known)

            return V.replay(advance_row, self._final_sampler(s, idx), draft)
        if s.rng is not None and s.spec_probs is not None and len(s.spec_probs) == len(draft):
            return self._rejection(s, draft, idx)
        return V.sample_and_match(sample_row, vocab.is_eog, draft)

    def _final_sampler(self, s: Slot, idx: list[int]) -> Callable[[int], int]:
        """Sample row ``i`` for real: with the llama sampler, or (rejection mode) from p with the slot's stream."""
        if s.rng is None:
            return lambda i: s.sampler.sample(self.ctx, idx[i])

        def sample(i: int) -> int:
            from .verify import probs_from_logits, sample_from_probs

            sp = s.sampling
            p = probs_from_logits(self.ctx.logits(idx[i]), sp.temp, sp.top_k, sp.top_p, sp.min_p)
            tok = sample_from_probs(p, s.rng.random())
            s.sampler.accept(tok)
            return tok

        return sample

    def _rejection(self, s: Slot, draft: list[int], idx: list[int]) -> list[int]:
        from .verify import probs_from_logits, rejection_verify

        sp = s.sampling
        rows = [probs_from_logits(self.ctx.logits(i), sp.temp, sp.top_k, sp.top_p, sp.min_p) for i in idx]
        res = rejection_verify(np.stack(rows), draft, s.spec_probs, s.rng.random)
        for t in res.tokens:
            s.sampler.accept(t)
        return list(res.tokens)

    def _emit(self, slot: Slot, tokens: list[int], n_from_draft: int) -> Chunk:
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
        if slot.finish_reason is None and slot.n_past >= self.n_ctx_seq - 1:
            slot.finish_reason = FinishReason.LENGTH  # no room left to decode the sampled token
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
            self._release(slot)
        return Chunk(slot, emitted, text, finished, min(n_from_draft, len(emitted)))

    # ------------------------------------------------------------------------------------------
    # convenience
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
        mask: list[bool] = []
        text = ""
        slot = None
        for ch in self.stream(prompt, n_predict=n_predict, sampling=sampling, stop=stop, parse_special=parse_special):
            slot = ch.slot
            tokens += ch.tokens
            mask += [i < ch.n_from_draft for i in range(len(ch.tokens))]
            text += ch.text
            if on_chunk is not None:
                on_chunk(ch)
        if slot is None:  # pragma: no cover - stream always yields at least once
            raise LlamaSpecError("generation produced no output")
        return GenerationResult(tokens, text, slot.finish_reason or FinishReason.STOP, slot.stats,
                                slot.prompt_tokens, mask)

    def generate_many(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        n_predict: int = -1,
        sampling: L.SamplingParams | Sequence[L.SamplingParams] | None = None,
        stop: Sequence[str] = (),
        on_chunk: Callable[[int, Chunk], None] | None = None,
    ) -> list[GenerationResult]:
        """Generate for several prompts, ``n_parallel`` at a time, in one batched loop."""
        samplings = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(samplings) != len(prompts):
            raise UsageError("give one sampling setting, or one per prompt")
        results: list[GenerationResult | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        running: dict[int, tuple[int, list[int], list[str], list[bool]]] = {}
        try:
            while pending or running:
                while pending and any(s.state in (SlotState.IDLE, SlotState.DONE) for s in self.slots):
                    i = pending.pop(0)
                    s = self.submit(prompts[i], n_predict=n_predict, sampling=samplings[i], stop=stop)
                    running[s.id] = (i, [], [], [])
                for ch in self.step():
                    i, toks, texts, mask = running[ch.slot.id]
                    toks += ch.tokens
                    texts.append(ch.text)
                    mask += [j < ch.n_from_draft for j in range(len(ch.tokens))]
                    if on_chunk is not None:
                        on_chunk(i, ch)
                    if ch.finished:
                        s = ch.slot
                        results[i] = GenerationResult(toks, "".join(texts), s.finish_reason, s.stats,
                                                      s.prompt_tokens, mask)
                        del running[ch.slot.id]
        finally:
            for sid in list(running):
                self.cancel(self.slots[sid])
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------
    # statistics
    # ------------------------------------------------------------------------------------------
    def drafter_stats(self) -> list[dict]:
        return self.chain.stats_dicts() if self.chain else []

    def stats_lines(self) -> list[str]:
        return self.chain.stats_lines() if self.chain else []
