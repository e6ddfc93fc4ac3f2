"""Prometheus metrics (prefix `iq36_`, SPEC §4) on a registry of the gateway's own.

Latency histograms are observed by the generation runner; request and error counters by the
request middleware / error handler; the worker's gauges and restart counters are read from the
supervisor's `status()` at scrape time (one source of truth). Labels are bounded: `endpoint` is a
fixed route name, `status` an HTTP status, `code` a `gateway.errors.CODES` key, `reason` a
supervisor restart reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_RATE = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000)


class _SupervisorCollector(Collector):
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        s = self._status()
        worker = s["worker"]
        restarts = CounterMetricFamily("iq36_worker_restarts", "Worker restarts by reason", labels=["reason"])
        for reason, n in sorted(s["restarts"].items()):
            restarts.add_metric([reason], n)
        yield restarts
        yield CounterMetricFamily("iq36_memory_guard_trips", "Memory-guard trips (worker replaced)",
                                  value=s["restarts"].get("memory_guard", 0))
        yield GaugeMetricFamily("iq36_queue_depth", "Requests waiting for the worker", value=s["queue"]["depth"])
        yield GaugeMetricFamily("iq36_worker_ready", "1 when a worker is ready",
                                value=1 if worker["state"] == "ready" else 0)
        yield GaugeMetricFamily("iq36_worker_rss_bytes", "Resident memory of the worker process",
                                value=worker["rss_bytes"] or 0)


class Metrics:
    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("iq36_time_to_first_token_seconds", "Admission to the first output token",
                              ["endpoint"], buckets=_LATENCY, registry=r)
        self.inter_token = Histogram("iq36_inter_token_latency_seconds", "Gap between streamed outputs",
                                     buckets=_TOKEN_GAP, registry=r)
        self.e2e = Histogram("iq36_e2e_request_latency_seconds", "Admission to the last output",
                             ["endpoint"], buckets=_LATENCY, registry=r)
        self.queue_wait = Histogram("iq36_queue_wait_seconds", "Admission until the worker took the request",
                                    buckets=_LATENCY, registry=r)
        self.prefill_rate = Histogram("iq36_prefill_tokens_per_second", "Prompt tokens / time to first token "
                                      "after dispatch", buckets=_RATE, registry=r)
        self.requests = Counter("iq36_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("iq36_prompt_tokens", "Input tokens of finished requests", registry=r)
        self.generation_tokens = Counter("iq36_generation_tokens", "Output tokens produced", registry=r)
        self.cached_tokens = Counter("iq36_cached_tokens", "Input tokens served from the prefix cache",
                                     registry=r)
        self.errors = Counter("iq36_errors", "Errors by stable code", ["code"], registry=r)
        self.aborts = Counter("iq36_aborted_requests", "Generations aborted before they finished", ["reason"],
                              registry=r)
        # Set to a function by the admission queue (read at scrape time).
        self.running = Gauge("iq36_running_requests", "Requests the worker is running (0 or 1)", registry=r)
        r.register(_SupervisorCollector(status))

    def render(self) -> bytes:
        return generate_latest(self.registry)
