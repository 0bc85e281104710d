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

Before all that, :class:`FreeCores` says how many cores other processes leave free: the machine's busy time
(``/proc/stat``) less this process's own CPU time (``os.times``), read at most every quarter second. Time booked
as *nice* is left out while this process runs at normal or higher priority: the scheduler gives a niced process a
few percent of a core against ours (weight 15 for nice 19, 110 for nice 10, against 1024; one niced by only 1-5
would take a third of a core or more, a known limit of reading ``/proc/stat``). While others use cores this
context's threads would need, a decode runs with as many threads as cores are free (at least one) and nothing is
probed: a probe of two threads on a busy box costs up to ten decodes, and its timings say more about the load than
about the thread count. The cap lifts at the next reading after they stop. The thread count does not change what
a decode computes (each output is reduced by one thread), so outputs are the same whatever is chosen.

Only where the user gave no thread count (``-t`` / ``-tb`` / ``-td`` are honoured) and the decode runs on the
CPU (offloaded layers and RPC servers are timed by other clocks).

>>> saved = dict(_LAST_CHOICE); _LAST_CHOICE.clear()   # as in a fresh process: no other tuner's choice to start from
>>> applied = []
>>> t = ThreadTuner([2, 1], applied.append, probe_every=4, probe_len=2)
>>> for _ in range(12):                       # two threads take 20 ms a decode, one takes 8 ms
...     n = t.before(1); t.after(1, 0.020 if n == 2 else 0.008)
>>> t.choice(1), applied[:3]
(1, [2, 1, 2])
>>> free = [1.0]                               # another process uses one of the two cores
>>> t = ThreadTuner([2, 1], applied.append, free_cores=lambda: free[0])
>>> [t.before(1) for _ in range(3)]
[1, 1, 1]
>>> _LAST_CHOICE.clear(); _LAST_CHOICE.update(saved)
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["FreeCores", "ThreadTuner", "bucket", "free_cores"]


#: the shortest interval (seconds) over which FreeCores measures, and how much of a core may be in use by others
#: for it still to count as free (a browser tab, a shell)
MEASURE_EVERY = 0.25
SLACK = 0.3
#: a probe ends at its first decode when that took this many times the choice's median
ABORT = 1.5
#: the last count that won a probe, by candidate list, in this process: where a new context starts (the machine's
#: load is the same for every context of the process)
_LAST_CHOICE: dict[tuple[int, ...], int] = {}


class FreeCores:
    """How many of the machine's cores other processes leave free (module docstring): the busy time of all cores
    (``/proc/stat``) less this process's own CPU time (``os.times``), over the last interval of at least
    ``MEASURE_EVERY`` seconds. ``read()`` gives the last estimate (None where ``/proc/stat`` cannot be read).

    >>> f = FreeCores(); v = f.read(); v is None or 0.0 <= v <= f.n_cpus
    True
    """

    def __init__(self, path: str = "/proc/stat", clock: Callable[[], float] = time.monotonic,
                 own_cpu: Callable[[], float] = lambda: sum(os.times()[:2]),
                 own_nice: Callable[[], int] = lambda: os.getpriority(os.PRIO_PROCESS, 0)):
        self.path, self.clock, self.own_cpu, self.own_nice = path, clock, own_cpu, own_nice
        self._lock = threading.Lock()
        self.n_cpus = 0
        self._last = self._sample()
        self._free: float | None = None

    def _sample(self) -> "tuple[float, int, int, float, int] | None":
        try:
            with open(self.path, "rb") as f:
                lines = f.read().split(b"\n")
            vals = [int(x) for x in lines[0].split()[1:9]]
        except (OSError, ValueError, IndexError):
            return None
        if len(vals) < 5:
            return None
        self.n_cpus = sum(1 for ln in lines[1:] if ln.startswith(b"cpu")) or (os.cpu_count() or 1)
        # idle + iowait, the total (guest time is counted in user already), and the niced processes' time
        return self.clock(), vals[3] + vals[4], sum(vals), self.own_cpu(), vals[1]

    def _own_nice(self) -> int:
        try:
            return self.own_nice()
        except OSError:
            return 0

    def read(self) -> float | None:
        with self._lock:
            last = self._last
            if last is None:
                return None
            if self.clock() - last[0] >= MEASURE_EVERY:
                now = self._sample()
                if now is None:
                    return self._free
                d_wall, d_idle, d_total, d_own, d_nice = (a - b for a, b in zip(now, last))
                if d_total > 0 and d_wall > 0:
                    # cores in use by all processes, less those niced below us (they yield: module docstring)
                    yielding = d_nice if self._own_nice() <= 0 else 0
                    busy = (1.0 - (d_idle + yielding) / d_total) * self.n_cpus
                    others = max(0.0, busy - d_own / d_wall)
                    self._free = max(0.0, self.n_cpus - others)
                self._last = now
            return self._free


