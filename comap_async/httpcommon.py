"""What the broker's and the inference server's HTTP endpoints share: the bearer-token check and
Prometheus exposition through ``prometheus_client``.

Each server instance owns one :class:`~prometheus_client.CollectorRegistry` (never the process-global
default one: tests run several servers in one process) holding one :class:`ScrapeCollector`. The
collector turns the server's existing in-memory counters into metric families at scrape time, so the
hot paths keep bumping plain ints and floats and never call the library.
"""

from __future__ import annotations

import hmac
from typing import Any, Callable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Samples = list[tuple[dict[str, Any], float]]


def bearer_matches(authorization: str, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time compare)."""
    return authorization.startswith("Bearer ") and hmac.compare_digest(authorization[7:].encode(), token.encode())


def family(kind: str, name: str, help_text: str, samples: Samples) -> Metric:
    """One metric family named ``name`` exactly as exposed (counters end in ``_total``), a sample per
    ``(labels, value)``. Counter families carry no ``_created`` series."""
    labelnames = list(samples[0][0]) if samples else []
    if kind == "counter":
        if not name.endswith("_total"):
            raise ValueError(f"counter {name!r} must end in _total (the exposed name is kept as given)")
        fam: Metric = CounterMetricFamily(name, help_text, labels=labelnames)
    elif kind == "gauge":
        fam = GaugeMetricFamily(name, help_text, labels=labelnames)
    else:
        raise ValueError(f"unknown metric kind {kind!r} (counter or gauge)")
    for labels, value in samples:
        fam.add_metric([str(labels[k]) for k in labelnames], float(value))
    return fam


class ScrapeCollector(Collector):
    """A collector whose families come from ``collect_fn()``, called once per scrape."""

    def __init__(self, collect_fn: Callable[[], Iterable[Metric]]) -> None:
        self._collect_fn = collect_fn

    def collect(self) -> Iterable[Metric]:
        return list(self._collect_fn())


def scrape_registry(collect_fn: Callable[[], Iterable[Metric]]) -> CollectorRegistry:
    """A fresh registry (one per server instance) exposing what ``collect_fn`` yields at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ScrapeCollector(collect_fn))
    return registry


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry's Prometheus text and its content type (``prometheus_client.CONTENT_TYPE_LATEST``)."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
