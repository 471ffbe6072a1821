"""Prometheus metrics for the HTTP server, written in the text exposition format by hand.

Request counters and latency histograms live here, in the frontend, updated by the event loop
that serves the requests (no locks needed); scheduler gauges (running / waiting requests, KV
usage, prefix cache hit rate) are read from ``get_server_info`` at scrape time.
"""

from __future__ import annotations

import bisect
from collections import Counter
from typing import Any, Optional

PREFIX = "rollout_engine_"
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _fmt(v: float) -> str:
    if isinstance(v, (bool, int)):
        return str(int(v))
    return "+Inf" if v == float("inf") else repr(float(v))


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _spec_metrics(metric: Any, stats: dict[str, Any]) -> None:
    """Speculative decoding counters (present only when the engine speculates)."""
    if "spec_verify_steps" not in stats:
        return
    rows = int(stats.get("spec_verify_rows") or 0)
    for name, help_text in (
            ("spec_verify_steps", "Decode forwards run with speculation on."),
            ("spec_draft_tokens", "Proposed (draft) tokens verified."),
            ("spec_accepted_tokens", "Proposed tokens the target accepted."),
            ("spec_off_steps", "Decode forwards of batches that switched speculation off "
                               "(too many requests, or a grammar request)."),
            ("spec_off_low_accept_rows", "Request decode steps without proposals because the "
                                         "request's acceptance was low."),
            ("spec_off_low_accept_steps", "Decode forwards whose every request was switched "
                                          "off for low acceptance.")):
        metric(f"{name}_total", "counter", help_text, int(stats.get(name) or 0))
    metric("spec_accept_length", "gauge",
           "Mean tokens per request per verify forward (accepted proposals + 1).",
           (int(stats.get("spec_accepted_tokens") or 0) / rows + 1) if rows else 0.0)


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


def _hicache_metrics(metric: Any, tiers: Optional[dict[str, Any]]) -> None:
    """Hierarchical cache counters (present only with enable_hierarchical_cache)."""
    if not tiers:
        return
    for name, help_text in _HICACHE_COUNTERS:
        if name in tiers:
            metric(f"hicache_{name}_total", "counter", help_text, tiers[name])
    metric("hicache_host_cached_tokens", "gauge", "KV tokens held by the host tier.",
           tiers.get("host_cached_tokens", 0))
    metric("hicache_host_total_tokens", "gauge", "Host tier capacity in tokens.",
           tiers.get("host_total_tokens", 0))


class Histogram:
    """Cumulative-bucket histogram (``_bucket{le=...}``, ``_sum``, ``_count``)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # last slot: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            lines.append(f'{name}_bucket{{le="{_fmt(bound)}"}} {running}')
        lines += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return lines


class Metrics:
    """Counters kept by the HTTP frontend."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.finished: Counter[str] = Counter()      # by finish reason type
        self.client_disconnects = 0
        self.e2e_latency = Histogram(E2E_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)

    def observe_finished(self, meta: dict[str, Any]) -> None:
        """Count one finished request from its ``meta_info``."""
        reason = meta.get("finish_reason") or {}
        self.finished[str(reason.get("type", "unknown"))] += 1
        self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
        self.generation_tokens += int(meta.get("completion_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)
        if meta.get("e2e_latency") is not None:
            self.e2e_latency.observe(float(meta["e2e_latency"]))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def render(self, info: Optional[dict[str, Any]], alive: bool) -> str:
        """The exposition text; ``info`` is ``get_server_info`` (None when it is unavailable)."""
        p = PREFIX
        out: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float,
                   labels: str = "") -> None:
            out.extend([f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}",
                        f"{p}{name}{labels} {_fmt(value)}"])

        metric("scheduler_alive", "gauge", "1 while the scheduler process is alive.", int(alive))
        if info is not None:
            total = max(int(info.get("max_total_num_tokens") or 0), 1)
            free = int(info.get("kv_free_tokens") or 0)
            stats = info.get("stats") or {}
            prompt = int(stats.get("prompt_tokens") or 0)
            metric("num_running_reqs", "gauge", "Requests in the running batch.",
                   info.get("num_running_reqs", 0))
            metric("num_waiting_reqs", "gauge", "Requests waiting for admission.",
                   info.get("num_waiting_reqs", 0))
            metric("kv_total_tokens", "gauge", "KV cache capacity in tokens.", total)
            metric("kv_cached_tokens", "gauge", "KV tokens held by the radix (prefix) cache.",
                   info.get("kv_cached_tokens", 0))
            metric("kv_usage_ratio", "gauge",
                   "Fraction of KV slots not free (running requests + prefix cache).",
                   (total - free) / total)
            metric("cache_hit_rate", "gauge",
                   "Prompt tokens served from the prefix cache / prompt tokens admitted.",
                   (int(stats.get("cached_tokens") or 0) / prompt) if prompt else 0.0)
            metric("num_retractions_total", "counter", "Requests retracted for lack of KV.",
                   stats.get("num_retractions", 0))
            metric("forward_passes_total", "counter", "Model forward passes.",
                   stats.get("forward_passes", 0))
            _spec_metrics(metric, stats)
            _hicache_metrics(metric, info.get("hicache"))
            metric("weight_version_info", "gauge", "The serving weight version (as a label).", 1,
                   f'{{version="{_label(str(info.get("weight_version")))}"}}')
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
               self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Generated tokens of finished requests.",
               self.generation_tokens)
        metric("cached_prompt_tokens_total", "counter",
               "Prompt tokens of finished requests served from the prefix cache.",
               self.cached_tokens)
        out += [f"# HELP {p}requests_total Finished requests by finish reason.",
                f"# TYPE {p}requests_total counter"]
        for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
            out.append(f'{p}requests_total{{finish_reason="{_label(reason)}"}} '
                       f"{self.finished[reason]}")
        metric("client_disconnects_total", "counter",
               "Requests aborted because the client went away.", self.client_disconnects)
        out += self.e2e_latency.render(f"{p}e2e_request_latency_seconds",
                                       "End-to-end request latency.")
        out += self.ttft.render(f"{p}time_to_first_token_seconds",
                                "Time to first token (streaming requests).")
        return "\n".join(out) + "\n"
