"""Speculative-decoding flags with llama.cpp's names (§2.2), shared by generate / bench / serve."""
from __future__ import annotations

import click

from llamaspec.params import VERIFY_MODES

from ._common import option_group
from .ngram_options import apply_ngram_options, ngram_options

_OPTIONS = [
    click.option("-md", "--draft-model", "--spec-draft-model", "--model-draft", "draft_model", default=None,
                 help="Draft model (name from models.toml or GGUF path); enables draft-simple unless --spec-type says otherwise."),
    click.option("--spec-type", "spec_type", multiple=True,
                 help="Comma-separated drafter types, appended in order (draft-simple, ngram-simple, ngram-map-k, "
                      "ngram-map-k4v, ngram-mod, ngram-cache, none; beyond llama.cpp: ngram-lookup, auto). Default: "
                      "auto = ngram-lookup, then the draft model when there is one, each used per slot only while it "
                      "pays (with --spec-parity: none, or draft-simple with -md, as llama.cpp)."),
    click.option("--spec-ngram-lookup-n-max", type=int, default=None,
                 help="ngram-lookup / auto: the longest n-gram draft, 0..1024 (default 32; each round's length is "
                      "chosen from measured acceptance and cost)."),
    click.option("--spec-pool-tokens", type=int, default=None,
                 help="ngram-lookup / auto: tokens of finished requests kept in the shared pool every slot also "
                      "drafts from (prompts and outputs of earlier and running requests; the oldest go first). "
                      "0 = no pool. Default 262144 (about 75 MB at the 288 bytes a token of docs/benchmarks/pool-soak.md)."),
    click.option("--spec-pool-shared", is_flag=True,
                 help="ngram-lookup / auto: every API key drafts from every other's text in the pool (default: "
                      "each key only from its own, so drafting leaks nothing through timing)."),
    click.option("--spec-default", is_flag=True, help="ngram-mod with n_match 24, n_min 48, n_max 64 (llama.cpp's default)."),
    click.option("--spec-draft-n-max", type=int, default=None, help="Max drafted tokens per round (draft models; default 12 with the adaptive length, else 3 as llama.cpp)."),
    click.option("--spec-draft-n-min", type=int, default=None, help="Min drafted tokens, shorter drafts are dropped (default 0)."),
    click.option("--spec-draft-p-min", "--draft-p-min", type=float, default=None, help="Stop drafting below this draft probability (default 0)."),
    click.option("--spec-draft-reuse-kv/--no-spec-draft-reuse-kv", "spec_draft_reuse_kv", default=None,
                 help="Beyond llama.cpp: keep the draft's own KV instead of re-decoding each verified batch in the "
                      "draft model (draft-simple; ~10% faster on Gemma-270M; default: on, off with --spec-parity)."),
    click.option("--spec-draft-vocab", "spec_draft_vocab", type=int, default=None,
                 help="Beyond llama.cpp: draft with a copy of the draft model that keeps its N most frequent tokens, "
                      "N/8 (at most 2048) of them free rows filled at run time with the rarer tokens the prompt and "
                      "output use (derived once into the model cache; the target still verifies against every token, "
                      "so output is unchanged). 0 = the whole vocabulary. Default: 32768 when the draft's vocabulary "
                      "rows dominate its cost (gemma-3: 2x faster drafting), else whole; whole with --spec-parity."),
    click.option("--spec-draft-adaptive/--no-spec-draft-adaptive", "spec_draft_adaptive", default=None,
                 help="Beyond llama.cpp: choose each round's draft-model length per slot from measured acceptance and "
                      "costs, shorter when many slots draft together (--spec-draft-n-max is the ceiling, default "
                      "12; default: on, off with --spec-parity: llama.cpp's fixed length, default 3)."),
    click.option("--spec-parity", is_flag=True,
                 help="Behave exactly like llama.cpp (parity runs): its default drafter (none, or draft-simple with "
                      "-md) instead of auto, a fixed draft length, the draft's whole vocabulary, no draft-KV reuse. "
                      "Greedy output is the same either way; drafts and statistics can differ at near-ties."),
    click.option("--spec-synth-len", type=str, default=None, help="Synthetic acceptance: mean accepted length (benchmarks only)."),
    click.option("--spec-synth-rates", type=str, default=None, help="Synthetic acceptance: comma list of per-position rates (benchmarks only)."),
    click.option("--spec-replay-accept-corrected", is_flag=True,
                 help="Beyond llama.cpp: after a restore + replay (FULL/RS targets) tell the drafters the accepted drafts "
                      "without the replayed target token (llama.cpp counts it; slot statistics never do)."),
    click.option("--verify", "verify", type=click.Choice(list(VERIFY_MODES)), default="match", show_default=True,
                 help="match = llama.cpp's sample-and-match; rejection = rejection sampling at temperature > 0."),
]


spec_options = option_group(_OPTIONS + ngram_options())


