"""An Engine's native parts, built from its arguments (§7.1, start-up): models, target and draft
contexts with their output limits, the probed memory levels, the chain and the synthetic-acceptance rates.

:func:`build_parts` does what llama-server does at start-up, in its order:

0. check the GPU-offload and thread settings (:func:`check_device_params`), before anything loads;
1. load the target; clamp ``n_ctx`` to its training context;
2. the target context, sized for the longest draft any drafter may propose (§5.1 output limits);
3. probe the target's memory level; NO turns speculation off (with a warning);
4. the draft model and its context (one output row per sequence), when a drafter needs it;
5. the chain: the caller's drafters, or those ``spec`` enables (priority order, §3.1);
6. probe the draft memory; a draft context no drafter uses is freed;
7. draft-KV reuse only where the draft memory can trim (PART), synthetic rates resolved against the chain.

Everything built is freed again if a later step raises.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from . import _llama as llama
from .chain import Chain
from .adaptive import CostModel
from .chain_registry import build_chain
from .drafters.base import Drafter
from ._llama.model import _is_int, check_offload
from .errors import UsageError
from .params import SpecParams, SpecType
from .level import Level
from .probe import can_seq_rm
from .synth import conditional_probs, resolve_synth_rates

log = logging.getLogger("llamaspec")

DRAFT_HEAD_ARCHS = ("eagle3", "dflash")


def check_device_params(*, n_gpu_layers: int | None = None, n_gpu_layers_draft: int | None = None,
                        main_gpu: int | None = None, split_mode: str | None = None,
                        tensor_split: Sequence[float] | None = None, n_threads: int | None = None,
                        n_threads_batch: int | None = None, n_threads_draft: int | None = None,
                        rpc_servers=None, rpc_servers_draft=None) -> None:
    """Validate an Engine's GPU-offload, RPC and thread settings (None = llama.cpp's default): one
    :class:`UsageError` line naming the argument and its CLI flag."""
    llama.rpc.parse_servers(rpc_servers or None, flag="rpc_servers (--rpc)")
    llama.rpc.parse_servers(rpc_servers_draft or None, flag="rpc_servers_draft (--rpc-draft)")
    for name, flag, v in (("n_threads", "-t", n_threads), ("n_threads_batch", "-tb", n_threads_batch),
                          ("n_threads_draft", "-td", n_threads_draft)):
        if v is not None and (not _is_int(v) or v < 1):
            raise UsageError(f"{name} ({flag}) must be an integer >= 1, got {v!r}")
    check_offload(n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, split_mode=split_mode, tensor_split=tensor_split)
    check_offload(n_gpu_layers=n_gpu_layers_draft, draft=True)


@dataclass
class EngineParts:
    model: llama.Model
    ctx: llama.Context
    tgt_level: Level
    model_dft: llama.Model | None = None
    ctx_dft: llama.Context | None = None
    dft_level: Level = Level.NO
    chain: Chain | None = None
    #: synthetic acceptance: conditional acceptance probability per draft position (§2.3)
    synth_cond: list[float] | None = None
    #: drafters keep what they decoded while drafting (``reuse_kv``, PART draft memories only)
    reuse_kv: bool = False
    #: what the engine must close, in creation order (closed in reverse)
    owned: list = field(default_factory=list)


def build_parts(
    target: "llama.Model | str | Path",
    draft: "llama.Model | str | Path | None",
    spec: SpecParams,
    drafters: Sequence[Drafter] | None,
    *,
    n_ctx: int,
    n_parallel: int,
    n_batch: int,
    n_ubatch: int | None,
    n_threads: int | None,
    n_threads_draft: int | None,
    flash_attn: bool | None,
    kv_f32: bool,
    n_rs_seq: int | None,
    n_threads_batch: int | None = None,
    n_gpu_layers: int | None = None,
    n_gpu_layers_draft: int | None = None,
    main_gpu: int | None = None,
    split_mode: str | None = None,
    tensor_split: Sequence[float] | None = None,
    rpc_servers: Sequence[str] | None = None,
    rpc_servers_draft: Sequence[str] | None = None,
    cost_model: "CostModel | None" = None,
) -> EngineParts:
    """The Engine's native parts: models, contexts (each probed for its rollback level), the chain.

    GPU offload and threads, with llama.cpp's meaning (None = llama.cpp's default; CLI flag in brackets):

    * ``n_gpu_layers`` (``-ngl``): target layers in VRAM; -1 (llama.cpp's default) = all, 0 = CPU only.
      A CPU-only build of llama.cpp ignores it. ``n_gpu_layers_draft`` (``-ngld``): the same for the draft.
    * ``split_mode`` (``-sm``): ``"none"``, ``"layer"`` (llama.cpp's default), ``"row"`` or ``"tensor"``;
      ``tensor_split`` (``-ts``): proportions per GPU, e.g. ``[3, 1]``; ``main_gpu`` (``-mg``): the GPU
      used with split mode none. The draft model uses the target's placement.
    * ``n_threads`` (``-t``, default: all available cores), ``n_threads_batch`` (``-tb``, default
      ``n_threads``); ``n_threads_draft`` (``-td``, default ``n_threads``) for the draft's generation, whose
      batch threads follow ``n_threads_batch`` (as llama.cpp's ``-tbd`` default).
    * ``rpc_servers`` (``--rpc``): ``"host:port"`` list (or one comma-separated string) of llama.cpp RPC
      servers (``ggml-rpc-server``) that hold the target's offloaded layers, split by ``tensor_split`` in
      the order given; ``rpc_servers_draft`` (``--rpc-draft``) the same for the draft, which stays local
      by default. Needs a llama.cpp built with RPC (:mod:`llamaspec._llama.rpc`). A server that fails
      mid-generation fails the requests with one :class:`~llamaspec.errors.RpcError` line; the engine
      then refuses new work and the process needs a restart to use RPC again.

    The offload settings apply to models this engine loads from a path: a ``target`` or ``draft`` passed
    as an already loaded :class:`~llamaspec._llama.Model` keeps its own placement (load it with
    ``Model(path, n_gpu_layers=...)``). Bad values raise :class:`UsageError` before anything is loaded.
    """
    check_device_params(n_gpu_layers=n_gpu_layers, n_gpu_layers_draft=n_gpu_layers_draft, main_gpu=main_gpu,
                        split_mode=split_mode, tensor_split=tensor_split, n_threads=n_threads,
                        n_threads_batch=n_threads_batch, n_threads_draft=n_threads_draft,
                        rpc_servers=rpc_servers, rpc_servers_draft=rpc_servers_draft)
    owned: list = []

    def own(obj):
        owned.append(obj)
        return obj

    # the draft inherits the target's placement across GPUs; only its layer count is its own (as llama.cpp)
    placement = dict(main_gpu=main_gpu, split_mode=split_mode, tensor_split=tensor_split)

    def own_model(m, ngl: int | None, rpc_servers=None, load_mtp: bool = False, use_mmap: bool = True) -> llama.Model:
        if isinstance(m, llama.Model):
            if ngl is not None or rpc_servers or any(v is not None for v in placement.values()):
                log.warning("%s is already loaded: the GPU offload / RPC settings do not apply to it", m.path.name)
            return m
        # RPC servers (the target's, and separately the draft's: local by default) carry the offloaded layers
        return own(llama.Model(m, n_gpu_layers=ngl, rpc_servers=rpc_servers or None, load_mtp=load_mtp, use_mmap=use_mmap,
                               **placement))

    if draft is not None and spec.is_auto:  # auto + a head / MTP file: that head's drafter
        from .drafters.heads import infer_draft_type

        head = infer_draft_type(draft)
        if head != ["draft-simple"]:
            log.info("--spec-type auto with a %s draft: using %s", head[0][6:], head[0])
            spec.types = ["none", *head]
    # draft-mtp: the target (or the -md file) is loaded with its MTP blocks, the draft context is an MTP one
    mtp = SpecType.DRAFT_MTP in spec.enabled()
    try:
        from .drafters.mtp import gguf_is_mtp_head_only

        model = own_model(target, n_gpu_layers, rpc_servers, load_mtp=mtp)
        if model.n_layer_nextn > 0 and gguf_is_mtp_head_only(model.path):  # no trunk: llama.cpp would crash on it
            raise UsageError(f"{model.path.name} is an MTP head without trunk layers, not a standalone model: use it "
                             "as -md (draft-mtp) for its target model")
        if model.arch in DRAFT_HEAD_ARCHS:
            raise UsageError(f"{model.path.name} is a {model.arch} draft head, not a standalone model: "
                             "use it as a draft for its target model")
        if model.n_ctx_train > 0 and n_ctx > model.n_ctx_train:
            log.info("n_ctx %d > n_ctx_train %d of %s: clamped", n_ctx, model.n_ctx_train, model.path.name)
            n_ctx = model.n_ctx_train
        speculating = not spec.types_are_default or spec.has_synth() or bool(drafters)
        n_draft = spec.n_max_of_types() if speculating else 0
        if drafters:
            n_draft = max([n_draft] + [max(0, d.n_max) for d in drafters])
        n_out, n_out_seq = llama.output_limits(n_batch, n_parallel, n_draft)
        common = dict(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch or n_batch, n_seq_max=n_parallel,
                      n_threads=n_threads, n_threads_batch=n_threads_batch or n_threads, flash_attn=flash_attn,
                      kv_f32=kv_f32)
        ctx = own(llama.Context(model, llama.ContextParams(
            n_rs_seq=spec.need_n_rs_seq() if n_rs_seq is None else n_rs_seq,
            n_outputs_max=n_out, n_outputs_max_per_seq=n_out_seq,
            extra=dict(getattr(model, "context_params", {})), **common)))
        parts = EngineParts(model, ctx, can_seq_rm(ctx) if speculating else Level.PART, owned=owned)
        if speculating and parts.tgt_level is Level.NO:
            log.warning("the target context has no memory to roll back (level NO): speculative decoding is off")
            speculating = False
        if speculating and mtp:
            from .drafters.mtp import mtp_context

            if draft is not None:
                parts.model_dft = own_model(draft, n_gpu_layers_draft, rpc_servers_draft, load_mtp=True)
            common["n_threads"] = n_threads_draft or n_threads
            parts.ctx_dft = own(mtp_context(parts.model_dft or model, ctx, n_parallel, common))
        elif speculating and draft is not None:
            keep, asked = spec.draft_vocab_keep()
            trimmed = False
            # also with keep 0: a draft given as an already trimmed file still needs its run-time rows
            if not isinstance(draft, llama.Model) and spec.drafts_with_model():
                from .models.trim import draft_path

                draft, trimmed = draft_path(draft, keep, asked)
            # a trimmed draft's run-time vocabulary rows are written into its tensors: no read-only mmap
            parts.model_dft = own_model(draft, n_gpu_layers_draft, rpc_servers_draft, use_mmap=not trimmed)
            if parts.model_dft.n_layer_nextn > 0 and gguf_is_mtp_head_only(parts.model_dft.path):
                raise UsageError(f"draft {parts.model_dft.path.name} is an MTP head (no trunk layers): it runs only as "
                                 "draft-mtp (--spec-type draft-mtp, or no --spec-type)")
            # llama.cpp: -td defaults to -t; the draft's batch threads (-tbd) default to the target's -tb
            common["n_threads"] = n_threads_draft or n_threads
            n_out_dft, n_out_dft_seq, other = n_parallel, 1, None
            if parts.model_dft.arch in DRAFT_HEAD_ARCHS:  # EAGLE-3 / DFlash heads (§5.3)
                from .drafters.heads import check_head_pair, check_head_types

                check_head_types(parts.model_dft, spec)
                check_head_pair(model, parts.model_dft)
                other = ctx  # the head borrows the target's token_embd / output where it has none
                if parts.model_dft.arch == "dflash":  # a whole block of outputs per sequence
                    n_out_dft_seq = max(1, spec.draft.n_max + 1)
                    n_out_dft = n_parallel * n_out_dft_seq
            parts.ctx_dft = own(llama.Context(parts.model_dft, llama.ContextParams(
                n_rs_seq=0, n_outputs_max=n_out_dft, n_outputs_max_per_seq=n_out_dft_seq, **common), ctx_other=other))
        if speculating and drafters:
            bad = [d for d in drafters if d.n_seq != n_parallel]
            if bad:
                raise UsageError(f"drafter {bad[0].type} was built for n_seq={bad[0].n_seq}, the engine has {n_parallel} slots")
            parts.chain = Chain(list(drafters), n_parallel)
        elif speculating:
            parts.chain = build_chain(spec, n_parallel, ctx, parts.ctx_dft, cost_model)
            if parts.chain is not None:
                owned.append(parts.chain)
        if parts.chain is not None and parts.ctx_dft is not None:
            parts.dft_level = can_seq_rm(parts.ctx_dft)
        if parts.chain is None and parts.ctx_dft is not None:
            parts.ctx_dft.close()
            parts.ctx_dft = None
        if parts.chain is not None and spec.has_synth():
            rates = resolve_synth_rates(spec.synth_len, spec.synth_rates, parts.chain.n_max)
            parts.synth_cond = conditional_probs(rates) if rates else None
    except BaseException:
        for obj in reversed(owned):
            obj.close()
        raise
    # beyond llama.cpp: where no thread count was given and the decode runs on the CPU, each decode's thread
    # count is chosen from measured times (llamaspec._llama.threads: one thread wins on a busy machine)
    on_cpu = not llama.supports_gpu_offload()
    if n_threads is None and n_threads_batch is None and (on_cpu or n_gpu_layers == 0):
        parts.ctx.tune_threads()
    if (parts.ctx_dft is not None and n_threads_draft is None and n_threads is None and n_threads_batch is None
            and (on_cpu or n_gpu_layers_draft == 0)):
        parts.ctx_dft.tune_threads()
    # draft-KV reuse (beyond llama.cpp) only where the draft memory can be trimmed afterwards
    for d in (parts.chain.impls if parts.chain else []):
        if d.reuse_kv:
            if parts.dft_level is Level.PART:
                parts.reuse_kv = True
            else:
                d.reuse_kv = False
                log.debug("draft KV reuse needs a trimmable (PART) draft memory; using llama.cpp's re-decode")
    return parts

