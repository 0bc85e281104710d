"""How many threads a decode should use *now*: measured per batch size, beyond llama.cpp.

llama.cpp splits every operation of a decode over ``n_threads`` threads that meet at a barrier after each one.
On a quiet machine two threads on two cores decode a small model about 1.6x faster than one. With other
processes on the cores the barrier waits for whichever thread the OS descheduled, at every one of a few hundred
operations per decode, and one thread becomes several times faster (measured here with a build on both cores:
Gemma-3-270M F32 9.8 tok/s with one thread, 1.8 with two; its Q4_K_M draft 21.9 against 6.2).

A :class:`ThreadTuner` is attached to a context (:class:`~llamaspec._llama.context.Context` calls
:meth:`~ThreadTuner.before` and :meth:`~ThreadTuner.after` around every native decode). For each batch-size
bucket (1, 2, 3-4, 5-8, ... rows) it keeps the decode times of each thread count it tried (the last ``window``
of each), decodes with the current choice, and every ``probe_every`` decodes of that bucket tries another count
for ``probe_len`` decodes: a count whose median time is ``gain`` faster becomes the choice. While the choice
wins clearly the interval doubles (up to ``probe_every_max``: on a quiet machine a probe then costs under 1%).
Running fewer threads than configured, it also asks the OS every few decodes whether the cores went idle (the
load stopped) and then tries the configured count at once. The thread count does not change what a decode computes (each
output is reduced by one thread, whatever their number), so outputs are the same whatever is chosen.

Only where the user gave no thread count (``-t`` / ``-tb`` / ``-td`` are honoured) and the decode runs on the
CPU (offloaded layers and RPC servers are timed by other clocks).

>>> applied = []
>>> t = ThreadTuner([2, 1], applied.append, probe_every=4, probe_len=2)
>>> for _ in range(12):                       # two threads take 20 ms a decode, one takes 8 ms (a busy box)
...     n = t.before(1); t.after(1, 0.020 if n == 2 else 0.008)
>>> t.choice(1), applied[:3]
(1, [2, 1, 2])
"""
from __future__ import annotations

import statistics
from collections import deque
from typing import Callable, Sequence

__all__ = ["ThreadTuner", "bucket", "cpu_idle_meter"]


#: how often (in decodes) a tuner running fewer threads than configured asks the OS whether cores went idle,
#: and the idle share of all cores that triggers a probe of the configured count
IDLE_EVERY = 8
IDLE_SHARE = 0.3
#: a probe ends at its first decode when that took this many times the choice's median
ABORT = 1.5
#: the last count that won a probe, by candidate list, in this process: where a new context starts (the machine's
#: load is the same for every context of the process)
_LAST_CHOICE: dict[tuple[int, ...], int] = {}


def cpu_idle_meter(path: str = "/proc/stat") -> "Callable[[], float | None] | None":
    """A function returning the share of all CPUs' time spent idle since its last call (Linux ``/proc/stat``);
    None where the file cannot be read.

    >>> m = cpu_idle_meter(); m is None or 0.0 <= (m() or 0.0) <= 1.0
    True
    """
    def read() -> tuple[int, int] | None:
        try:
            with open(path, "rb") as f:
                vals = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        if len(vals) < 5:
            return None
        return vals[3] + vals[4], sum(vals[:8])  # idle + iowait, total (without guest time, counted in user)

    last = read()
    if last is None:
        return None
    prev = [last]

    def share() -> float | None:
        now = read()
        if now is None:
            return None
        d_idle, d_total = now[0] - prev[0][0], now[1] - prev[0][1]
        prev[0] = now
        return d_idle / d_total if d_total > 0 else None

    return share


def bucket(n: int) -> int:
    """The size bucket of ``n`` rows or slots: 1, 2, then powers of two (3-4 -> 4, 5-8 -> 8); the thread tuner's
    batch sizes and the referee's slot counts (llamaspec.referee).

    >>> [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)]
    [1, 2, 4, 4, 8, 8, 16, 16]
    """
    b = 1
    while b < n:
        b *= 2
    return b


class _Bucket:
    __slots__ = ("cur", "left", "probe", "probe_left", "every", "times", "next_alt")

    def __init__(self, cur: int, first: int, every: int, window: int, counts: Sequence[int]):
        self.cur = cur
        self.left = first  # decodes before the first probe
        self.every = every
        self.probe: int | None = None  # the count being tried, or None
        self.probe_left = 0
        self.times: dict[int, deque[float]] = {c: deque(maxlen=window) for c in counts}
        self.next_alt = 0  # which alternative the next probe tries (round robin)


