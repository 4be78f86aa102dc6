"""/metrics of `simrun serve`: Prometheus text with vLLM's metric names and bucket bounds."""

import bisect
import math
import threading
from typing import Optional

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so dashboards built for vLLM read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        return out + [f"{name}_sum{{{labels}}} {self.sum!r}", f"{name}_count{{{labels}}} {cumulative}"]


def _label_value(text: str) -> str:
    """A Prometheus label value: backslash, double quote and newline escaped (the model name comes
    from a user's file and must not break, or add lines to, /metrics)."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ServerMetrics:
    """What /metrics shows. Written by the engine thread, rendered on the event loop: one lock."""

    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": ("Time to first token, from arrival.", TTFT_BUCKETS),
        "vllm:request_time_per_output_token_seconds": ("Decode time per output token after the first.",
                                                       TOKEN_BUCKETS),
        "vllm:inter_token_latency_seconds": ("Gaps between successive tokens of a request.", TOKEN_BUCKETS),
        "vllm:e2e_request_latency_seconds": ("Arrival to last token.", E2E_BUCKETS),
    }

    def __init__(self, model_name: str, block_size: int, num_blocks: int):
        self._lock = threading.Lock()
        self.labels = f'model_name="{_label_value(model_name)}"'
        self.cache_labels = f'block_size="{block_size}",num_gpu_blocks="{num_blocks}"'
        self.gauges = {"running": 0, "waiting": 0, "kv_usage": 0.0}
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0, "num_preemptions": 0,
                         "prompt_tokens": 0, "generation_tokens": 0}
        self.finished: dict[str, int] = {"length": 0, "stop": 0, "abort": 0}
        self.histograms = {name: Histogram(bounds) for name, (_, bounds) in self.HISTOGRAMS.items()}

    def set_state(self, scheduler) -> None:
        kv = scheduler.kv
        with self._lock:
            self.gauges.update(running=scheduler.num_running, waiting=scheduler.num_waiting, kv_usage=kv.usage)
            self.counters.update(prefix_cache_queries=kv.stats.queries, prefix_cache_hits=kv.stats.hits,
                                 num_preemptions=scheduler.num_preemptions)

    def observe_token(self, gap: Optional[float]) -> None:
        with self._lock:
            self.counters["generation_tokens"] += 1
            if gap is not None:
                self.histograms["vllm:inter_token_latency_seconds"].observe(gap)

    def count_prompt(self, tokens: int) -> None:
        with self._lock:
            self.counters["prompt_tokens"] += tokens

    def observe_end(self, live, reason: str) -> None:
        """A request ended (`live`: the engine loop's record of it, with its token times)."""
        with self._lock:
            self.finished[reason] += 1
            if reason == "abort" or math.isnan(live.first_token):
                return
            n = live.req.num_output
            h = self.histograms
            h["vllm:time_to_first_token_seconds"].observe(live.first_token - live.arrival)
            h["vllm:e2e_request_latency_seconds"].observe(live.last_token - live.arrival)
            if n > 1:
                h["vllm:request_time_per_output_token_seconds"].observe(
                    (live.last_token - live.first_token) / (n - 1))

    def render(self) -> str:
        with self._lock:
            return "\n".join(self._lines()) + "\n"

    def _lines(self) -> list[str]:
        lb = self.labels
        out = []
        for name, help_, value in (
                ("vllm:num_requests_running", "Requests in the running batch.", self.gauges["running"]),
                ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", self.gauges["waiting"]),
                ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full): referenced blocks / usable blocks.",
                 self.gauges["kv_usage"])):
            out += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{{{lb}}} {float(value)!r}"]
        out += ["# HELP vllm:cache_config_info KV cache configuration.", "# TYPE vllm:cache_config_info gauge",
                f"vllm:cache_config_info{{{self.cache_labels}}} 1.0"]
        for key, value in self.counters.items():
            out += [f"# TYPE vllm:{key} counter", f"vllm:{key}_total{{{lb}}} {float(value)!r}"]
        out.append("# TYPE vllm:request_success counter")
        out += [f'vllm:request_success_total{{{lb},finished_reason="{r}"}} {float(n)!r}'
                for r, n in self.finished.items()]
        for name, hist in self.histograms.items():
            out += [f"# HELP {name} {self.HISTOGRAMS[name][0]}", f"# TYPE {name} histogram", *hist.lines(name, lb)]
        return out
