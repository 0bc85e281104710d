"""What the bench measures besides the runs: the machine it runs on, and the target's and draft's decode costs."""
from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path

from .. import _llama as llama

VERIFY_SIZES = (1, 2, 4, 8, 16, 32, 64)

log = logging.getLogger("llamaspec")


def machine_info() -> dict:
    """CPU model, cores available, platform, Python version and the load average at the start."""
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:  # pragma: no cover
        pass
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    return {"cpu": cpu, "n_cpus_available": llama.default_threads(), "platform": platform.platform(),
            "python": sys.version.split()[0], "loadavg_at_start": load}


def add_loadavg_at_end(machine: dict) -> None:
    try:
        machine["loadavg_at_end"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass


def file_type(path: str) -> str | None:
    """The GGUF's ``general.file_type`` (its quantisation), or None where it cannot be read."""
    out = None
    try:
        with llama.Model(path, vocab_only=True) as vm:
            out = vm.meta("general.file_type")
    except Exception as ex:  # pragma: no cover - the report says None
        log.warning("bench: could not read general.file_type of %s (the report gives none): %s", path, ex)
    return out


def measure_costs(target: llama.Model, draft: llama.Model | None, threads: int, *, threads_batch: int | None = None,
                  threads_draft: int | None = None, draft_trimmed: str | None = None) -> dict:
    """Target verify-cost curve and draft/target cost ratio (§6 probe; ms of one decode with logits);
    with ``draft_trimmed`` (the trimmed copy the ``default`` modes draft with) its cost ratio too."""
    from ..probe import measure_verify_curve, recommend_draft_length

    curve = measure_verify_curve(target, sizes=VERIFY_SIZES, n_threads=threads, n_threads_batch=threads_batch)
    out: dict = {"verify_curve_ms": {str(k): round(v, 4) for k, v in curve.items()},
                 "verify_cost_rel": {str(k): round(v / curve[1], 4) for k, v in curve.items()}}
    if draft is not None:
        d = measure_verify_curve(draft, sizes=(1,), n_threads=threads_draft or threads, n_threads_batch=threads_batch)
        out["draft_ms_1"] = round(d[1], 4)
        out["target_ms_1"] = round(curve[1], 4)
        out["cost_ratio"] = d[1] / curve[1]
        if draft_trimmed is not None:
            tm = llama.Model(draft_trimmed, use_mmap=False)
            try:
                dt = measure_verify_curve(tm, sizes=(1,), n_threads=threads_draft or threads, n_threads_batch=threads_batch)
            finally:
                tm.close()
            out["draft_trimmed_ms_1"] = round(dt[1], 4)
            out["cost_ratio_trimmed"] = dt[1] / curve[1]
        out["recommended_draft_n_max"] = [
            {"acceptance": a, "n_max": k, "expected_speedup": round(s, 3)}
            for a in (0.6, 0.7, 0.8, 0.9)
            for k, s in [recommend_draft_length(a, out["cost_ratio"], curve)]
        ]
    return out
