"""`ServerLoad`: one reading of a vLLM server's `/metrics`, summed over its engines.

Owns the Prometheus names vLLM exports and how several engines (data parallel) or API servers
combine: running and waiting requests and preemptions are summed, KV-cache usage is the maximum,
KV capacity (`kv_cache_size_tokens` of `vllm:cache_config_info`) is summed. Also the API server process's
start time (`process_start_time_seconds`, prometheus_client's process collector), which identifies the
process: a restarted server shows another one (`_pooled_server.py`). Does not know what the numbers are
used for (`_concurrency.py`). Parsing uses prometheus_client's text parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV_USAGE = "vllm:kv_cache_usage_perc"
_PREEMPTIONS = "vllm:num_preemptions"
_CACHE_INFO = "vllm:cache_config_info"
_STARTED = "process_start_time_seconds"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLoad:
    """What the server's engines reported at their last step (gauges freeze while the engine idles)."""

    running_requests: int
    """Requests in the running batches, summed over engines."""
    waiting_requests: int
    """Requests accepted but not yet scheduled, summed over engines."""
    kv_cache_usage: float
    """Fraction of KV-cache blocks in use, 0..1, the maximum over engines."""
    preemptions_total: int
    """Preemptions since the server started, summed over engines (a counter)."""
    kv_cache_tokens: int | None
    """Tokens the KV cache holds, summed over engines; None when the server does not export it."""
    started_at: float | None = None
    """When the API server process started (Unix seconds); None when not exported (several API servers)."""

    @classmethod
    def from_text(cls, text: str) -> ServerLoad | None:
        """Parse a `/metrics` body; None when it carries none of vLLM's engine gauges."""
        running = waiting = preemptions = 0.0
        kv_usage = 0.0
        kv_tokens: int | None = None
        started: float | None = None
        seen = False
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == _RUNNING:
                    running, seen = running + sample.value, True
                elif sample.name == _WAITING:
                    waiting += sample.value
                elif sample.name == _KV_USAGE:
                    kv_usage = max(kv_usage, sample.value)
                elif sample.name == f"{_PREEMPTIONS}_total":
                    preemptions += sample.value
                elif sample.name == _CACHE_INFO:
                    kv_tokens = (kv_tokens or 0) + _capacity_tokens(sample.labels)
                elif sample.name == _STARTED:
                    started = float(sample.value)
        if not seen:
            return None
        return cls(
            running_requests=int(running),
            waiting_requests=int(waiting),
            kv_cache_usage=float(kv_usage),
            preemptions_total=int(preemptions),
            kv_cache_tokens=kv_tokens,
            started_at=started,
        )


def _capacity_tokens(labels: dict[str, str]) -> int:
    """`kv_cache_size_tokens` (group-aware, right for hybrid models), else blocks x block size."""
    if labels.get("kv_cache_size_tokens", "None") not in ("None", ""):
        return int(float(labels["kv_cache_size_tokens"]))
    return int(float(labels.get("num_gpu_blocks", 0) or 0)) * int(float(labels.get("block_size", 0) or 0))
