"""Per-drafter counters and timers, and llama.cpp's statistics line (§3.4)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


def add_per_position(per: list[int], counts: "list[int]") -> None:
    """``per[i] += counts[i]``, growing ``per`` as needed (per-position acceptance histograms).

    >>> per = [2, 1]; add_per_position(per, [1, 1, 1]); per
    [3, 2, 1]
    """
    if len(per) < len(counts):
        per.extend([0] * (len(counts) - len(per)))
    for i, c in enumerate(counts):
        per[i] += c


@dataclass
class DrafterStats:
    n_call_begin: int = 0
    n_call_draft: int = 0
    n_call_accept: int = 0
    n_gen_drafts: int = 0
    n_acc_drafts: int = 0
    n_gen_tokens: int = 0
    n_acc_tokens: int = 0
    n_acc_tokens_per_pos: list[int] = field(default_factory=list)
    t_begin_us: int = 0
    t_draft_us: int = 0
    t_accept_us: int = 0

    def stats_line(self, type_name: str) -> str:
        """The exact line llama.cpp logs per implementation (without the log prefix).

        >>> s = DrafterStats(n_call_begin=1, n_call_draft=10, n_call_accept=4, n_gen_drafts=4, n_acc_drafts=3,
        ...                  n_gen_tokens=12, n_acc_tokens=7, n_acc_tokens_per_pos=[3, 3, 1], t_draft_us=1500)
        >>> print(s.stats_line("draft-simple"))
        statistics     draft-simple: #calls(b,g,a) =    1     10      4, #gen drafts =      4, #acc drafts =     3, #gen tokens =     12, #acc tokens =     7, #mean acc len = 2.75, #acc rate/pos = (0.750, 0.750, 0.250), dur(b,g,a) = 0.000, 1.500, 0.000 ms
        """
        s = (
            f"statistics {type_name:>16}: #calls(b,g,a) = {self.n_call_begin:4d} {self.n_call_draft:6d} "
            f"{self.n_call_accept:6d}, #gen drafts = {self.n_gen_drafts:6d}, #acc drafts = {self.n_acc_drafts:5d}, "
            f"#gen tokens = {self.n_gen_tokens:6d}, #acc tokens = {self.n_acc_tokens:5d}"
        )
        if self.n_call_accept > 0:
            mean = 1.0 + self.n_acc_tokens / self.n_call_accept
            rates = ", ".join(f"{c / self.n_call_accept:.3f}" for c in self.n_acc_tokens_per_pos)
            s += f", #mean acc len = {mean:.2f}, #acc rate/pos = ({rates})"
        s += f", dur(b,g,a) = {self.t_begin_us / 1000:.3f}, {self.t_draft_us / 1000:.3f}, {self.t_accept_us / 1000:.3f} ms"
        return s

    def to_dict(self) -> dict:
        d = dict(self.__dict__)
        d["n_acc_tokens_per_pos"] = list(self.n_acc_tokens_per_pos)
        d["mean_acc_len"] = (1.0 + self.n_acc_tokens / self.n_call_accept) if self.n_call_accept else None
        return d


class Timer:
    """Adds elapsed microseconds to ``obj.<attr>`` on exit (llama.cpp's scoped timer)."""

    __slots__ = ("obj", "attr", "t0")

    def __init__(self, obj, attr: str):
        self.obj, self.attr = obj, attr

    def __enter__(self):
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, *exc):
        setattr(self.obj, self.attr, getattr(self.obj, self.attr) + (time.perf_counter_ns() - self.t0) // 1000)
