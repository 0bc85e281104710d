"""Synthetic acceptance for benchmarks (§2.2, §2.3, §8.2).

With ``--spec-synth-len L`` or ``--spec-synth-rates P0,P1,...`` the target does not judge the draft:
draft token ``i`` is kept with a fixed probability, drawn from a per-slot ``std::mt19937`` stream. The
output is not valid model output; it only makes acceptance reproducible for speed measurements.

Everything here is pure Python + numpy. The target sampler is reached only through callbacks.

Worked example: a mean acceptance length of 2.5 with ``n_max = 3`` asks for rates ``[p, p^2, p^3]``
with ``p + p^2 + p^3 = 1.5``:

>>> rates = resolve_synth_rates(2.5, [], 3)
>>> [round(r, 6) for r in rates]
[0.691414, 0.478053, 0.330533]
>>> round(1 + sum(rates), 6)               # the mean acceptance length, the target's token included
2.5
>>> [round(c, 6) for c in conditional_probs(rates)]
[0.691414, 0.691414, 0.691414]
"""
from __future__ import annotations

import functools
import math
import operator
import re
import secrets
from typing import Callable, Sequence

import numpy as np

from .errors import UsageError

__all__ = [
    "SYNTH_LEN_UNSET",
    "RANDOM_SEED",
    "parse_synth_len",
    "parse_synth_rates",
    "resolve_synth_rates",
    "conditional_probs",
    "Mt19937Uniform",
    "synth_accept",
]

#: ``synth_len`` value meaning "not set" (llama.cpp's sentinel; the flag refuses it as a value)
SYNTH_LEN_UNSET = -1.0
#: seed sentinel meaning "pick a random seed" (``LLAMA_DEFAULT_SEED``)
RANDOM_SEED = 0xFFFFFFFF

#: number of bisection steps of §2.3
_BISECT_ITERS = 32

# What strtod accepts as a whole string (leading white space allowed, nothing after the number):
# decimal and hexadecimal floats, inf/infinity, nan/nan(chars). Python's float() differs (it takes
# "1_0" and trailing white space, refuses hex), so the format is checked first.
_STRTOD = re.compile(
    r"""[ \t\n\v\f\r]*[+-]?(?:
        (?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?                       # decimal
      | 0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?   # hexadecimal
      | (?i:inf(?:inity)?)
      | (?i:nan(?:\([0-9A-Za-z_]*\))?)
    )""",
    re.VERBOSE,
)


def _parse_double(s: str) -> float | None:
    """Parse ``s`` like ``std::stod`` with a check that the whole string was used; None if it fails.

    >>> _parse_double("2.5"), _parse_double(" 1e1"), _parse_double("0x1p3"), _parse_double("1.5x")
    (2.5, 10.0, 8.0, None)
    >>> _parse_double("1.5 ") is None, _parse_double("1_0") is None, _parse_double("") is None
    (True, True, True)
    >>> _parse_double("0x1p99999"), _parse_double("-0x1p99999"), _parse_double("1e99999")
    (inf, -inf, inf)
    """
    if not _STRTOD.fullmatch(s):
        return None
    low = s.lstrip(" \t\n\v\f\r").lower()
    if "nan" in low:  # (any sign, any nan(chars))
        return math.nan
    if "x" in low:  # hexadecimal: float.fromhex wants the binary exponent; past the range it is inf, as
        try:  # float() gives for a decimal one (the range checks then refuse it)
            return float.fromhex(low if "p" in low else low + "p0")
        except OverflowError:
            return -math.inf if low.startswith("-") else math.inf
    return float(low)


def parse_synth_len(s: str) -> float:
    """Value of ``--spec-synth-len`` (§2.2): the whole string must be a number; ``-1`` is refused
    (it is the "unset" sentinel). Range checks happen later, in :func:`resolve_synth_rates`.

    >>> parse_synth_len("2.5")
    2.5
    >>> parse_synth_len("-1")
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: --spec-synth-len: -1 is reserved for 'unset'; give a mean acceptance length between 1 and n_max+1
    """
    v = _parse_double(s)
    if v is None:
        raise UsageError(f"--spec-synth-len: {s!r} is not a number; give a mean acceptance length between 1 and n_max+1")
    if v == SYNTH_LEN_UNSET:
        raise UsageError("--spec-synth-len: -1 is reserved for 'unset'; give a mean acceptance length between 1 and n_max+1")
    return v


