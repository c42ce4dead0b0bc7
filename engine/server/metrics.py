"""Prometheus metrics (`kiln:*`, labelled by model_name) and the periodic stats log line.

Names follow vLLM's so dashboards port. Every app gets its own CollectorRegistry. The
`EngineMetrics.on_step` hook runs on the engine's step thread (prometheus-client is
thread-safe); `/metrics` only renders the registry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.request import RequestOutput

logger = logging.getLogger("engine.server.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Track:
    last_time: float  # when the request last produced tokens


class EngineMetrics:
    """All of the server's metrics, in one registry; also the engine's StepListener."""

    def __init__(self, model_name: str, log_stats_interval: float = 10.0,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.log_stats_interval = log_stats_interval
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kiln:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kiln:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"kiln:{name}", doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Sequences running on the model")
        self.waiting = gauge("num_requests_waiting", "Sequences waiting to be scheduled")
        self.swapped = gauge("num_requests_swapped", "Sequences swapped out to CPU memory")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)")
        self.cpu_usage = gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = full)")
        self.fragmentation = gauge("kv_cache_fragmentation_ratio",
                                   "Allocated KV slots not holding a computed token / allocated slots")
        self.blocks_in_use = gauge("num_kv_blocks_in_use", "KV blocks referenced by requests")
        self.blocks_total = gauge("num_kv_blocks_total", "Usable KV blocks")
        self._preemptions = Counter("kiln:num_preemptions", "Preemptions by mode (swap or recompute)",
                                    ["model_name", "mode"], registry=r)
        for mode in ("swap", "recompute"):
            self._preemptions.labels(model_name, mode)
        self.swap_bytes_out = counter("swap_out_bytes", "KV bytes copied from the GPU to CPU swap space")
        self.swap_bytes_in = counter("swap_in_bytes", "KV bytes copied back from CPU swap space")
        self.pinned_blocks = gauge("num_pinned_prefix_blocks", "KV blocks pinned by prefix warm-up")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.spec_drafts = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self._success = Counter("kiln:request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive tokens of a request",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled",
                                    _LATENCY_BUCKETS)
        # Step-thread state.
        self._tracks: dict[str, _Track] = {}
        self._prev = {"prompt": 0, "gen": 0, "pq": 0, "ph": 0, "swap_out": 0, "swap_in": 0,
                      "preempt:swap": 0, "preempt:recompute": 0}
        self._log_prev = {"t": time.monotonic(), "prompt": 0, "gen": 0, "pq": 0, "ph": 0}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- StepListener ----
    def on_step(self, engine, outputs: list[RequestOutput], now: float) -> None:
        sched, pool = engine.scheduler, engine.pool
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.swapped.set(sched.num_requests_swapped)
        self.pinned_blocks.set(pool.num_pinned)
        self.kv_usage.set(pool.usage())
        self.blocks_in_use.set(pool.num_in_use)
        self.blocks_total.set(pool.num_usable)
        swap = getattr(engine, "swap_space", None)
        usage = getattr(swap, "usage", None)
        self.cpu_usage.set(usage() if callable(usage) else 0.0)
        frag = getattr(sched, "fragmentation", None)
        self.fragmentation.set(frag() if callable(frag) else 0.0)

        counters = pool.counters
        swapper = engine.block_swapper
        totals = {"prompt": engine.num_prompt_tokens_total,
                  "gen": engine.num_generation_tokens_total, "pq": counters.prefix_queries,
                  "ph": counters.prefix_hits,
                  "swap_out": swapper.bytes_out if swapper is not None else 0,
                  "swap_in": swapper.bytes_in if swapper is not None else 0,
                  "drafts": sched.num_draft_tokens, "accepted": sched.num_accepted_tokens}
        for mode, count in sched.preemptions_by_mode.items():
            totals[f"preempt:{mode}"] = count
        tracked = [("prompt", self.prompt_tokens), ("gen", self.generation_tokens), ("pq", self.prefix_queries),
                   ("ph", self.prefix_hits), ("swap_out", self.swap_bytes_out), ("swap_in", self.swap_bytes_in),
                   ("drafts", self.spec_drafts), ("accepted", self.spec_accepted)]
        tracked += [(f"preempt:{mode}", self._preemptions.labels(self.model_name, mode))
                    for mode in sched.preemptions_by_mode]
        for key, metric in tracked:
            delta = totals[key] - self._prev.get(key, 0)
            if delta > 0:
                metric.inc(delta)
        self._prev = totals

        for out in outputs:
            self._observe_request(out, now)
        if self.log_stats_interval > 0 and now - self._log_prev["t"] >= self.log_stats_interval:
            self._log(engine, totals, now)

    def on_engine_stopped(self) -> None:
        """The engine loop has ended (shut down or died): nothing runs, waits or is swapped."""
        for gauge in (self.running, self.waiting, self.swapped, self.kv_usage, self.blocks_in_use):
            gauge.set(0)
        self._tracks.clear()

    def _observe_request(self, out: RequestOutput, now: float) -> None:
        """out: a delta (the async engine's requests use output_kind "delta")."""
        m = out.metrics
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        track = self._tracks.get(out.request_id)
        if track is None:
            if num_tokens and m.get("first_token_time") is not None and m.get("arrival_time") is not None:
                self.ttft.observe(max(m["first_token_time"] - m["arrival_time"], 0.0))
            if m.get("first_scheduled_time") is not None and m.get("arrival_time") is not None:
                self.queue_time.observe(max(m["first_scheduled_time"] - m["arrival_time"], 0.0))
            if not out.finished:
                self._tracks[out.request_id] = _Track(now)
        elif num_tokens > 0:
            self.itl.observe(now - track.last_time)
            track.last_time = now
        if out.finished:
            self._tracks.pop(out.request_id, None)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
            if reason is None:  # an embedding finishes without choices; a failed request with its error
                reason = "error" if out.error else "stop" if out.embedding is not None else "abort"
            self._success.labels(self.model_name, reason).inc()
            if m.get("arrival_time") is not None:
                self.e2e.observe(max(now - m["arrival_time"], 0.0))

    def _log(self, engine, totals: dict[str, int], now: float) -> None:
        prev = self._log_prev
        sched = engine.scheduler
        if not engine.has_unfinished_requests() and totals["gen"] == prev["gen"] and totals["prompt"] == prev["prompt"]:
            prev["t"] = now  # idle since the last line: nothing to say
            return
        dt = max(now - prev["t"], 1e-9)
        queries = totals["pq"] - prev["pq"]
        hits = totals["ph"] - prev["ph"]
        logger.info(
            "running: %d, waiting: %d, swapped: %d, KV usage: %.1f%%, prompt: %.1f tok/s, generation: %.1f tok/s, "
            "prefix hit rate: %.1f%%", len(sched.running), len(sched.waiting),
            sched.num_requests_swapped, 100 * engine.pool.usage(),
            (totals["prompt"] - prev["prompt"]) / dt, (totals["gen"] - prev["gen"]) / dt,
            100 * hits / queries if queries else 0.0)
        self._log_prev = {"t": now, "prompt": totals["prompt"], "gen": totals["gen"], "pq": totals["pq"],
                          "ph": totals["ph"]}
