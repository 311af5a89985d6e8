"""GET /metrics: Prometheus text under vLLM's metric names, with a `pagedchat:` prefix where vLLM has `vllm:`.

The engine's state (pages, requests, prefix cache, preemptions, swaps) is read from backend.memory() when
Prometheus scrapes, by a custom collector, so nothing is copied on the engine's hot path. What only the server
sees (tokens served, finished requests, latencies) is counted as each request ends.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedchat.engine.records import Outcome
from pagedchat.engine.kv_snapshot import MemorySnapshot

PREFIX = "pagedchat:"
LABELS = ["model_name"]
# vLLM's counter name -> the engine's counters that make it up.
_COUNTERS = {
    "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", ("prefix_queries",)),
    "prefix_cache_hits": ("Prompt tokens served from cached pages.", ("prefix_hits",)),
    "num_preemptions": ("Sequences preempted, by swapping or for recompute.", ("swap_outs", "recomputes")),
    "swap_outs": ("Sequences swapped out to the CPU tier.", ("swap_outs",)),
    "swap_ins": ("Sequences swapped back in from the CPU tier.", ("swap_ins",)),
    "evictions": ("Cached pages dropped from the page pool.", ("evictions",)),
    "cow_copies": ("Shared pages copied before a write (copy-on-write).", ("cow_copies",)),
}
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    """Gauges and counters read from one memory snapshot per scrape."""

    def __init__(self, model_name: str, memory: Callable[[], MemorySnapshot | None]):
        self.model_name = model_name
        self.memory = memory

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        snap = self.memory()
        if snap is None:  # still loading
            return
        states = [s.status for s in snap.seqs.values()]
        yield self._gauge("num_requests_running", "Requests holding pages and stepping.", states.count("running"))
        yield self._gauge("num_requests_waiting", "Requests waiting to be admitted.", states.count("waiting"))
        yield self._gauge("num_requests_swapped", "Requests swapped out to the CPU tier.", states.count("swapped"))
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage; 1 means every page is in use.",
                          snap.used_pages / snap.num_pages if snap.num_pages else 0.0)
        yield self._gauge("kv_cache_pages", "Pages in the KV-cache pool.", snap.num_pages)
        yield self._gauge("kv_cache_free_pages", "Pages a new request can take (empty or cached).", snap.free_pages)
        yield self._gauge("kv_cache_cached_pages", "Free pages still holding reusable prefix content.",
                          snap.cached_pages)
        yield self._gauge("cpu_cache_usage_perc", "CPU-tier usage; 1 means every CPU page is in use.",
                          snap.cpu_used / snap.cpu_total if snap.cpu_total else 0.0)
        info = GaugeMetricFamily(PREFIX + "cache_config_info", "The KV cache's configuration.",
                                 labels=LABELS + ["block_size", "num_gpu_blocks", "num_cpu_blocks", "page_bytes"])
        info.add_metric([self.model_name, str(snap.block_size), str(snap.num_pages), str(snap.cpu_total),
                         str(snap.page_bytes)], 1)
        yield info
        for name, (doc, parts) in _COUNTERS.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric([self.model_name], sum(getattr(snap.counters, p) for p in parts))
            yield family


class ServeMetrics:
    """The server's registry (its own, so that several servers in one process do not clash)."""

    def __init__(self, model_name: str, memory: Callable[[], MemorySnapshot | None]):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, memory))
        reg = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", LABELS,
                                     registry=reg)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", LABELS, registry=reg)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       LABELS + ["finished_reason"], registry=reg)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to the first token.", LABELS,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Time from request to its last token.",
                             LABELS, buckets=_LATENCY_BUCKETS, registry=reg)

    def observe(self, outcome: Outcome, prompt_tokens: int, seconds: float) -> None:
        labels = [self.model_name]
        self.prompt_tokens.labels(*labels).inc(prompt_tokens)
        self.generation_tokens.labels(*labels).inc(outcome.generated_tokens)
        self.request_success.labels(*labels, outcome.finish_reason or "unknown").inc()
        if outcome.time_to_first_token is not None:
            self.ttft.labels(*labels).observe(outcome.time_to_first_token)
        self.e2e.labels(*labels).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