class ThreadTuner:
    """The thread count of each decode of one context (module docstring). ``counts``: the candidates, the
    configured one first; ``apply(n)``: sets the context's thread count (called only when it changes)."""

    def __init__(self, counts: Sequence[int], apply: Callable[[int], None], *, probe_every: int = 16,
                 probe_every_max: int = 256, probe_len: int = 3, window: int = 8, gain: float = 0.10,
                 idle_share: "Callable[[], float | None] | None" = None):
        counts = list(dict.fromkeys(int(c) for c in counts if int(c) >= 1))
        if not counts:
            raise ValueError("a thread tuner needs at least one thread count")
        self.counts = counts
        self.apply = apply
        self.probe_every, self.probe_every_max, self.probe_len = probe_every, probe_every_max, probe_len
        self.window, self.gain = window, gain
        self._buckets: dict[int, _Bucket] = {}
        self._applied: int | None = None
        #: the share of the machine's CPU time that was idle since the last call (cpu_idle_meter), or None
        self.idle_share: Callable[[], float | None] | None = idle_share
        self._n_since_idle = 0
        self._running: tuple[_Bucket, int] | None = None
        #: probes run, and how often the choice changed
        self.n_probes = 0
        self.n_switches = 0

    def _state(self, n_rows: int) -> _Bucket:
        b = bucket(n_rows)
        st = self._buckets.get(b)
        if st is None:
            # a batch size not seen yet starts from the choice of the nearest one that was (the load that made
            # one thread win at 1 row makes it win at 8), and is checked after its first few decodes
            near = min(self._buckets, key=lambda k: (abs(k.bit_length() - b.bit_length()), k), default=None)
            if near is not None:  # what next door found, and how sure it is (its probe interval)
                cur, every = self._buckets[near].cur, self._buckets[near].every
                first = every
            else:  # the first batch size of this context: what the process's other tuners found last, if any
                hint = _LAST_CHOICE.get(tuple(self.counts))
                cur, every = (hint, self.probe_every) if hint is not None else (self.counts[0], self.probe_every)
                first = self.probe_every if hint is not None else min(self.probe_len, self.probe_every)
            st = self._buckets[b] = _Bucket(cur, first, every, self.window, self.counts)
        return st

    def choice(self, n_rows: int) -> int:
        """The thread count chosen for decodes of ``n_rows`` rows."""
        return self._state(n_rows).cur

    def before(self, n_rows: int) -> int:
        """Before a decode of ``n_rows`` rows: set and return the thread count it runs with."""
        st = self._state(n_rows)
        if st.probe is None and len(self.counts) > 1:
            alt = None
            if st.left <= 0:
                # more threads than now can only be faster where cores are idle: while the OS sees none (another
                # process has them) only fewer are tried (a two-thread probe on a busy box costs up to 10x a decode)
                alts = [c for c in self.counts if c < st.cur or (c > st.cur and self._idle_now())]
                if alts:
                    alt = alts[st.next_alt % len(alts)]
                    st.next_alt += 1
                else:
                    st.every = min(2 * st.every, self.probe_every_max)
                    st.left = st.every
            elif st.cur < self.counts[0] and self._cores_went_idle():
                alt = self.counts[0]  # the load is gone: try the configured count now, not in a hundred decodes
            if alt is not None:
                st.probe, st.probe_left = alt, self.probe_len
                st.times[alt].clear()  # judged on its own fresh times, not on those of another load
        n = st.probe if st.probe is not None else st.cur
        if n != self._applied:
            self.apply(n)
            self._applied = n
        self._running = (st, n)
        return n

    def after(self, n_rows: int, seconds: float) -> None:
        """After the decode :meth:`before` announced: it took ``seconds``."""
        running, self._running = self._running, None
        if running is None:
            return
        st, n = running
        st.times[n].append(seconds)
        if st.probe is None:
            st.left -= 1
            return
        st.probe_left -= 1
        cur_t, alt_t = st.times[st.cur], st.times[n]
        if st.probe_left > 0 and not (len(cur_t) >= 2 and seconds > ABORT * statistics.median(cur_t)):
            return
        # (a probe whose first decode is far slower than the choice ends there: on a busy machine a probe of
        # two threads can cost ten times a decode, once is enough to know)
        self.n_probes += 1
        alt, st.probe = st.probe, None
        if len(cur_t) < 2:  # nothing to compare with yet: look again soon
            st.left = self.probe_len
            return
        cur_m, alt_m = statistics.median(cur_t), statistics.median(alt_t)
        if alt_m < cur_m * (1.0 - self.gain):
            st.cur = alt
            self.n_switches += 1
            st.every = self.probe_every
            _LAST_CHOICE[tuple(self.counts)] = alt
        elif alt_m > cur_m * 1.3:
            st.every = min(2 * st.every, self.probe_every_max)
        else:
            st.every = self.probe_every
        st.left = st.every

    def _idle_now(self, unknown: bool = True) -> bool:
        """Whether the cores were idle for at least ``IDLE_SHARE`` since the last look (``unknown`` when there is
        no meter or it could not read)."""
        share = self.idle_share() if self.idle_share is not None else None
        return unknown if share is None else share >= IDLE_SHARE

    def _cores_went_idle(self) -> bool:
        """Every ``IDLE_EVERY`` decodes: were the machine's cores idle for at least ``IDLE_SHARE`` of the time
        since the last look (the OS's count, ``/proc/stat``)? Then fewer threads than configured no longer
        share the cores with anyone."""
        self._n_since_idle += 1
        if self.idle_share is None or self._n_since_idle < IDLE_EVERY:
            return False
        self._n_since_idle = 0
        return self._idle_now(unknown=False)

    def info(self) -> dict:
        """The choice and the median decode time (ms) of each count, per batch-size bucket."""
        return {"n_probes": self.n_probes, "n_switches": self.n_switches,
                "by_rows": {str(b): {"threads": st.cur,
                                     "ms": {str(c): round(statistics.median(v) * 1e3, 2) for c, v in st.times.items() if v}}
                            for b, st in sorted(self._buckets.items())}}
