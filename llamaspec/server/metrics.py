"""``GET /metrics`` (opt-in ``--metrics``): Prometheus text with llama-server's metric names.

Read from :meth:`Engine.metrics` at scrape time by a ``prometheus_client`` collector on a registry of its
own (no process metrics, as llama-server). Counters keep llama-server's sample names
(``llamacpp:prompt_tokens_total``, ``llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"}``,
...); what llama-server does not have is named ``llamaspec:`` (per-drafter counters with a ``spec_type``
label, request totals).
"""
from __future__ import annotations

import contextlib

from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

#: (engine metrics key, metric name without ``_total``, help) of the counters
COUNTERS = (
    ("prompt_tokens_total", "llamacpp:prompt_tokens", "Number of prompt tokens processed."),
    ("prompt_tokens_cached_total", "llamacpp:prompt_tokens_cached", "Number of prompt tokens reused from the prompt cache."),
    ("prompt_seconds_total", "llamacpp:prompt_seconds", "Prompt process time"),
    ("tokens_predicted_total", "llamacpp:tokens_predicted", "Number of generation tokens processed."),
    ("tokens_predicted_seconds_total", "llamacpp:tokens_predicted_seconds", "Predict process time"),
    ("n_decode_total", "llamacpp:n_decode", "Total number of target decode calls"),
    ("spec_decode_num_draft_tokens_total", "llamacpp:spec_decode_num_draft_tokens",
     "Number of draft tokens proposed by speculative decoding."),
    ("spec_decode_num_accepted_tokens_total", "llamacpp:spec_decode_num_accepted_tokens",
     "Number of draft tokens accepted by speculative decoding."),
    ("spec_decode_num_drafts_total", "llamacpp:spec_decode_num_drafts",
     "Number of speculative decoding drafts (verification steps)."),
    ("requests_total", "llamaspec:requests", "Number of finished requests (cancelled ones included)."),
    ("requests_deferred_total", "llamaspec:requests_deferred", "Number of requests that waited for a slot."),
)


def make_registry(get_engine: Callable[[], "Engine | None"]):
    """A ``CollectorRegistry`` holding one collector that reads the engine's counters at scrape time."""
    from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily

    class EngineCollector:
        #: llama-server's ``n_tokens_max``: the most tokens a slot has held (here: seen at a scrape, or as
        #: reported by the engine)
        n_tokens_max = 0

        def collect(self) -> Iterator:
            eng = get_engine()
            if eng is None:
                return
            m = eng.metrics()
            with contextlib.suppress(Exception):
                held = [int(i.get("n_past", 0) or 0) for i in eng.slots_info()]
                self.n_tokens_max = max([self.n_tokens_max, int(m.get("n_tokens_max", 0)), *held])
            registry.n_tokens_max = self.n_tokens_max
            for key, name, doc in COUNTERS:
                if key in m:
                    yield CounterMetricFamily(name, doc, value=float(m[key]))
            per_pos = CounterMetricFamily("llamacpp:spec_decode_num_accepted_tokens_per_pos",
                                          "Number of accepted draft tokens at each draft position.",
                                          labels=["position"])
            for pos, n in enumerate(m.get("spec_decode_num_accepted_tokens_per_pos_total", [])):
                per_pos.add_metric([str(pos)], float(n))
            yield per_pos
            t_prompt, n_prompt = m.get("prompt_seconds_total", 0.0), m.get("prompt_tokens_total", 0)
            t_gen, n_gen = m.get("tokens_predicted_seconds_total", 0.0), m.get("tokens_predicted_total", 0)
            yield GaugeMetricFamily("llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                                    value=n_prompt / t_prompt if t_prompt > 0 else 0.0)
            yield GaugeMetricFamily("llamacpp:predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                                    value=n_gen / t_gen if t_gen > 0 else 0.0)
            yield GaugeMetricFamily("llamacpp:n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
                                    value=float(m.get("n_busy_slots_per_decode", 0.0)))
            yield GaugeMetricFamily("llamacpp:requests_processing", "Number of requests processing.",
                                    value=float(m.get("requests_processing", 0)))
            yield GaugeMetricFamily("llamacpp:requests_deferred", "Number of requests deferred.",
                                    value=float(m.get("requests_deferred", 0)))
            drafters = eng.drafter_stats()
            if drafters:
                fams = {
                    "n_gen_drafts": CounterMetricFamily("llamaspec:drafter_drafts", "Drafts proposed, per drafter.",
                                                        labels=["spec_type"]),
                    "n_acc_drafts": CounterMetricFamily("llamaspec:drafter_drafts_accepted",
                                                        "Drafts with at least one accepted token, per drafter.",
                                                        labels=["spec_type"]),
                    "n_gen_tokens": CounterMetricFamily("llamaspec:drafter_draft_tokens", "Draft tokens proposed, per drafter.",
                                                        labels=["spec_type"]),
                    "n_acc_tokens": CounterMetricFamily("llamaspec:drafter_accepted_tokens",
                                                        "Draft tokens accepted, per drafter.", labels=["spec_type"]),
                }
                for d in drafters:
                    for key, fam in fams.items():
                        fam.add_metric([str(d.get("type"))], float(d.get(key, 0)))
                yield from fams.values()

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector())
    return registry


def render(registry) -> tuple[bytes, str]:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    text = generate_latest(registry)
    # llama-server's one counter without a _total suffix, which prometheus_client would add to its TYPE line
    n = getattr(registry, "n_tokens_max", None)
    if n is not None:
        text += (b"# HELP llamacpp:n_tokens_max Largest observed n_tokens.\n# TYPE llamacpp:n_tokens_max counter\n"
                 + f"llamacpp:n_tokens_max {float(n)}\n".encode())
    return text, CONTENT_TYPE_LATEST
