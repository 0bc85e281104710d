"""A machine made busy on purpose: ``llamaspec bench --load N --load-decode M`` runs its comparison with N
busy-loop processes and M plain llama.cpp decodes of a model beside it, on the same cores, for the whole run.

Users' machines are rarely idle (a build, a browser, a second model): a speed claim is checked with a load
beside it as well as on a quiet machine, and every engine of the interleaved run sees the same load. The load's
processes start before the first timed run and stop after the last; what they consumed (CPU cores on average,
from ``/proc/PID/stat``) goes into the report beside the load average.

Run as a module it is the decode load itself: ``python -m llamaspec.bench.load MODEL [THREADS]`` decodes
``MODEL`` plainly, 64 tokens at a time, until it is stopped.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

__all__ = ["BackgroundLoad", "LoadSpec", "sigterm_unwinds"]

#: a busy loop that ends when the process that started it does (killed, crashed, or never left its ``with``):
#: a parent that dies hands its children to another process, so ``getppid()`` changes (checked every ~10 ms)
_BUSY = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
         "    for _ in range(200000):\n        pass\n")


@dataclass(frozen=True)
class LoadSpec:
    """``busy`` busy-loop processes and ``decode`` plain decodes of ``model`` with ``threads`` threads each."""

    busy: int = 0
    decode: int = 0
    model: str | None = None
    threads: int = 1

    def __post_init__(self):
        from ..errors import UsageError

        if self.busy < 0 or self.decode < 0:
            raise UsageError("--load and --load-decode are counts of processes: 0 or more")
        if self.decode and not self.model:
            raise UsageError("--load-decode needs a model to decode (--load-model, default: the target)")

    @property
    def active(self) -> bool:
        return self.busy > 0 or self.decode > 0

    def describe(self) -> str:
        """One line for the report.

        >>> LoadSpec(busy=2).describe()
        '2 busy-loop processes'
        >>> LoadSpec(busy=1, decode=1, model="/m/x.gguf").describe()
        '1 busy-loop process, 1 llama.cpp decode of x.gguf (1 thread)'
        >>> LoadSpec().describe()
        'none (quiet machine)'
        """
        parts = []
        if self.busy:
            parts.append(f"{self.busy} busy-loop process{'es' if self.busy != 1 else ''}")
        if self.decode:
            name = os.path.basename(self.model or "")
            parts.append(f"{self.decode} llama.cpp decode{'s' if self.decode != 1 else ''} of {name} "
                         f"({self.threads} thread{'s' if self.threads != 1 else ''})")
        return ", ".join(parts) if parts else "none (quiet machine)"


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` and its waited-for children (Linux), None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class BackgroundLoad:
    """The processes of a :class:`LoadSpec`, started on ``__enter__`` and stopped on ``__exit__``;
    :meth:`summary` says what they did."""

    def __init__(self, spec: LoadSpec):
        self.spec = spec
        self.procs: list[subprocess.Popen] = []
        self._t0 = self._t1 = 0.0
        self._cpu: dict[int, float] = {}

    def __enter__(self) -> "BackgroundLoad":
        s = self.spec
        try:
            for _ in range(s.busy):
                self.procs.append(subprocess.Popen([sys.executable, "-c", _BUSY], stdin=subprocess.DEVNULL,
                                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for _ in range(s.decode):
                self.procs.append(subprocess.Popen([sys.executable, "-m", "llamaspec.bench.load", str(s.model), str(s.threads)],
                                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        except BaseException:
            self._stop()
            raise
        # the processes start (Python, and a model for the decodes) before the timed runs do
        time.sleep(2.0 if s.decode else 0.5 if s.busy else 0.0)
        self._t0 = time.monotonic()
        self._cpu = {p.pid: _cpu_seconds(p.pid) or 0.0 for p in self.procs}
        return self

    def __exit__(self, *exc) -> None:
        self._t1 = time.monotonic()
        for p in self.procs:
            c = _cpu_seconds(p.pid)
            self._cpu[p.pid] = (c - self._cpu.get(p.pid, 0.0)) if c is not None else float("nan")
        self._stop()

    def _stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def summary(self) -> dict:
        """The load as run: its spec, how long, and the CPU cores its processes used on average."""
        wall = max(self._t1 - self._t0, 1e-9)
        used = sum(v for v in self._cpu.values() if v == v) if self.procs else 0.0
        died = [p.pid for p in self.procs if p.returncode not in (None, -signal.SIGTERM, 0)]
        return {"busy": self.spec.busy, "decode": self.spec.decode, "model": self.spec.model,
                "threads": self.spec.threads, "description": self.spec.describe(),
                "wall_s": round(wall, 1), "cores_used": round(used / wall, 2), "died": died}


def _decode_forever(model: str, threads: int) -> None:  # pragma: no cover - a subprocess
    from ..engine import Engine

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    parent = os.getppid()
    with Engine(model, n_ctx=512, n_threads=threads) as eng:
        prompt = eng.tokenize("The history of the printing press begins")
        while os.getppid() == parent:  # ends with the process that started it, as _BUSY does
            eng.generate(prompt, n_predict=64)


def sigterm_unwinds():
    """While the bench runs, SIGTERM exits through the ``finally`` blocks (status 143), so its servers, engines
    and ``--load`` processes are stopped, as on Ctrl-C (``llamaspec bench``, benchmarks/lcp_server.py); returns
    the function that puts the old handler back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    old = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":  # pragma: no cover
    _decode_forever(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