_FREE: FreeCores | None = None
_FREE_LOCK = threading.Lock()


def free_cores() -> float | None:
    """The process-wide :class:`FreeCores` estimate (every context of the process shares one meter)."""
    global _FREE
    with _FREE_LOCK:
        if _FREE is None:
            _FREE = FreeCores()
    return _FREE.read()


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


@dataclass(slots=True)
class _Bucket:
    cur: int
    left: int  # decodes before the next probe
    every: int
    times: dict[int, deque[float]]  # the last decode times of each count
    probe: int | None = None  # the count being tried, or None
    probe_left: int = 0
    next_alt: int = 0  # which alternative the next probe tries (round robin)


class ThreadTuner:
    """The thread count of each decode of one context (module docstring). ``counts``: the candidates, the
    configured one first; ``apply(n)``: sets the context's thread count (called only when it changes)."""

    def __init__(self, counts: Sequence[int], apply: Callable[[int], None], *, probe_every: int = 16,
                 probe_every_max: int = 256, probe_len: int = 3, window: int = 8, gain: float = 0.10,
                 free_cores: "Callable[[], float | None] | None" = None):
        counts = list(dict.fromkeys(int(c) for c in counts if int(c) >= 1))
        if not counts:
            raise ValueError("a thread tuner needs at least one thread count")
        self.counts = counts
        self.apply = apply
        self.probe_every, self.probe_every_max, self.probe_len = probe_every, probe_every_max, probe_len
        self.window, self.gain = window, gain
        self._buckets: dict[int, _Bucket] = {}
        self._applied: int | None = None
        #: the cores other processes leave free (FreeCores.read; None: unknown, no cap)
        self.free_cores: Callable[[], float | None] | None = free_cores
        #: decodes run under the cap (fewer threads because other processes use the cores)
        self.n_capped = 0
        self._running: tuple[_Bucket, int] | None = None
        #: probes run
        self.n_probes = 0

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
            st = self._buckets[b] = _Bucket(cur, first, every, {c: deque(maxlen=self.window) for c in self.counts})
        return st

    def choice(self, n_rows: int) -> int:
        """The thread count chosen for decodes of ``n_rows`` rows."""
        return self._state(n_rows).cur

    def cap(self) -> int:
        """The most threads the free cores allow now (the configured count when nobody else uses them)."""
        free = self.free_cores() if self.free_cores is not None else None
        if free is None:
            return self.counts[0]
        return max(1, min(self.counts[0], int(free + SLACK)))

    def before(self, n_rows: int) -> int:
        """Before a decode of ``n_rows`` rows: set and return the thread count it runs with."""
        st = self._state(n_rows)
        cap = self.cap()
        if cap < self.counts[0]:  # other processes use the cores: no probe, as many threads as cores are free
            st.probe = None
            n = min(st.cur, cap)
            self.n_capped += 1
        else:
            if st.probe is None and len(self.counts) > 1:
                if st.left <= 0:
                    alts = [c for c in self.counts if c != st.cur]
                    alt = alts[st.next_alt % len(alts)]
                    st.next_alt += 1
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
        if st.probe is None and n != st.cur:  # a capped decode: its time says more about the load than about n
            return
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
            st.every = self.probe_every
            _LAST_CHOICE[tuple(self.counts)] = alt
        elif alt_m > cur_m * 1.3:
            st.every = min(2 * st.every, self.probe_every_max)
        else:
            st.every = self.probe_every
        st.left = st.every
