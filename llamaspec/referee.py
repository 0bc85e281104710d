"""Does speculation pay *now*? Decided from the throughput rounds actually delivered, not from a cost model.

The adaptive length (:mod:`llamaspec.adaptive`) and the auto gates (:mod:`llamaspec.auto`) price drafts in units
of a one-row target decode, from timings. On a quiet machine that model is right; with other processes on the
cores it is not (a decode's time is then mostly thread synchronisation, so a draft step costs nearly what a
target decode costs, and a slow window of rounds can switch off a drafter whose tokens are 90% accepted). The
:class:`Referee` sits above both and asks only what was delivered: generated tokens per second of the rounds
run with speculation on (whatever the policy below chose in them, drafting or not) against rounds run plainly,
measured close together so that both saw the same machine.

* **Two windows per batch size** (the number of generating slots, bucketed: 1, 2, 3-4, 5-8, ...): the last
  ``window`` speculative rounds and the last ``window`` plain ones, each ``(tokens, seconds)``. A window's rate
  is its tokens over its time, with each round's time clipped at ``CLIP`` times the window's median (a round
  that waited for the scheduler, or a page fault, cannot decide alone), so rates are medians-robust.
* **Probes.** A batch size never measured plainly is probed after ``probe_first`` speculative rounds (with 8
  slots a short request lasts about 15 rounds: a reference measured at round 12 would come too late to
  matter). Speculating, every ``probe_every`` rounds a short plain window (``probe_len`` rounds) measures the
  reference; a round in which no slot drafted is a plain round too and counts as one. The interval doubles while
  speculation wins clearly (up to ``probe_every_max``: at 2x a probe costs a few percent) and goes back to the
  start when the margin is thin.
* **Fall back, then look again.** When the speculative rate falls below the plain rate by more than ``margin``,
  the engine decodes plainly; after ``retry`` plain rounds it speculates for ``probe_len_spec`` rounds to
  measure again (its window emptied first, so it is judged on what it delivers now; the policies below keep
  what they learned about acceptance meanwhile), and goes back to
  speculating when that pays. A retry that is clearly losing after ``abort_after`` rounds (below ``abort_below``
  of plain's rate) ends there. A failed retry doubles the wait up to ``retry_max`` (16 by default: when a load
  stops, speculation is back within 16 + ``probe_len_spec`` rounds) -- unless what it lost was large: the wait
  is then at least the loss over ``budget`` plain rounds' time (up to ``retry_cap`` rounds), so that looking
  again costs at most about ``budget`` of the time spent plain. The loss is the speculative rounds' time less
  the time plain decoding needed for their tokens; a failed retry's unclipped (its first round catches the draft
  model up on what the plain rounds committed: for 8 slots under load 5 s where a plain round took 0.15), a
  first fall-back's clipped like the windows (a new request's prompt is caught up once, not at every retry).
* **Neighbours.** A batch size seen for the first time while a smaller one has fallen back starts plainly,
  with that size's wait (speculation that loses with 4 slots does not pay with 8 either: a batch's verify cost
  grows with its rows while a round's gain does not).

* **Arms of speculation.** Where the chain can speculate in more than one way (``auto`` with a draft model:
  ``all``, n-gram copies then the draft model, or ``model``, the draft model alone), each way is an arm with its
  own window, and the rounds of the arm in use are the speculative ones above. Every ``arm_every`` speculative
  rounds the other arm runs for ``probe_len_spec`` rounds (its window emptied first: what it did long ago says
  little about the text now); it takes over when it delivered ``1 + margin`` times the rate of the arm in use,
  and the interval doubles (up to ``arm_every_max``) while the arm in use keeps winning. A copy drafter whose
  drafts are accepted at 30-50% where the draft model's are at 90% therefore loses its rounds to the draft model
  by what they delivered, whatever its expected-gain model says under load.

Everything here is pure (no clock, no model): the round reports ``(speculative, n_gen, tokens, seconds)``.

>>> r = Referee(probe_every=4, probe_len=2, window=8)
>>> for _ in range(4):                                  # speculating: 3 tokens per 10 ms round
...     assert r.speculate(1); r.record(True, 1, 3, 0.010)
>>> [r.speculate(1) for _ in range(1)], r.state         # time to measure plain decoding
([False], 'probe-plain')
>>> r.record(False, 1, 1, 0.008); r.speculate(1); r.record(False, 1, 1, 0.008)
False
>>> r.speculate(1), round(r.ratio(1), 2)                # 300 tok/s against 125: keep speculating
(True, 2.4)
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ._llama.threads import bucket

__all__ = ["Referee", "RefereeParams", "WindowRate", "bucket", "relative_mad"]

#: a round's time counts at most this many times the median of its window
CLIP = 3.0


@dataclass
class RefereeParams:
    #: speculating: rounds between two plain probes (doubles while speculation wins clearly)
    probe_every: int = 12
    probe_every_max: int = 96
    #: a batch size with no plain rounds measured yet is probed after this many speculative rounds (a request
    #: of 64 tokens on 8 slots lasts about 15 rounds: the reference must come early to matter)
    probe_first: int = 4
    #: plain rounds per probe
    probe_len: int = 3
    #: falling back: plain rounds before speculation is tried again (doubles while it keeps losing)
    retry: int = 4
    retry_max: int = 16
    #: speculative rounds per retry
    probe_len_spec: int = 6
    #: a retry below ``abort_below`` of plain's rate after ``abort_after`` rounds ends there
    abort_after: int = 3
    abort_below: float = 0.85
    #: after a fall-back or failed retry: wait at least its loss over ``budget`` plain rounds' time, at most
    #: ``retry_cap`` rounds
    budget: float = 0.1
    retry_cap: int = 256
    #: speculation must deliver at least ``1 - margin`` of plain's rate to stay on
    margin: float = 0.03
    #: the ratio above which the probe interval doubles
    clear_win: float = 1.25
    #: rounds per window
    window: int = 16
    #: speculating with more than one arm: rounds of the arm in use between two tries of another
    arm_every: int = 16
    arm_every_max: int = 128


class WindowRate:
    """The last ``n`` rounds of one mode at one batch size: ``(tokens, seconds)``, and their robust rate.

    >>> w = WindowRate(8)
    >>> for t in (0.01, 0.01, 0.01, 0.5):                 # one round waited half a second for the CPU
    ...     w.add(2, t)
    >>> round(w.rate(), 1)                               # 8 tokens over 0.03 + 0.03 s, not over 0.53 s
    133.3
    """

    __slots__ = ("rounds",)

    def __init__(self, n: int):
        self.rounds: deque[tuple[int, float]] = deque(maxlen=n)

    def add(self, tokens: int, seconds: float) -> None:
        self.rounds.append((tokens, max(seconds, 1e-7)))

    def __len__(self) -> int:
        return len(self.rounds)

    def rate(self) -> float | None:
        """Tokens per second over the window, each round's time clipped at ``CLIP`` x the median; None when
        empty."""
        if not self.rounds:
            return None
        med = statistics.median(t for _, t in self.rounds)
        cap = CLIP * med
        tokens = sum(n for n, _ in self.rounds)
        secs = sum(min(t, cap) for _, t in self.rounds)
        return tokens / secs

    def spread(self) -> float | None:
        """How noisy the window's per-token times are: their median absolute deviation over their median
        (0 on a steady machine; about 0.3 and more when other processes take the cores). None below 4 rounds."""
        if len(self.rounds) < 4:
            return None
        return relative_mad([t / max(n, 1) for n, t in self.rounds])


def relative_mad(values: "list[float]") -> float | None:
    """The median absolute deviation of ``values`` over their median (how noisy repeated timings are); None
    when the median is not positive.

    >>> relative_mad([10.0, 11.0, 9.0, 10.0]), relative_mad([0.0, 0.0])
    (0.05, None)
    """
    med = statistics.median(values)
    return statistics.median(abs(x - med) for x in values) / med if med > 0 else None


class _Bucket:
    """One batch size's windows and its own speculate-or-not state: what pays alone may lose with 8 slots, and
    a server's batch size comes and goes, so each size keeps what it decided until it comes back."""

    __slots__ = ("arms", "plain", "state", "left", "probe_every", "retry", "first", "wait")

    def __init__(self, p: RefereeParams, arms: "tuple[str, ...]"):
        self.arms = {a: WindowRate(p.window) for a in arms}
        self.plain = WindowRate(p.window)
        #: a size never measured plainly gets its reference after ``probe_first`` speculative rounds
        self.state, self.left = Referee.SPEC, p.probe_first
        self.probe_every, self.retry, self.first = p.probe_every, p.retry, True
        #: while fallen back: the rounds the last loss asked to wait (0: speculating)
        self.wait = 0


