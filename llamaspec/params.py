"""Speculative-decoding parameters with llama.cpp's names and defaults (§1.1, §2.1).

>>> types_from_names("ngram-mod,draft-simple")
['ngram-mod', 'draft-simple']
>>> types_from_names("ngram-mod,none,draft-simple")
['none']
>>> p = SpecParams(); p.add_types("ngram-mod"); p.types
['none', 'ngram-mod']
>>> p.n_max_of_types()
64
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .errors import UsageError


class SpecType(enum.IntEnum):
    """Enum order is llama.cpp's (it is the bit index used for de-duplication)."""

    NONE = 0
    DRAFT_SIMPLE = 1
    DRAFT_EAGLE3 = 2
    DRAFT_MTP = 3
    DRAFT_DFLASH = 4
    DRAFT_DSPARK = 5
    NGRAM_SIMPLE = 6
    NGRAM_MAP_K = 7
    NGRAM_MAP_K4V = 8
    NGRAM_MOD = 9
    NGRAM_CACHE = 10
    #: beyond llama.cpp (not in its enum; ids after llama.cpp's): llamaspec's own n-gram drafter, and
    #: ``auto`` (the drafters that pay, chosen per slot: llamaspec.auto)
    NGRAM_LOOKUP = 11
    AUTO = 12

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self]


TYPE_NAMES = {
    SpecType.NONE: "none",
    SpecType.DRAFT_SIMPLE: "draft-simple",
    SpecType.DRAFT_EAGLE3: "draft-eagle3",
    SpecType.DRAFT_MTP: "draft-mtp",
    SpecType.DRAFT_DFLASH: "draft-dflash",
    SpecType.DRAFT_DSPARK: "draft-dspark",
    SpecType.NGRAM_SIMPLE: "ngram-simple",
    SpecType.NGRAM_MAP_K: "ngram-map-k",
    SpecType.NGRAM_MAP_K4V: "ngram-map-k4v",
    SpecType.NGRAM_MOD: "ngram-mod",
    SpecType.NGRAM_CACHE: "ngram-cache",
    SpecType.NGRAM_LOOKUP: "ngram-lookup",
    SpecType.AUTO: "auto",
}
NAME_TO_TYPE = {v: k for k, v in TYPE_NAMES.items()}

#: chain priority order (§3.1), first = highest priority
PRIORITY = (
    SpecType.NGRAM_SIMPLE,
    SpecType.NGRAM_MAP_K,
    SpecType.NGRAM_MAP_K4V,
    SpecType.NGRAM_MOD,
    SpecType.NGRAM_CACHE,
    SpecType.NGRAM_LOOKUP,
    SpecType.DRAFT_SIMPLE,
    SpecType.DRAFT_EAGLE3,
    SpecType.DRAFT_MTP,
    SpecType.DRAFT_DFLASH,
    SpecType.DRAFT_DSPARK,
)
MODEL_TYPES = {SpecType.DRAFT_SIMPLE, SpecType.DRAFT_EAGLE3, SpecType.DRAFT_MTP, SpecType.DRAFT_DFLASH, SpecType.DRAFT_DSPARK}
RS_TYPES = {SpecType.DRAFT_EAGLE3, SpecType.DRAFT_MTP, SpecType.DRAFT_DFLASH, SpecType.DRAFT_DSPARK}


def types_from_names(names: str | list[str]) -> list[str]:
    """Parse a comma-separated list of type names (§1.1): unknown names are an error; ``none``
    anywhere yields ``['none']``."""
    items = names.split(",") if isinstance(names, str) else list(names)
    out: list[str] = []
    for raw in items:
        name = raw.strip()
        if name not in NAME_TO_TYPE:
            valid = ", ".join(TYPE_NAMES.values())
            raise UsageError(f"unknown speculative type: {name!r} (valid types: {valid})")
        if name == "none":
            return ["none"]
        out.append(name)
    if "auto" in out and len(set(out)) > 1:
        raise UsageError("--spec-type auto chooses the drafters itself: give it alone (or list the types instead)")
    return out


#: the draft model's ceiling when its length is adaptive and no n_max was given (llama.cpp's fixed default is 3)
ADAPTIVE_DRAFT_N_MAX = 12
#: drafters whose length the engine chooses per round when ``draft_adaptive`` is on (one draft-model step per
#: drafted token); n-gram drafters, block drafters (DFlash/DSpark) and ``auto`` keep their own lengths
ADAPTIVE_TYPES = ("draft-simple", "draft-mtp", "draft-eagle3")


@dataclass
class DraftModelParams:
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    p_split: float = 0.1  # unused by the chain (llama.cpp keeps it for examples/speculative)
    #: beyond llama.cpp: keep what drafting decoded in the draft context instead of re-decoding the
    #: verification batch (llama.cpp's TAG_SPEC_AVOID_DRAFT_REEVAL); False = llama.cpp's behaviour;
    #: None = on unless ``SpecParams.parity`` (and only where the draft memory can trim: PART)
    reuse_kv: bool | None = None
    #: beyond llama.cpp: how many tokens a trimmed copy of the draft keeps (llamaspec.models.trim): 0 = the
    #: draft's whole vocabulary (llama.cpp); None = ``TRIM_KEEP`` where trimming pays, unless ``SpecParams.parity``
    vocab: int | None = None


