"""What `serve` exposes at /metrics for Prometheus: requests and their latency by route and status,
the time to the first token, the waiting line and the loaded models. One registry per app, so two
servers in one process (tests) never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# seconds: a demo answer takes milliseconds, a 7B's first token over an hour's pack about a second
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, queue_depth, models_loaded):
        """queue_depth(), models_loaded(): read when scraped."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mmkv_requests", "HTTP requests answered", ["route", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "mmkv_request_seconds",
            "Seconds from a request's arrival to its response (streams: to their first byte)",
            ["route"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "mmkv_time_to_first_token_seconds",
            "Seconds from a question to its first answer token, as the pack session measures it",
            buckets=BUCKETS,
            registry=self.registry,
        )
        depth = Gauge("mmkv_queue_depth", "Model calls running or waiting", registry=self.registry)
        depth.set_function(queue_depth)
        loaded = Gauge("mmkv_models_loaded", "Backbones held in memory", registry=self.registry)
        loaded.set_function(models_loaded)

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)
