"""Server-wide KV-cache figures read from a Prometheus /metrics page in vLLM's names.

vLLM tells no client which pages hold its requests, only totals: KV-cache usage, the page count and size (the
labels of `vllm:cache_config_info`), prefix-cache queries and hits (counted in tokens), requests running and
waiting, preemptions. Older vLLM releases spelled two of them `gpu_cache_usage_perc` and `gpu_prefix_cache_*`;
both spellings are read. With several engines (data parallel) counts are summed and usage averaged.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIXES = ("vllm", "pagedchat")   # vLLM's own names, and the same names under pagedchat serve's prefix


@dataclass(frozen=True)
class ServerMetrics:
    source: str                      # the metric prefix read: "vllm" or "pagedchat"
    kv_usage: float | None = None    # fraction of the KV cache in use, 0..1
    num_pages: int | None = None     # vLLM's num_gpu_blocks
    block_size: int | None = None    # tokens per page
    running: int | None = None
    waiting: int | None = None
    prefix_queries: float = 0.0      # tokens looked up in the prefix cache, since the server started
    prefix_hits: float = 0.0         # of those, tokens found
    preemptions: int | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def used_pages(self) -> int | None:
        if self.kv_usage is None or self.num_pages is None:
            return None
        return round(self.kv_usage * self.num_pages)


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _total(samples: dict, *names: str) -> float | None:
    for name in names:
        if name in samples:
            return sum(value for _, value in samples[name])
    return None


def _mean(samples: dict, *names: str) -> float | None:
    for name in names:
        if name in samples:
            values = [value for _, value in samples[name]]
            return sum(values) / len(values)
    return None


def _label_total(samples: dict, name: str, label: str) -> int | None:
    """Sum of an integer label over a metric's samples (one per engine); None when any is absent or "None"."""
    values = [labels.get(label, "") for labels, _ in samples.get(name, [])]
    if not values or not all(v.isdigit() for v in values):
        return None
    return sum(int(v) for v in values)


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def parse_metrics(text: str) -> ServerMetrics | None:
    """The KV-cache figures in a /metrics page; None when it has none under a known prefix.

    Raises ValueError on text that is not Prometheus exposition format."""
    samples = _samples(text)
    for prefix in PREFIXES:
        p = prefix + ":"
        if not any(name.startswith(p) for name in samples):
            continue
        config = p + "cache_config_info"
        block_sizes = {labels.get("block_size") for labels, _ in samples.get(config, [])}
        block = next(iter(block_sizes)) if len(block_sizes) == 1 else None
        return ServerMetrics(
            source=prefix,
            kv_usage=_mean(samples, p + "kv_cache_usage_perc", p + "gpu_cache_usage_perc"),
            num_pages=_label_total(samples, config, "num_gpu_blocks"),
            block_size=int(block) if block and block.isdigit() else None,
            running=_int(_total(samples, p + "num_requests_running")),
            waiting=_int(_total(samples, p + "num_requests_waiting")),
            prefix_queries=_total(samples, p + "prefix_cache_queries_total",
                                  p + "gpu_prefix_cache_queries_total") or 0.0,
            prefix_hits=_total(samples, p + "prefix_cache_hits_total", p + "gpu_prefix_cache_hits_total") or 0.0,
            preemptions=_int(_total(samples, p + "num_preemptions_total")),
        )
    return None