def build_spec_params(*, draft_model, spec_type, spec_default, spec_draft_n_max, spec_draft_n_min, spec_draft_p_min,
                      spec_synth_len, spec_synth_rates, verify, spec_draft_reuse_kv=None,
                      spec_replay_accept_corrected=False, spec_parity=False, spec_draft_adaptive=None, spec_ngram_lookup_n_max=None,
                      spec_draft_vocab=None, spec_pool_tokens=None, spec_pool_shared=False, **extra):
    """SpecParams from the flags, validated with llama.cpp's rules and clear messages."""
    from llamaspec.errors import UsageError
    from llamaspec.params import ADAPTIVE_DRAFT_N_MAX, SpecParams

    p = SpecParams()
    for t in spec_type:
        p.add_types(t)
    if not spec_type and not spec_default and not spec_parity and spec_synth_len is None and spec_synth_rates is None:
        p.add_types("auto")  # beyond llama.cpp: the default; --spec-parity keeps llama.cpp's (none / draft-simple)
    for flag, v, ok, rule, target, field in (
            ("--spec-ngram-lookup-n-max", spec_ngram_lookup_n_max, lambda v: 0 <= v <= 1024, "be between 0 and 1024",
             p.ngram_lookup, "n_max"),
            ("--spec-pool-tokens", spec_pool_tokens, lambda v: v >= 0, "be >= 0 (0 = no pool)", p.ngram_lookup, "pool_tokens"),
            ("--spec-draft-n-max", spec_draft_n_max, lambda v: v >= 0, "be >= 0", p.draft, "n_max"),
            ("--spec-draft-n-min", spec_draft_n_min, lambda v: v >= 0, "be >= 0", p.draft, "n_min"),
            ("--spec-draft-p-min", spec_draft_p_min, lambda v: 0.0 <= v <= 1.0, "be in [0, 1]", p.draft, "p_min")):
        if v is not None:
            if not ok(v):
                raise UsageError(f"{flag} must {rule}, got {v}")
            setattr(target, field, v)
    p.ngram_lookup.pool_shared = bool(spec_pool_shared)
    if spec_default:
        p.add_types("ngram-mod")
        p.ngram_mod.n_match, p.ngram_mod.n_min, p.ngram_mod.n_max = 24, 48, 64
    p.draft.reuse_kv = spec_draft_reuse_kv
    if spec_draft_vocab is not None and spec_draft_vocab != 0 and spec_draft_vocab < 256:
        raise UsageError(f"--spec-draft-vocab must be 0 (the whole vocabulary) or at least 256 tokens, got {spec_draft_vocab}")
    p.draft.vocab = spec_draft_vocab
    p.parity = bool(spec_parity)
    p.draft_adaptive = spec_draft_adaptive
    p.replay_accept_corrected = bool(spec_replay_accept_corrected)
    if spec_synth_len is not None or spec_synth_rates is not None:
        from llamaspec.synth import parse_synth_len, parse_synth_rates

        if spec_synth_len is not None and spec_synth_rates is not None:
            raise UsageError("--spec-synth-len and --spec-synth-rates are mutually exclusive: give one")
        if spec_synth_len is not None:
            p.synth_len = parse_synth_len(spec_synth_len)
        if spec_synth_rates is not None:
            p.synth_rates = parse_synth_rates(spec_synth_rates)
    if spec_draft_n_max is None and p.draft_adaptive_on():
        p.draft.n_max = ADAPTIVE_DRAFT_N_MAX  # the ceiling of the adaptive length
    apply_ngram_options(p, extra)
    if "draft-simple" in p.types and not draft_model:
        raise UsageError("--spec-type draft-simple needs a draft model: add --draft-model (-md) NAME|PATH")
    if draft_model and not p.types_are_default and not p.is_auto and not {"draft-simple", "draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark"} & set(p.types):
        raise UsageError("--draft-model is given but --spec-type includes no drafter that uses it (draft-simple, draft-eagle3, "
                         "draft-mtp, draft-dflash, draft-dspark); add one or drop the draft model")
    if p.has_synth() and p.types_are_default and not draft_model:
        raise UsageError("synthetic acceptance needs a drafter: add --spec-type or --draft-model")
    return p, draft_model, verify


def resolve_spec_models(model, pair, cache_dir, spec_kw: dict):
    """``-m`` / ``--pair`` / ``-md`` and the speculative flags -> ``(spec, verify, target path, draft path)``,
    with the models fetched on first use (shared by generate and serve)."""
    from llamaspec.errors import UsageError

    from ._common import resolve_model_arg

    if pair is not None:
        if model or spec_kw.get("draft_model"):
            raise UsageError("--pair names both models: drop -m / -md, or drop --pair")
        from llamaspec.models import load_registry

        p = load_registry().pair(pair)
        model, spec_kw["draft_model"] = p.target, p.draft
    spec, draft_name, verify = build_spec_params(**spec_kw)
    path = resolve_model_arg(model, cache_dir)
    dpath = resolve_model_arg(draft_name, cache_dir) if draft_name else None
    if dpath is not None:
        dpath = trimmed_draft_arg(dpath, spec, cache_dir)
    return spec, verify, path, dpath


def trimmed_draft_arg(dpath: str, spec, cache_dir: str | None) -> str:
    """The draft to load: its trimmed copy where ``spec`` asks for one (``--spec-draft-vocab``, by default
    where it pays), derived on first use with a progress bar and a one-line note."""
    keep, asked = spec.draft_trim()
    if not keep:
        return dpath
    from llamaspec.models.trim import cached_trimmed, draft_path, trim_pays

    from ._common import err_console, progress_bar

    if cached_trimmed(dpath, keep, cache_dir) is None:
        if trim_pays(dpath, keep, asked=asked)[0]:
            err_console.print(f"trimming the draft's vocabulary to {keep} tokens (once; --spec-draft-vocab 0 keeps it whole)")
    with progress_bar() as progress:
        return str(draft_path(dpath, keep, asked, progress, cache=cache_dir)[0])
