"""Pure arithmetic of the benchmark: run records, aggregation, the speedup model, divergences.

Definitions (also in ``docs/benchmarks/README.md``):

* **decode tokens/s** of a run = ``(n_predicted - 1) / t_decode`` — the first token comes from the prompt's
  logits (llama.cpp server's ``predicted_per_second``). Per engine and mode, each repeat's throughput is
  ``sum(n_predicted - 1) / sum(t_decode)`` over all prompts; the table gives the median, min and max of
  these per-repeat values.
* **acceptance rate** = accepted / drafted; **mean accepted length** ``L = 1 + accepted / S`` where ``S``
  is the number of verification steps that carried a draft; **acceptance per position** ``i`` = number of
  steps that accepted at least ``i + 1`` drafted tokens / ``S``.
* **per-token acceptance a**: the ``a`` of the standard model (each drafted token accepted independently
  with probability ``a``) that reproduces the measured mean length, i.e. the root of
  ``(1 - a^(k+1)) / (1 - a) = L`` with ``k = drafted / S`` (the mean draft length actually verified).
* **predicted speedup** = ``(1 - a^(k+1)) / ((1 - a) (k c + v))`` with ``c`` = draft/target cost of one
  token (0 for n-gram drafters) and ``v`` = cost of verifying ``k + 1`` rows relative to one row (the
  target's verify-cost curve). When some rounds had no draft (n-gram drafters find no match), those
  ``P`` rounds cost 1 and give 1 token: ``(S E + P) / (S (k c + v) + P)`` with ``E`` the formula's
  numerator; with ``P = 0`` this is exactly the formula above.
* **efficiency** = measured speedup over plain (same engine) / predicted speedup.

>>> summarize([3.0, 1.0, 2.0])
{'median': 2.0, 'min': 1.0, 'max': 3.0, 'n': 3}
>>> round(per_token_acceptance(1 + 0.8 + 0.64 + 0.512, 3), 6)
0.8
>>> round(predicted_speedup(0.8, 3, 0.0, 1.0), 4)
2.952
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


@dataclass
class RunResult:
    """One generation by one engine in one mode for one prompt."""

    engine: str
    mode: str
    prompt_id: str
    category: str
    repeat: int
    n_prompt: int = 0
    n_predicted: int = 0
    t_prompt_s: float = 0.0
    t_decode_s: float = 0.0
    n_drafted: int | None = None
    n_accepted: int | None = None
    n_verif_steps: int | None = None
    accepted_per_pos: list[int] | None = None  # counts: steps that accepted >= i+1 drafted tokens
    tokens: list[int] | None = None
    text: str | None = None
    tool: str = ""
    error: str | None = None

    @property
    def decode_tps(self) -> float:
        n = max(0, self.n_predicted - 1)
        return n / self.t_decode_s if self.t_decode_s > 0 else 0.0

    def to_dict(self, *, with_tokens: bool = True) -> dict:
        d = asdict(self)
        d["decode_tokens_per_second"] = round(self.decode_tps, 4)
        d["t_prompt_s"] = round(self.t_prompt_s, 6)
        d["t_decode_s"] = round(self.t_decode_s, 6)
        if not with_tokens:
            d.pop("tokens", None)
            d.pop("text", None)
        return d


def summarize(values: Sequence[float]) -> dict:
    """Median, min and max (None for an empty list)."""
    v = [float(x) for x in values]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}


def expected_length(a: float, k: float) -> float:
    """``(1 - a^(k+1)) / (1 - a)``: expected tokens per verification step (accepted drafts + the target's
    own token) when each drafted token is accepted with probability ``a`` and ``k`` are drafted."""
    if a >= 1.0:
        return k + 1.0
    if a <= 0.0:
        return 1.0
    return (1.0 - a ** (k + 1.0)) / (1.0 - a)


def per_token_acceptance(mean_len: float, k: float) -> float:
    """The ``a`` with ``expected_length(a, k) == mean_len`` (bisection; clamped to [0, 1])."""
    if k <= 0 or mean_len <= 1.0:
        return 0.0
    if mean_len >= k + 1.0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if expected_length(mid, k) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def predicted_speedup(a: float, k: float, c: float, v: float, n_spec_steps: float = 1.0, n_plain_steps: float = 0.0) -> float:
    """Speedup the standard model predicts: ``(1 - a^(k+1)) / ((1 - a)(k c + v))``, blended with
    ``n_plain_steps`` undrafted rounds (cost 1, one token each) when given.

    >>> round(predicted_speedup(0.5, 2, 0.25, 1.5), 4)
    0.875
    >>> predicted_speedup(0.5, 2, 0.0, 1.0, n_spec_steps=0, n_plain_steps=10)
    1.0
    """
    e = expected_length(a, k)
    cost = k * c + v
    num = n_spec_steps * e + n_plain_steps
    den = n_spec_steps * cost + n_plain_steps
    return num / den if den > 0 else 1.0


def efficiency(measured_speedup: float | None, predicted: float | None) -> float | None:
    """measured / predicted (None when either is unknown).

    >>> efficiency(1.8, 2.0)
    0.9
    >>> efficiency(None, 2.0) is None
    True
    """
    if measured_speedup is None or not predicted:
        return None
    return measured_speedup / predicted


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """Index of the first differing element; when one is a strict prefix of the other, the shorter length;
    None when equal.

    >>> first_divergence([1, 2, 3], [1, 2, 3]), first_divergence([1, 2, 3], [1, 5, 3]), first_divergence([1, 2], [1, 2, 3])
    (None, 1, 2)
    """
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def schedule(n_repeats: int, n_prompts: int, n_configs: int) -> list[tuple[int, int, int]]:
    """Run order ``(repeat, prompt, config)``: every configuration (engine x mode) runs back to back on each
    prompt, in forward order on even repeats and reversed on odd ones (A B C, C B A, ...), so that slow
    drift of the machine hits every configuration alike.

    >>> schedule(2, 1, 3)
    [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 2), (1, 0, 1), (1, 0, 0)]
    """
    return [(r, p, c) for r in range(n_repeats) for p in range(n_prompts)
            for c in (range(n_configs) if r % 2 == 0 else reversed(range(n_configs)))]


# -------------------------------------------------------------------------------------------------
# aggregation
# -------------------------------------------------------------------------------------------------


@dataclass
class SpecTotals:
    n_drafted: int = 0
    n_accepted: int = 0
    n_verif_steps: int = 0
    n_predicted: int = 0
    n_runs: int = 0
    per_pos: list[int] = field(default_factory=list)
    steps_known: bool = True
    per_pos_known: bool = True

    def add(self, r: RunResult) -> None:
        if r.n_drafted is None:
            return
        self.n_runs += 1
        self.n_drafted += r.n_drafted
        self.n_accepted += r.n_accepted or 0
        self.n_predicted += r.n_predicted
        if r.n_verif_steps is None:
            self.steps_known = False
        else:
            self.n_verif_steps += r.n_verif_steps
        if r.accepted_per_pos is None:
            self.per_pos_known = False
        else:
            for i, c in enumerate(r.accepted_per_pos):
                if i >= len(self.per_pos):
                    self.per_pos.append(0)
                self.per_pos[i] += c

    def to_dict(self) -> dict | None:
        if self.n_runs == 0:
            return None
        steps = self.n_verif_steps if self.steps_known else None
        d = {
            "n_drafted": self.n_drafted,
            "n_accepted": self.n_accepted,
            "n_verif_steps": steps,
            "acceptance_rate": self.n_accepted / self.n_drafted if self.n_drafted else None,
            "mean_accepted_length": (1.0 + self.n_accepted / steps) if steps else None,
            "mean_draft_length": (self.n_drafted / steps) if steps else None,
            "accepted_per_pos": [c / steps for c in self.per_pos] if (steps and self.per_pos_known) else None,
        }
        if steps:
            d["n_plain_steps"] = max(0, self.n_predicted - self.n_runs - steps - self.n_accepted)
        return d


def _repeat_throughput(runs: Iterable[RunResult]) -> dict[int, float]:
    toks: dict[int, float] = defaultdict(float)
    secs: dict[int, float] = defaultdict(float)
    for r in runs:
        toks[r.repeat] += max(0, r.n_predicted - 1)
        secs[r.repeat] += r.t_decode_s
    return {k: toks[k] / secs[k] for k in toks if secs[k] > 0}


def aggregate(results: Sequence[RunResult], *, cost_ratio: float | None = None, verify_curve: dict | None = None,
              reference: dict[str, str] | None = None, cost_ratio_trimmed: float | None = None) -> list[dict]:
    """One row per (engine, mode): throughput summary, prompt time, acceptance, speedup, efficiency.

    ``reference`` maps an engine to the engine whose plain run is its baseline (default: itself);
    ``cost_ratio_trimmed`` is the draft cost of the ``default:...`` modes (the trimmed draft), when measured.
    """
    from ..probe import relative_verify_cost

    ok = [r for r in results if r.error is None]
    keys = list(dict.fromkeys((r.engine, r.mode) for r in results))
    rows: list[dict] = []
    tps_median: dict[tuple[str, str], float] = {}
    for eng, mode in keys:
        runs = [r for r in ok if r.engine == eng and r.mode == mode]
        per_rep = _repeat_throughput(runs)
        s = summarize(list(per_rep.values()))
        totals = SpecTotals()
        for r in runs:
            totals.add(r)
        row = {
            "engine": eng,
            "mode": mode,
            "tool": runs[0].tool if runs else "",
            "n_runs": len(runs),
            "n_errors": sum(1 for r in results if r.engine == eng and r.mode == mode and r.error is not None),
            "decode_tps": s,
            "prompt_ms_median": statistics.median([r.t_prompt_s * 1e3 for r in runs]) if runs else None,
            "n_tokens_median": statistics.median([r.n_predicted for r in runs]) if runs else None,
            "spec": totals.to_dict(),
        }
        if s["median"] is not None:
            tps_median[(eng, mode)] = s["median"]
        rows.append(row)
    # speedups, predictions, ratios
    plain_of = {row["engine"]: tps_median.get((row["engine"], "plain")) for row in rows if row["mode"] == "plain"}
    for row in rows:
        eng, mode = row["engine"], row["mode"]
        med = tps_median.get((eng, mode))
        base = plain_of.get((reference or {}).get(eng, eng))
        row["speedup"] = (med / base) if (med is not None and base) else None
        spec = row["spec"]
        row["per_token_acceptance"] = None
        row["predicted_speedup"] = None
        if spec and spec.get("n_verif_steps"):
            k = spec["mean_draft_length"]
            a = per_token_acceptance(spec["mean_accepted_length"], k)
            c = 0.0 if not _uses_draft_model(mode) else cost_ratio
            if c and mode.startswith("default:") and cost_ratio_trimmed is not None:
                c = cost_ratio_trimmed
            row["per_token_acceptance"] = a
            if c is not None and verify_curve:
                v = relative_verify_cost({int(x): float(y) for x, y in verify_curve.items()}, k + 1)
                row["predicted_speedup"] = predicted_speedup(a, k, c, v, spec["n_verif_steps"], spec.get("n_plain_steps", 0))
                row["verify_cost_rel"] = v
                row["cost_ratio"] = c
        row["efficiency"] = efficiency(row["speedup"], row["predicted_speedup"])
    for row in rows:
        mine = tps_median.get(("llamaspec", row["mode"]))
        for eng, key in (("native", "ratio_llamaspec_native"), ("native-server", "ratio_llamaspec_native_server")):
            nat = tps_median.get((eng, row["mode"]))
            row[key] = (mine / nat) if (row["engine"] == "llamaspec" and mine and nat) else None
    return rows


def _uses_draft_model(mode: str) -> bool:
    return "draft-simple" in mode or mode.startswith("synth:")


def per_group_tps(results: Sequence[RunResult], key) -> dict:
    """Median over repeats of per-repeat throughput, grouped by ``key(run)`` (e.g. (engine, mode, category))."""
    groups: dict = defaultdict(list)
    for r in results:
        if r.error is None:
            groups[key(r)].append(r)
    return {k: summarize(list(_repeat_throughput(v).values()))["median"] for k, v in groups.items()}