def parse_synth_rates(s: str) -> list[float]:
    """Value of ``--spec-synth-rates`` (§2.2): a comma-separated list; each item is stripped of
    white space and must be a number as a whole. Range checks happen in :func:`resolve_synth_rates`.

    >>> parse_synth_rates("0.9, 0.7 ,0.5")
    [0.9, 0.7, 0.5]
    >>> parse_synth_rates("0.9,,0.5")
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: --spec-synth-rates: item 2 is empty; give comma-separated probabilities in [0, 1], e.g. 0.9,0.7,0.5
    """
    out: list[float] = []
    for n, item in enumerate(s.split(","), start=1):
        item = item.strip()
        if not item:
            raise UsageError(
                f"--spec-synth-rates: item {n} is empty; give comma-separated probabilities in [0, 1], e.g. 0.9,0.7,0.5"
            )
        v = _parse_double(item)
        if v is None:
            raise UsageError(
                f"--spec-synth-rates: item {n} ({item!r}) is not a number; "
                "give comma-separated probabilities in [0, 1], e.g. 0.9,0.7,0.5"
            )
        out.append(v)
    return out


def _powers(p: float, n: int) -> list[float]:
    """``[p, p^2, ..., p^n]``."""
    out, term = [], 1.0
    for _ in range(n):
        term *= p
        out.append(term)
    return out


def resolve_synth_rates(synth_len: float | None, synth_rates: Sequence[float] | None, n_max: int) -> list[float] | None:
    """Absolute per-position acceptance rates ``[P(pos 0 accepted), P(pos 0 and 1 accepted), ...]``
    (length ``n_max``), or None when neither flag is set (§2.3).

    ``synth_len`` is the mean acceptance length L (``-1`` or None = unset); ``synth_rates`` the explicit
    rates ([] or None = unset); ``n_max`` the largest ``n_max`` of the initialised drafters.

    L is turned into rates ``[p, p^2, ..., p^n_max]`` whose mean acceptance length ``1 + sum`` is L:
    ``L == n_max + 1`` gives p = 1, ``L == 1`` gives p = 0, otherwise 32 bisection steps on p in [0, 1]
    (``S(mid) < L - 1`` moves the low end up, else the high end down) and p is the final midpoint.

    >>> resolve_synth_rates(-1.0, [], 3) is None
    True
    >>> resolve_synth_rates(4.0, [], 3), resolve_synth_rates(1.0, [], 3)
    ([1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    >>> [round(r, 6) for r in resolve_synth_rates(2.0, None, 2)]   # p + p^2 = 1 -> p = 0.618034
    [0.618034, 0.381966]
    >>> resolve_synth_rates(None, [0.9, 0.5], 2)
    [0.9, 0.5]
    >>> resolve_synth_rates(None, [0.5, 0.9], 2)
    Traceback (most recent call last):
    ...
    llamaspec.errors.UsageError: --spec-synth-rates: rates must not increase (item 2 = 0.9 > item 1 = 0.5); each is the probability that every position up to it is accepted
    """
    has_len = synth_len is not None and synth_len != SYNTH_LEN_UNSET
    has_rates = bool(synth_rates)
    if not has_len and not has_rates:
        return None
    if has_len and has_rates:
        raise UsageError("--spec-synth-len and --spec-synth-rates are mutually exclusive; give only one")
    if n_max <= 0:
        flag = "--spec-synth-len" if has_len else "--spec-synth-rates"
        raise UsageError(
            f"{flag} needs a drafter that drafts: the largest draft n_max is {n_max}, it must be at least 1 "
            "(set --spec-type and --spec-draft-n-max)"
        )

    if has_rates:
        rates = [float(r) for r in synth_rates]  # type: ignore[union-attr]
        if len(rates) != n_max:
            raise UsageError(
                f"--spec-synth-rates: got {len(rates)} rates, need exactly n_max = {n_max} (one per draft position)"
            )
        for n, r in enumerate(rates, start=1):
            if not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise UsageError(f"--spec-synth-rates: item {n} = {r} is outside [0, 1]; each rate is a probability")
        for n in range(1, len(rates)):
            if rates[n] > rates[n - 1]:
                raise UsageError(
                    f"--spec-synth-rates: rates must not increase (item {n + 1} = {rates[n]} > item {n} = {rates[n - 1]}); "
                    "each is the probability that every position up to it is accepted"
                )
        return rates

    L = float(synth_len)  # type: ignore[arg-type]
    if not math.isfinite(L) or not 1.0 <= L <= n_max + 1:
        raise UsageError(
            f"--spec-synth-len: {L} is out of range; the mean acceptance length must be between 1 and "
            f"n_max + 1 = {n_max + 1}"
        )
    if L == n_max + 1:
        p = 1.0
    elif L == 1.0:
        p = 0.0
    else:
        lo, hi = 0.0, 1.0
        target = L - 1.0
        for _ in range(_BISECT_ITERS):
            mid = 0.5 * (lo + hi)
            if functools.reduce(operator.add, _powers(mid, n_max), 0.0) < target:  # (left to right, as C++ sums)
                lo = mid
            else:
                hi = mid
        p = 0.5 * (lo + hi)
    return _powers(p, n_max)