class Referee:
    """The speculate-or-not decision of each round (module docstring). ``speculate(n_gen)`` before a round,
    ``record(...)`` after it (rounds with prompt work are not recorded: their time is not the generation's;
    they follow :meth:`peek`). Each batch-size bucket keeps its own state (speculating, probing, plain,
    retrying). ``arms``: the ways the chain speculates (the first is where it starts); :attr:`arm` is the one a
    speculative round uses."""

    SPEC, PROBE_PLAIN, PLAIN, PROBE_SPEC, PROBE_ARM = "spec", "probe-plain", "plain", "probe-spec", "probe-arm"

    def __init__(self, params: RefereeParams | None = None, arms: "tuple[str, ...]" = ("spec",), **kw):
        p = params or RefereeParams()
        for k, v in kw.items():
            if not hasattr(p, k):
                raise TypeError(f"unknown referee setting {k!r}")
            setattr(p, k, v)
        self.p = p
        if not arms:
            raise ValueError("a referee needs at least one arm")
        self.arms = tuple(arms)
        #: the arm speculative rounds use (the one probed during a probe of arms), and the one in charge
        self.arm = self.best_arm = self.arms[0]
        self._arm_left = self._arm_every = p.arm_every
        self._arm_probe = False  # a probe of another arm is under way
        self.n_arm_switches = 0
        self._buckets: dict[int, _Bucket] = {}
        self._last: _Bucket | None = None
        self._carry = 0.0  # time of rounds that emitted nothing, added to the next one
        #: counts: plain probes, fall-backs to plain, returns to speculation
        self.n_probes = 0
        self.n_fallbacks = 0
        self.n_returns = 0
        self.n_plain_rounds = 0  # rounds the referee made plain (probes and fall-back)

    @property
    def state(self) -> str:
        """The state of the batch size judged last (a probe of another arm shows as ``probe-arm``)."""
        if self._arm_probe:
            return self.PROBE_ARM
        return self._last.state if self._last is not None else self.SPEC

    def _bucket(self, n_gen: int) -> _Bucket:
        b = bucket(n_gen)
        bk = self._buckets.get(b)
        if bk is None:
            bk = self._buckets[b] = _Bucket(self.p, self.arms)
            fell = [(k, o) for k, o in self._buckets.items() if k < b and o.state in (self.PLAIN, self.PROBE_SPEC)]
            if fell:  # a smaller batch size fell back: start plainly, and wait as long as the nearest one does
                o = max(fell, key=lambda ko: ko[0])[1]
                bk.state, bk.first, bk.retry, bk.wait = self.PLAIN, False, o.retry, o.wait
                bk.left = max(o.retry, o.wait)
        return bk

    def new_text(self, n_gen: int = 1) -> None:
        """Every slot of this batch size starts a new request (one slot's next prompt): what made the size fall
        back may have been the text, not the machine, so a wait longer than ``retry`` is cut to it (a retry
        that loses ends after ``abort_after`` rounds). Without it a loss on one prompt kept the next ones plain
        for up to ``retry_cap`` rounds: a run of 96-token prompts at one thread on a quiet machine decoded its
        later prompts plainly at 0.8x where each alone gave 3.3x."""
        bk = self._buckets.get(bucket(n_gen))
        if bk is not None and bk.state == self.PLAIN and bk.left > bk.retry:
            bk.left = bk.retry
        if len(self.arms) > 1 and self.best_arm != self.arms[0] and not self._arm_probe:
            # the arms differ by how well the text copies itself (n-gram copies then the draft model, or the model
            # alone): a new text starts from the first arm, which still leaves the model every round the copies
            # do not beat it (the model arm, won on code, kept a verbatim summary from its free copies next: 2.1x
            # of plain where they gave 3.2x)
            self.arm = self.best_arm = self.arms[0]
            self._arm_left = self._arm_every

    # -- the decision ------------------------------------------------------------------------------
    def peek(self, n_gen: int) -> bool:
        """What this batch size decided, without counting a round (a round with prompt work: not timed)."""
        bk = self._buckets.get(bucket(n_gen))
        return bk is None or bk.state in (self.SPEC, self.PROBE_SPEC)

    def speculate(self, n_gen: int) -> bool:
        """Whether this round may speculate (the policies below still choose how far, or not at all)."""
        bk = self._last = self._bucket(n_gen)
        if self._arm_probe:
            return True
        if bk.state == self.SPEC and bk.left <= 0 and bk.first and len(bk.plain) >= 2:
            bk.first, bk.left = False, bk.probe_every  # rounds that drafted nothing measured plain already
        if bk.state == self.SPEC and bk.left <= 0:
            bk.first, bk.state, bk.left = False, self.PROBE_PLAIN, self.p.probe_len
        elif bk.state == self.SPEC and self._arm_left <= 0 and len(self.arms) > 1 and not bk.first:
            # (a batch size is judged against plain first: an arm probe there would put off its first plain
            # probe by ``probe_len_spec`` rounds, and a short burst of requests never got its reference)
            self._arm_probe, self._arm_left = True, self.p.probe_len_spec
            i = self.arms.index(self.best_arm)
            self.arm = self.arms[(i + 1) % len(self.arms)]  # the next arm in turn
            bk.arms[self.arm].rounds.clear()
            return True
        elif bk.state == self.PLAIN and bk.left <= 0:
            bk.state, bk.left = self.PROBE_SPEC, self.p.probe_len_spec
            # a retry is judged on what speculation delivers now, not on the rounds that made it fall back
            bk.arms[self.best_arm].rounds.clear()
        spec = bk.state in (self.SPEC, self.PROBE_SPEC)
        if not spec:
            self.n_plain_rounds += 1
        return spec

    def record(self, speculative: bool, n_gen: int, n_tokens: int, seconds: float, n_drafted: int = 1) -> None:
        """A generation round ran: ``speculative`` as :meth:`speculate` said, ``n_tokens`` emitted in
        ``seconds``; a speculative round in which nothing was drafted (``n_drafted`` 0) is a plain round."""
        if n_gen <= 0:
            return
        if n_tokens <= 0:  # a restored round (FULL / RS memory) emits in the next one: its time goes there
            self._carry += seconds
            return
        seconds, self._carry = seconds + self._carry, 0.0
        bk = self._bucket(n_gen)
        (bk.arms[self.arm] if speculative else bk.plain).add(n_tokens, seconds)
        if speculative and n_drafted == 0:
            bk.plain.add(n_tokens, seconds)
        if self._arm_probe:
            self._arm_left -= 1
            if self._arm_left <= 0:
                self._judge_arm(bk)
            return
        if bk.state == self.SPEC:
            self._arm_left -= 1
        bk.left -= 1
        if bk.left > 0:
            if bk.state == self.PROBE_SPEC and self.p.probe_len_spec - bk.left >= self.p.abort_after:
                r = self._ratio(bk)
                if r is not None and r < self.p.abort_below:  # clearly losing: no need to see it out
                    self._judge(bk, from_spec=False)
            return
        if bk.state == self.PROBE_PLAIN:
            self.n_probes += 1
            self._judge(bk, from_spec=True)
        elif bk.state == self.PROBE_SPEC:
            self._judge(bk, from_spec=False)

    def _judge(self, bk: _Bucket, from_spec: bool) -> None:
        r = self._ratio(bk)
        p = self.p
        if from_spec:  # a plain probe ended: stay speculating unless it loses
            if r is not None and r < 1.0 - p.margin:
                bk.wait = self._wait(bk, clip=True)  # (a new request's prompt catch-up: once, not every round)
                bk.state, bk.left = self.PLAIN, max(bk.retry, bk.wait)
                self.n_fallbacks += 1
                return
            bk.state = self.SPEC
            wins = r is not None and r >= p.clear_win
            bk.probe_every = min(2 * bk.probe_every, p.probe_every_max) if wins else p.probe_every
            bk.left = bk.probe_every
            return
        # a speculative retry ended: back to speculating when it pays
        if r is None or r >= 1.0:
            bk.state, bk.left = self.SPEC, p.probe_every
            bk.probe_every, bk.retry, bk.wait = p.probe_every, p.retry, 0
            self.n_returns += 1
        else:
            bk.retry = min(2 * bk.retry, p.retry_max)
            bk.wait = self._wait(bk)
            bk.state, bk.left = self.PLAIN, max(bk.retry, bk.wait)

    def _wait(self, bk: _Bucket, clip: bool = False) -> int:
        """The plain rounds to wait after speculation lost at ``bk``: its loss (speculative time less the time
        plain decoding needed for the same tokens) over ``budget`` x a plain round's median time; ``clip``: each
        round's time at most ``CLIP`` x their median."""
        spec, plain = bk.arms[self.best_arm].rounds, bk.plain
        rate = plain.rate()
        if not spec or not rate:
            return 0
        cap = CLIP * statistics.median(t for _, t in spec) if clip else math.inf
        loss = sum(min(t, cap) for _, t in spec) - sum(n for n, _ in spec) / rate
        per_round = statistics.median(t for _, t in plain.rounds)
        if loss <= 0 or per_round <= 0:
            return 0
        return min(self.p.retry_cap, math.ceil(loss / (self.p.budget * per_round)))

    def _judge_arm(self, bk: _Bucket) -> None:
        """A probe of another arm ended: it takes over when it delivered clearly more than the arm in charge."""
        tried, best = bk.arms[self.arm].rate(), bk.arms[self.best_arm].rate()
        if tried is not None and (best is None or tried > best * (1.0 + self.p.margin)):
            self.best_arm = self.arm
            self.n_arm_switches += 1
            self._arm_every = self.p.arm_every
        else:
            self._arm_every = min(2 * self._arm_every, self.p.arm_every_max)
        self.arm, self._arm_probe, self._arm_left = self.best_arm, False, self._arm_every

    # -- what was measured -------------------------------------------------------------------------
    def rates(self, n_gen: int) -> tuple[float | None, float | None]:
        """``(speculative, plain)`` tokens per second at ``n_gen`` generating slots (None: not measured)."""
        bk = self._buckets.get(bucket(n_gen))
        if bk is None:
            return None, None
        return bk.arms[self.best_arm].rate(), bk.plain.rate()

    def plain_window(self, n_gen: int) -> WindowRate | None:
        """The plain rounds measured at ``n_gen`` generating slots (None: none yet)."""
        bk = self._buckets.get(bucket(n_gen))
        return bk.plain if bk is not None and len(bk.plain) else None

    def ratio(self, n_gen: int) -> float | None:
        """Speculative rate over plain rate at ``n_gen`` slots; None until both were measured (plain needs
        at least 2 rounds)."""
        bk = self._buckets.get(bucket(n_gen))
        return self._ratio(bk) if bk is not None else None

    def _ratio(self, bk: _Bucket) -> float | None:
        spec = bk.arms[self.best_arm]
        if len(bk.plain) < 2 or not len(spec):
            return None
        s, p = spec.rate(), bk.plain.rate()
        return s / p if s and p else None

    def info(self) -> dict:
        """What the referee measured and did, per batch-size bucket (statistics and ``/slots``)."""
        per = {}
        for b, bk in sorted(self._buckets.items()):
            spec = bk.arms[self.best_arm]
            s, p = spec.rate(), bk.plain.rate()
            per[str(b)] = {"spec_tps": None if s is None else round(s, 2),
                           "plain_tps": None if p is None else round(p, 2),
                           "n_spec": len(spec), "n_plain": len(bk.plain), "state": bk.state, "wait": bk.wait,
                           "spread": None if bk.plain.spread() is None else round(bk.plain.spread(), 3)}
            if len(self.arms) > 1:
                per[str(b)]["arms_tps"] = {a: None if w.rate() is None else round(w.rate(), 2)
                                           for a, w in bk.arms.items()}
        out = {"state": self.state, "n_probes": self.n_probes, "n_fallbacks": self.n_fallbacks,
               "n_returns": self.n_returns, "n_plain_rounds": self.n_plain_rounds, "by_slots": per}
        if len(self.arms) > 1:
            out.update(arm=self.best_arm, n_arm_switches=self.n_arm_switches)
        return out
