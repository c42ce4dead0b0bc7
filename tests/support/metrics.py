"""Reading Prometheus samples from the metrics registry."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.openai.metrics import EngineMetrics


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out