def conditional_probs(rates: Sequence[float]) -> list[float]:
    """Per-position conditional acceptance probabilities the chain stores (§2.3 step 4):
    ``cond[i] = rates[i] / rates[i-1]`` with ``rates[-1] = 1``, and 0 where the previous rate is 0.

    >>> conditional_probs([0.9, 0.45, 0.0, 0.0])
    [0.9, 0.5, 0.0, 0.0]
    """
    out: list[float] = []
    prev = 1.0
    for r in rates:
        out.append(r / prev if prev != 0.0 else 0.0)
        prev = r
    return out


class Mt19937Uniform:
    """``std::uniform_real_distribution<double>(0, 1)`` over ``std::mt19937(seed)``, as libstdc++ computes it:
    two 32-bit outputs ``a`` then ``b``, value ``(a + b * 2^32) / 2^64`` in double arithmetic, clamped below 1.

    numpy's ``MT19937`` with legacy seeding is the same generator as ``std::mt19937`` bit for bit.
    ``seed == 0xFFFFFFFF`` (the random sentinel) draws a seed from the OS; :attr:`seed` holds the one used.

    >>> u = Mt19937Uniform(5489)   # std::mt19937's default seed
    >>> u.next_u32()               # first output of a default-constructed std::mt19937
    3499211612
    >>> u = Mt19937Uniform(42); x = u.next(); 0.0 <= x < 1.0
    True
    """

    __slots__ = ("seed", "_bg")

    def __init__(self, seed: int):
        self._bg = np.random.MT19937(0)  # construction is the slow part (~0.3 ms); reseed() is cheap
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the stream from ``seed`` (``std::mt19937::seed``), keeping the object."""
        seed = int(seed)
        if not 0 <= seed <= 0xFFFFFFFF:
            raise UsageError(f"seed must be in [0, 4294967295] (4294967295 = random), got {seed}")
        if seed == RANDOM_SEED:
            seed = secrets.randbits(32)
        self.seed = seed
        self._bg._legacy_seeding(seed)

    def next_u32(self) -> int:
        """One raw 32-bit output of the generator."""
        return int(self._bg.random_raw())

    def next(self) -> float:
        """One uniform double in [0, 1) (consumes two 32-bit outputs)."""
        a = float(self._bg.random_raw())
        b = float(self._bg.random_raw())
        x = (a + b * 4294967296.0) / 18446744073709551616.0
        if x >= 1.0:
            x = math.nextafter(1.0, 0.0)
        return x

    __call__ = next


def synth_accept(
    sample_row: Callable[[int], int],
    is_eog: Callable[[int], bool],
    accept_token: Callable[[int, bool], None],
    draft: Sequence[int],
    cond: Sequence[float],
    rng: Mt19937Uniform,
    is_replay: bool,
) -> list[int]:
    """Synthetic verification of one round (§8.2). Returns the emitted tokens (1..d+1).

    Callback contract (the engine's target sampler behind them):

    - ``sample_row(i)``: apply the target sampler to output row ``i`` of this round (row 0 = the row of
      ``id_last``, row ``i`` = the row of ``draft[i-1]``) and return its pick **without accepting it**.
      It is called for every row visited, so the sampler's random stream advances as in plain decoding.
    - ``accept_token(token, generated)``: accept ``token`` into the target sampler; ``generated=False``
      means penalties/history only (grammar and reasoning budget untouched), ``True`` means everything.
    - ``is_eog(token)``: whether ``token`` ends generation.

    For ``i`` in ``0..d-1``: ``t = sample_row(i)``; the draft token is kept when ``is_replay`` or
    ``rng.next() < cond[i]`` (no draw when replaying) and, outside replay, it is not EOG; a kept token is
    accepted with ``generated = is_replay and i == d-1`` (the last replayed token was the target's). The
    first position not kept emits the target's ``t`` (accepted as generated) and ends the round. When all
    ``d`` are kept, row ``d`` is sampled and accepted: the bonus token.

    >>> calls = []
    >>> sample_row = lambda i: 100 + i
    >>> accept = lambda t, g: calls.append((t, g))
    >>> synth_accept(sample_row, lambda t: False, accept, [7, 8, 9], [1.0, 0.0, 1.0], Mt19937Uniform(1), False)
    [7, 101]
    >>> calls
    [(7, False), (101, True)]
    """
    d = len(draft)
    if len(cond) < d:
        raise ValueError(f"synth_accept: {len(cond)} conditional probabilities for a draft of {d}")
    out: list[int] = []
    for i in range(d):
        t = int(sample_row(i))
        ok = is_replay or rng.next() < cond[i]
        x = int(draft[i])
        if ok and (is_replay or not is_eog(x)):
            accept_token(x, is_replay and i == d - 1)
            out.append(x)
            continue
        accept_token(t, True)
        out.append(t)
        return out
    t = int(sample_row(d))
    accept_token(t, True)
    out.append(t)
    return out