#: the default size of a trimmed draft vocabulary (``DraftModelParams.vocab``)
TRIM_KEEP = 32768


@dataclass
class NgramMapParams:
    """Shared shape of ngram-simple / ngram-map-k / ngram-map-k4v parameters."""

    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1


@dataclass
class NgramModParams:
    n_match: int = 24
    n_max: int = 64
    n_min: int = 48


@dataclass
class NgramLookupParams:
    """llamaspec's own ``ngram-lookup`` (llamaspec.drafters.ngram_lookup has the whole set)."""

    #: the longest draft (a ceiling: the drafter chooses each round's length itself)
    n_max: int = 32
    #: the longest key looked up in the hash maps (matches may be longer)
    key_max: int = 8
    #: adapt the length to measured acceptance and cost (False: always draft what the match gives, up to n_max)
    adaptive: bool = True
    #: weight of the prior (in rounds) against a slot's own counts
    prior_weight: float = 4.0
    #: per-update decay of a slot's counts (recent rounds weigh more)
    decay: float = 0.9
    #: after this many rounds with a match but no draft, draft a short one to measure again
    explore_every: int = 8
    #: a slot's first drafts are at most this long; the limit doubles after each draft accepted whole and
    #: halves (not below this) after one that lost more than half: a copy has to prove itself before a
    #: long draft is risked on it (0 = no such limit; ``auto`` with a draft model sets AUTO_NGRAM_K_START,
    #: where a failed long copy costs the draft model's round too)
    k_start: int = 0
    #: tokens of finished requests kept in the shared pool every slot also drafts from
    #: (:mod:`llamaspec.drafters.ngram_pool`; 0 = no pool)
    pool_tokens: int = 262144
    #: every tenant (API key) drafts from every other's sequences (default: only from its own)
    pool_shared: bool = False


@dataclass
class NgramCacheParams:
    lookup_cache_static: str = ""
    lookup_cache_dynamic: str = ""


NGRAM_CACHE_N_DRAFT = 8


VERIFY_MODES = ("match", "rejection")


@dataclass
class RequestSpec:
    """Per-request speculative settings (llama-server compiles them out; llamaspec honours them). ``None``
    keeps the engine's value. They may only lower what the engine was built for: ``n_max`` above the
    engine's maximum (which sized the contexts) is refused; ``n_max=0`` turns drafting off for the request.

    >>> RequestSpec(n_max=2, verify="rejection").validate(n_max_engine=8)
    >>> RequestSpec(n_max=9).validate(n_max_engine=8)
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: speculative.n_max = 9 is above the server's maximum 8 (it sized the contexts); use 0..8
    """

    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    verify: str | None = None

    def validate(self, n_max_engine: int) -> None:
        if self.n_max is not None and not 0 <= self.n_max <= n_max_engine:
            if self.n_max < 0:
                raise UsageError(f"speculative.n_max must be >= 0 (0 = no drafting), got {self.n_max}")
            raise UsageError(f"speculative.n_max = {self.n_max} is above the server's maximum {n_max_engine} "
                             f"(it sized the contexts); use 0..{n_max_engine}")
        if self.n_min is not None and self.n_min < 0:
            raise UsageError(f"speculative.n_min must be >= 0, got {self.n_min}")
        if self.p_min is not None and not 0.0 <= self.p_min <= 1.0:
            raise UsageError(f"speculative.p_min must be in [0, 1], got {self.p_min}")
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise UsageError(f"speculative.verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}")


