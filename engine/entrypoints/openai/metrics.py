"""Prometheus metrics (`kiln:*`, labelled by model_name) and the periodic stats log line.

Names follow vLLM's so dashboards port. Every app gets its own CollectorRegistry. The
`EngineMetrics.on_step` hook runs on the engine's step thread (prometheus-client is
thread-safe); `/metrics` only renders the registry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.core.outputs import RequestOutput
from engine.entrypoints.openai.kv_tier_metrics import KVTierMetrics

logger = logging.getLogger("engine.entrypoints.openai.stats")

_CACHE_INFO_LABELS = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "swap_space",
    "num_cpu_blocks",
)
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class _Track:
    last_time: float  # when the request last produced tokens
    generated: dict[int, int] = field(default_factory=dict)  # sample index -> tokens so far


def _token_buckets(limit: int = 1 << 17) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out, base = [], 1
    while base <= limit:
        out += [b for b in (base, 2 * base, 5 * base) if b <= limit]
        base *= 10
    return tuple(out)


_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_REQUEST_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class EngineMetrics:
    """All of the server's metrics, in one registry; also the engine's StepListener."""

    def __init__(
        self, model_name: str, log_stats_interval: float = 10.0, registry: CollectorRegistry | None = None
    ) -> None:
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
        # vLLM's older name for the same figure, which its example dashboard still queries.
        self.gpu_usage = gauge("gpu_cache_usage_perc", "Fraction of KV blocks in use (1 = full; kv_cache_usage_perc)")
        self.cpu_usage = gauge("cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (1 = full)")
        self.fragmentation = gauge(
            "kv_cache_fragmentation_ratio", "Allocated KV slots not holding a computed token / allocated slots"
        )
        self.blocks_in_use = gauge("num_kv_blocks_in_use", "KV blocks referenced by requests")
        self.blocks_total = gauge("num_kv_blocks_total", "Usable KV blocks")
        self._preemptions = Counter(
            "kiln:num_preemptions", "Preemptions by mode (swap or recompute)", ["model_name", "mode"], registry=r
        )
        for mode in ("swap", "recompute"):
            self._preemptions.labels(model_name, mode)
        self.swap_bytes_out = counter("swap_out_bytes", "KV bytes copied from the GPU to CPU swap space")
        self.swap_bytes_in = counter("swap_in_bytes", "KV bytes copied back from CPU swap space")
        self.weight_copy_bytes = gauge(
            "weight_copy_bytes", "Bytes of second weight copies kept in memory (CPU: oneDNN's packed GEMM copies)"
        )
        self.pinned_blocks = gauge("num_pinned_prefix_blocks", "KV blocks pinned by prefix warm-up")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed (prefill)")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.spec_drafts = counter("spec_decode_num_draft_tokens", "Speculative draft tokens proposed")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted")
        self._success = Counter(
            "kiln:request_success", "Finished requests by finish reason", ["model_name", "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort", "error"):
            self._success.labels(model_name, reason)
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Gap between successive tokens of a request", _ITL_BUCKETS)
        # vLLM's older name for the same observations, which its example dashboard still queries.
        self.tpot = histogram(
            "time_per_output_token_seconds",
            "Gap between successive tokens of a request (inter_token_latency_seconds)",
            _ITL_BUCKETS,
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", _E2E_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled", _LATENCY_BUCKETS)
        # vLLM's per-step and per-request histograms, and its info gauges.
        tokens = _token_buckets()
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens (prompt + generated) per engine step", _ITERATION_BUCKETS
        )
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request (all samples)", tokens
        )
        self.request_max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Most tokens generated by one sample of a finished request", tokens
        )
        self.request_params_n = histogram("request_params_n", "The n parameter of finished requests", (1, 2, 5, 10, 20))
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens parameter of finished requests", tokens
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token", _REQUEST_TIME_BUCKETS
        )
        self.decode_time = histogram("request_decode_time_seconds", "First token to finish", _REQUEST_TIME_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to finish", _REQUEST_TIME_BUCKETS
        )
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative drafts proposed (sequence-steps)")
        self._spec_per_pos = Counter(
            "kiln:spec_decode_num_accepted_tokens_per_pos",
            "Speculative draft tokens accepted at each draft position (0: the first)",
            ["model_name", "position"],
            registry=r,
        )
        self._cache_info = Gauge(
            "kiln:cache_config_info",
            "KV cache configuration (value 1; labels)",
            ["model_name", *_CACHE_INFO_LABELS],
            registry=r,
        )
        self._lora_info = Gauge(
            "kiln:lora_requests_info",
            "LoRA adapters of running and waiting requests (value: time of the last change)",
            ["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=r,
        )
        self._cache_info_set = False
        self._lora_state: tuple[str, str, str] | None = None
        # Step-thread state.
        self._tracks: dict[str, _Track] = {}
        self._prev = {
            "prompt": 0,
            "gen": 0,
            "pq": 0,
            "ph": 0,
            "swap_out": 0,
            "swap_in": 0,
            "preempt:swap": 0,
            "preempt:recompute": 0,
        }
        self._log_prev = {"t": time.monotonic(), "prompt": 0, "gen": 0, "pq": 0, "ph": 0}
        self.kv_tiers = KVTierMetrics(r, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def set_engine_info(self, engine) -> None:
        """kiln:cache_config_info from the engine's settings and sizing (once)."""
        s = engine.settings
        swap = engine.core.swap_space
        values = {
            "block_size": s.block_size,
            "cache_dtype": s.kv_cache_dtype,
            "enable_prefix_caching": s.enable_prefix_caching,
            "gpu_memory_utilization": s.gpu_memory_utilization,
            "num_gpu_blocks": engine.core.pool.num_usable,
            "num_gpu_blocks_override": s.num_gpu_blocks,
            "swap_space": s.swap_space_gb,
            "num_cpu_blocks": getattr(swap, "num_blocks", 0) if swap is not None else 0,
        }
        self._cache_info.labels(self.model_name, *(str(values[k]) for k in _CACHE_INFO_LABELS)).set(1)
        self.weight_copy_bytes.set(engine.weight_copy_bytes())
        self._cache_info_set = True

    def _set_lora_info(self, engine, now: float) -> None:
        sched = engine.core.scheduler

        def names(seqs) -> str:
            found = {s.request.lora_request.lora_name for s in seqs if s.request.lora_request is not None}
            return ",".join(sorted(found))

        max_lora = str(engine.settings.max_loras if engine.settings.enable_lora else 0)
        state = (names(sched.running), names(sched.waiting), max_lora)
        if state != self._lora_state:
            self._lora_info.clear()
            self._lora_info.labels(self.model_name, *state).set(now)
            self._lora_state = state

    # ---- StepListener ----
    def on_step(self, engine, outputs: list[RequestOutput], now: float) -> None:
        sched, pool = engine.core.scheduler, engine.core.pool
        if not self._cache_info_set:
            self.set_engine_info(engine)
        self._set_lora_info(engine, now)
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.swapped.set(sched.num_requests_swapped)
        self.pinned_blocks.set(pool.num_pinned)
        self.kv_usage.set(pool.usage())
        self.gpu_usage.set(pool.usage())
        self.blocks_in_use.set(pool.num_in_use)
        self.blocks_total.set(pool.num_usable)
        swap = engine.core.swap_space
        usage = getattr(swap, "usage", None)
        self.cpu_usage.set(usage() if callable(usage) else 0.0)
        frag = getattr(sched, "fragmentation", None)
        self.fragmentation.set(frag() if callable(frag) else 0.0)

        counters = pool.counters
        swapper = engine.core.block_swapper
        totals = {
            "prompt": engine.core.num_prompt_tokens_total,
            "gen": engine.core.num_generation_tokens_total,
            "pq": counters.prefix_queries,
            "ph": counters.prefix_hits,
            "swap_out": swapper.bytes_out if swapper is not None else 0,
            "swap_in": swapper.bytes_in if swapper is not None else 0,
            "drafts": sched.num_draft_tokens,
            "accepted": sched.num_accepted_tokens,
            "num_drafts": getattr(sched, "num_drafts", 0),
        }
        for mode, count in sched.preemptions_by_mode.items():
            totals[f"preempt:{mode}"] = count
        per_pos = sched.spec.num_accepted_per_pos if getattr(sched, "spec", None) is not None else []
        for i, count in enumerate(per_pos):
            totals[f"pos:{i}"] = count
        tracked = [
            ("prompt", self.prompt_tokens),
            ("gen", self.generation_tokens),
            ("pq", self.prefix_queries),
            ("ph", self.prefix_hits),
            ("swap_out", self.swap_bytes_out),
            ("swap_in", self.swap_bytes_in),
            ("drafts", self.spec_drafts),
            ("accepted", self.spec_accepted),
            ("num_drafts", self.spec_num_drafts),
        ]
        tracked += [
            (f"preempt:{mode}", self._preemptions.labels(self.model_name, mode)) for mode in sched.preemptions_by_mode
        ]
        tracked += [(f"pos:{i}", self._spec_per_pos.labels(self.model_name, str(i))) for i in range(len(per_pos))]
        for key, metric in tracked:
            delta = totals[key] - self._prev.get(key, 0)
            if delta > 0:
                metric.inc(delta)
        step_tokens = totals["prompt"] + totals["gen"] - self._prev.get("prompt", 0) - self._prev.get("gen", 0)
        if step_tokens > 0:
            self.iteration_tokens.observe(step_tokens)
        self._prev = totals

        self.kv_tiers.update(engine.core.kv_tiers)
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
            track = _Track(now)
            if not out.finished:
                self._tracks[out.request_id] = track
        elif num_tokens > 0:
            self.itl.observe(now - track.last_time)
            self.tpot.observe(now - track.last_time)
            track.last_time = now
        for choice in out.outputs:
            track.generated[choice.index] = track.generated.get(choice.index, 0) + len(choice.token_ids)
        if out.finished:
            self._tracks.pop(out.request_id, None)
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None)
            if reason is None:  # an embedding finishes without choices; a failed request with its error
                reason = "error" if out.error else "stop" if out.embedding is not None else "abort"
            self._success.labels(self.model_name, reason).inc()
            if m.get("arrival_time") is not None:
                self.e2e.observe(max(now - m["arrival_time"], 0.0))
            self._observe_finished(out, track, now)

    def _observe_finished(self, out: RequestOutput, track: _Track, now: float) -> None:
        """vLLM's per-request histograms, observed once when the request finishes."""
        m = out.metrics
        self.request_prompt_tokens.observe(len(out.prompt_token_ids))
        self.request_generation_tokens.observe(sum(track.generated.values()))
        self.request_max_generation_tokens.observe(max(track.generated.values(), default=0))
        if m.get("n") is not None:
            self.request_params_n.observe(m["n"])
        if m.get("max_tokens") is not None:
            self.request_params_max_tokens.observe(m["max_tokens"])
        finished = m.get("finished_time") or now
        scheduled, first = m.get("first_scheduled_time"), m.get("first_token_time")
        if scheduled is not None and first is not None:
            self.prefill_time.observe(max(first - scheduled, 0.0))
        if first is not None:
            self.decode_time.observe(max(finished - first, 0.0))
        if scheduled is not None:
            self.inference_time.observe(max(finished - scheduled, 0.0))

    def _log(self, engine, totals: dict[str, int], now: float) -> None:
        prev = self._log_prev
        sched = engine.core.scheduler
        if (
            not engine.core.has_unfinished_requests()
            and totals["gen"] == prev["gen"]
            and totals["prompt"] == prev["prompt"]
        ):
            prev["t"] = now  # idle since the last line: nothing to say
            return
        dt = max(now - prev["t"], 1e-9)
        queries = totals["pq"] - prev["pq"]
        hits = totals["ph"] - prev["ph"]
        logger.info(
            "running: %d, waiting: %d, swapped: %d, KV usage: %.1f%%, prompt: %.1f tok/s, generation: %.1f tok/s, "
            "prefix hit rate: %.1f%%%s",
            len(sched.running),
            len(sched.waiting),
            sched.num_requests_swapped,
            100 * engine.core.pool.usage(),
            (totals["prompt"] - prev["prompt"]) / dt,
            (totals["gen"] - prev["gen"]) / dt,
            100 * hits / queries if queries else 0.0,
            spec_summary(totals, prev),
        )
        self._log_prev = {"t": now, **totals}


def spec_summary(totals: dict[str, int], prev: dict[str, int]) -> str:
    """Speculative decoding since the last stats line, as vLLM logs it: the mean acceptance length
    (tokens per verify step: 1 + accepted drafts / verify steps), the draft acceptance rate and
    each position's ("" without drafts)."""
    steps = totals.get("num_drafts", 0) - prev.get("num_drafts", 0)
    if steps <= 0:
        return ""
    drafted = totals["drafts"] - prev.get("drafts", 0)
    accepted = totals["accepted"] - prev.get("accepted", 0)
    per_pos = []
    i = 0
    while f"pos:{i}" in totals:
        per_pos.append((totals[f"pos:{i}"] - prev.get(f"pos:{i}", 0)) / steps)
        i += 1
    return (
        f", spec decode: mean acceptance length {1 + accepted / steps:.2f}, accepted {accepted} of {drafted} "
        f"drafts ({100 * accepted / max(drafted, 1):.1f}%), per position " + ", ".join(f"{r:.2f}" for r in per_pos)
    )
