"""Prometheus metrics for the HTTP server, exposed with ``prometheus_client``.

Each ``Metrics`` owns its own ``CollectorRegistry`` (never the process-wide default), so several
apps in one process keep separate counts. Request counters and latency histograms are updated by
the frontend as requests finish; scheduler gauges (running / waiting requests, KV usage, prefix
cache hit rate, speculative and hierarchical cache counters) are read from ``get_server_info`` at
scrape time and exist only in the scrape that has them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "rollout_engine_"
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
FINISH_REASONS = ("stop", "length", "abort")   # always exposed, at zero until seen

_SPEC_COUNTERS = (
    ("spec_verify_steps", "Decode forwards run with speculation on."),
    ("spec_draft_tokens", "Proposed (draft) tokens verified."),
    ("spec_accepted_tokens", "Proposed tokens the target accepted."),
    ("spec_off_steps", "Decode forwards of batches that switched speculation off "
                       "(too many requests, or a grammar request)."),
    ("spec_off_low_accept_rows", "Request decode steps without proposals because the "
                                 "request's acceptance was low."),
    ("spec_off_low_accept_steps", "Decode forwards whose every request was switched "
                                  "off for low acceptance."),
)

_HICACHE_COUNTERS = (
    ("device_hit_tokens", "Prompt tokens of admitted requests found on the device (L1)."),
    ("host_hit_tokens", "Prompt tokens loaded back from the host tier (L2)."),
    ("storage_hit_tokens", "Prompt tokens fetched from the storage tier (L3)."),
    ("bytes_to_host", "KV bytes copied from the device pool to the host tier."),
    ("bytes_to_device", "KV bytes copied from the host tier to the device pool."),
    ("storage_bytes_read", "KV bytes read from the storage tier."),
    ("storage_bytes_written", "KV bytes written to the storage tier."),
    ("load_seconds", "Seconds spent loading host pages back into the device pool."),
    ("storage_fetch_seconds", "Seconds spent fetching blocks from the storage tier."),
)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, help_text, value=float(value))


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, help_text, value=float(value))


def _spec_families(stats: dict[str, Any]) -> Iterator[Metric]:
    """Speculative decoding counters (present only when the engine speculates)."""
    if "spec_verify_steps" not in stats:
        return
    for name, help_text in _SPEC_COUNTERS:
        yield _counter(f"{name}_total", help_text, int(stats.get(name) or 0))
    rows = int(stats.get("spec_verify_rows") or 0)
    yield _gauge("spec_accept_length",
                 "Mean tokens per request per verify forward (accepted proposals + 1).",
                 (int(stats.get("spec_accepted_tokens") or 0) / rows + 1) if rows else 0.0)


def _hicache_families(tiers: Optional[dict[str, Any]]) -> Iterator[Metric]:
    """Hierarchical cache counters (present only with enable_hierarchical_cache)."""
    if not tiers:
        return
    for name, help_text in _HICACHE_COUNTERS:
        if name in tiers:
            yield _counter(f"hicache_{name}_total", help_text, tiers[name])
    yield _gauge("hicache_host_cached_tokens", "KV tokens held by the host tier.",
                 tiers.get("host_cached_tokens", 0))
    yield _gauge("hicache_host_total_tokens", "Host tier capacity in tokens.",
                 tiers.get("host_total_tokens", 0))


def _server_families(info: Optional[dict[str, Any]], alive: bool) -> Iterator[Metric]:
    """The scheduler's families from one ``get_server_info`` answer (None: unavailable)."""
    yield _gauge("scheduler_alive", "1 while the scheduler process is alive.", int(alive))
    if info is None:
        return
    total = max(int(info.get("max_total_num_tokens") or 0), 1)
    free = int(info.get("kv_free_tokens") or 0)
    stats = info.get("stats") or {}
    prompt = int(stats.get("prompt_tokens") or 0)
    yield _gauge("num_running_reqs", "Requests in the running batch.",
                 info.get("num_running_reqs", 0))
    yield _gauge("num_waiting_reqs", "Requests waiting for admission.",
                 info.get("num_waiting_reqs", 0))
    yield _gauge("kv_total_tokens", "KV cache capacity in tokens.", total)
    yield _gauge("kv_cached_tokens", "KV tokens held by the radix (prefix) cache.",
                 info.get("kv_cached_tokens", 0))
    yield _gauge("kv_usage_ratio",
                 "Fraction of KV slots not free (running requests + prefix cache).",
                 (total - free) / total)
    yield _gauge("cache_hit_rate",
                 "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                 (int(stats.get("cached_tokens") or 0) / prompt) if prompt else 0.0)
    yield _counter("num_retractions_total", "Requests retracted for lack of KV.",
                   stats.get("num_retractions", 0))
    yield _counter("forward_passes_total", "Model forward passes.",
                   stats.get("forward_passes", 0))
    yield from _spec_families(stats)
    yield from _hicache_families(info.get("hicache"))
    version = GaugeMetricFamily(PREFIX + "weight_version_info",
                                "The serving weight version (as a label).", labels=["version"])
    version.add_metric([str(info.get("weight_version"))], 1.0)
    yield version


class _ScrapeCollector:
    """Yields the scheduler's families of the scrape in progress (``Metrics.render`` sets them)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def describe(self) -> list[Metric]:
        return []            # names vary with the engine's features: nothing to reserve

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


class Metrics:
    """The HTTP frontend's metrics, in a registry of its own.

    ``observe_*`` may be called from any thread; ``render`` serialises scrapes.
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._scrape = _ScrapeCollector()
        self._scrape_lock = threading.Lock()
        self.registry.register(self._scrape)
        p, r = PREFIX, self.registry
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens",
                                         "Generated tokens of finished requests.", registry=r)
        self.cached_tokens = Counter(
            f"{p}cached_prompt_tokens",
            "Prompt tokens of finished requests served from the prefix cache.", registry=r)
        self.finished = Counter(f"{p}requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.client_disconnects = Counter(f"{p}client_disconnects",
                                          "Requests aborted because the client went away.",
                                          registry=r)
        self.e2e_latency = Histogram(f"{p}e2e_request_latency_seconds",
                                     "End-to-end request latency.", buckets=E2E_BUCKETS,
                                     registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds",
                              "Time to first token (streaming requests).", buckets=TTFT_BUCKETS,
                              registry=r)

    def observe_finished(self, meta: dict[str, Any]) -> None:
        """Count one finished request from its ``meta_info``."""
        reason = meta.get("finish_reason") or {}
        self.finished.labels(str(reason.get("type", "unknown"))).inc()
        self.prompt_tokens.inc(int(meta.get("prompt_tokens") or 0))
        self.generation_tokens.inc(int(meta.get("completion_tokens") or 0))
        self.cached_tokens.inc(int(meta.get("cached_tokens") or 0))
        if meta.get("e2e_latency") is not None:
            self.e2e_latency.observe(float(meta["e2e_latency"]))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_disconnect(self) -> None:
        """Count one request aborted because its client went away."""
        self.client_disconnects.inc()

    def render(self, info: Optional[dict[str, Any]], alive: bool) -> str:
        """The exposition text; ``info`` is ``get_server_info`` (None when it is unavailable)."""
        with self._scrape_lock:
            self._scrape.families = list(_server_families(info, alive))
            try:
                return generate_latest(self.registry).decode()
            finally:
                self._scrape.families = []