@dataclass
class SpecParams:
    types: list[str] = field(default_factory=lambda: ["none"])
    draft: DraftModelParams = field(default_factory=DraftModelParams)
    ngram_simple: NgramMapParams = field(default_factory=NgramMapParams)
    ngram_map_k: NgramMapParams = field(default_factory=NgramMapParams)
    ngram_map_k4v: NgramMapParams = field(default_factory=NgramMapParams)
    ngram_mod: NgramModParams = field(default_factory=NgramModParams)
    ngram_cache: NgramCacheParams = field(default_factory=NgramCacheParams)
    ngram_lookup: NgramLookupParams = field(default_factory=NgramLookupParams)
    synth_len: float = -1.0
    synth_rates: list[float] = field(default_factory=list)
    #: opt-in fixes of the n-gram QUIRKs of §4.7-§4.11 (default False: behave exactly like llama.cpp)
    ngram_fix_quirks: bool = False
    #: in a replay round tell the chain the accepted drafts without the replayed target token (default
    #: False: llama.cpp's count, §7.5 step 6; the slot statistics are corrected either way)
    replay_accept_corrected: bool = False
    #: behave exactly like llama.cpp (parity runs and tests): no draft-KV reuse; default False = the
    #: fastest path that keeps greedy output equal to the target's
    parity: bool = False
    #: beyond llama.cpp: choose each round's draft length per slot from its measured acceptance and the
    #: measured costs (llamaspec.adaptive); the configured n_max becomes the ceiling. None = on; off with
    #: ``parity`` (draft-model drafters only: n-gram drafters keep their own lengths)
    draft_adaptive: bool | None = None
    #: beyond llama.cpp: speculate only while it delivers more tokens per second than plain decoding, measured
    #: against short plain windows under the machine's current load (llamaspec.referee). None = on wherever
    #: the adaptive length is on; False = off (the policy below decides alone)
    referee: bool | None = None

    def referee_on(self) -> bool:
        """Whether the referee judges speculation by delivered throughput (``referee``; default: with the
        adaptive length, so never in parity runs or with synthetic acceptance)."""
        return self.referee is not False and self.draft_adaptive_on()

    def draft_adaptive_on(self) -> bool:
        """Whether the draft model's length is chosen per round (``draft_adaptive``, default on; never with parity
        or synthetic acceptance, whose lengths are the experiment; and not by default when ``n_min > 0`` asks
        for drafts of at least that length every round, as llama.cpp makes them, which a length chosen by
        cost may not give).

        >>> p = SpecParams(); p.draft_adaptive_on(), (setattr(p.draft, "n_min", 4) or p.draft_adaptive_on())
        (True, False)
        """
        if self.draft_adaptive is None and self.draft.n_min > 0:
            return False
        return not self.parity and self.draft_adaptive is not False and not self.has_synth()

    def draft_vocab_keep(self) -> tuple[int, bool]:
        """(tokens a trimmed draft keeps, whether that was asked for): (0, _) = the draft's own vocabulary;
        by default ``TRIM_KEEP`` where trimming pays (``models.trim.trim_pays``), never with ``parity``."""
        if self.draft.vocab is None:
            return (0 if self.parity else TRIM_KEEP), False
        return self.draft.vocab, True

    def draft_trim(self) -> tuple[int, bool]:
        """:meth:`draft_vocab_keep` where a draft model runs as draft-simple (:meth:`drafts_with_model`), else
        ``(0, False)``: the tokens a trimmed draft keeps, and whether that was asked for."""
        return self.draft_vocab_keep() if self.drafts_with_model() else (0, False)

    def drafts_with_model(self) -> bool:
        """Whether a draft model would run as draft-simple (alone or inside ``auto``): the drafter a trimmed
        vocabulary applies to."""
        return self.is_auto or SpecType.DRAFT_SIMPLE in self.enabled()

    def draft_reuse_kv(self) -> bool:
        """Whether draft-simple keeps its own KV (``draft.reuse_kv``, or on by default unless ``parity``)."""
        return (not self.parity) if self.draft.reuse_kv is None else bool(self.draft.reuse_kv)

    def add_types(self, names: str | list[str]) -> None:
        """``--spec-type LIST`` appends to the list (whose default is ``['none']``)."""
        types = self.types + types_from_names(names)
        if "auto" in types and len(set(types) - {"none"}) > 1:
            raise UsageError("--spec-type auto chooses the drafters itself: give it alone (or list the types instead)")
        self.types = types

    @property
    def is_auto(self) -> bool:
        """``--spec-type auto`` (beyond llama.cpp): ngram-lookup, then the draft model when there is one,
        each switched off per slot while it does not pay (llamaspec.auto)."""
        return "auto" in self.types

    @property
    def types_are_default(self) -> bool:
        return self.types == ["none"]

    def enabled(self) -> list[SpecType]:
        """Enabled types in chain priority order (duplicates collapse, ``none`` creates nothing)."""
        s = {NAME_TO_TYPE[n] for n in self.types}
        if SpecType.AUTO in s:  # the draft model joins only when there is one (llamaspec.auto)
            s |= {SpecType.NGRAM_LOOKUP, SpecType.DRAFT_SIMPLE}
        return [t for t in PRIORITY if t in s]

    def has_synth(self) -> bool:
        return self.synth_len != -1.0 or bool(self.synth_rates)

    def need_n_rs_seq(self) -> int:
        """Target ``n_rs_seq`` the chain needs (§2.1): only EAGLE-3 / MTP / DFlash / DSpark ask."""
        return self.draft.n_max if any(t in RS_TYPES for t in self.enabled()) else 0

    def n_max_of_types(self) -> int:
        """``n_max`` of the parameter set, before any drafter exists (used for output limits, §3.1)."""
        n_max = {SpecType.NGRAM_SIMPLE: self.ngram_simple.size_m, SpecType.NGRAM_MAP_K: self.ngram_map_k.size_m,
                 SpecType.NGRAM_MAP_K4V: self.ngram_map_k4v.size_m, SpecType.NGRAM_MOD: self.ngram_mod.n_max,
                 SpecType.NGRAM_CACHE: NGRAM_CACHE_N_DRAFT, SpecType.NGRAM_LOOKUP: self.ngram_lookup.n_max}
        return max((max(0, self.draft.n_max if t in MODEL_TYPES else n_max[t]) for t in self.enabled()), default=0)
