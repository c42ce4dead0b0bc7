"""`kiln bench serve`'s measurements: one request's timings, and the summary vLLM's `bench serve`
prints (TTFT, TPOT, ITL, E2EL statistics, throughput, goodput), with the same definitions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), q in [0, 100]."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _label(q: float) -> str:
    return f"p{q:g}"


def _stats(values: list[float], percentiles=(99.0,), scale: float = 1000.0) -> dict[str, float]:
    out = {
        "mean": scale * sum(values) / len(values) if values else 0.0,
        "median": scale * percentile(values, 50),
        "std": scale * _std(values),
    }
    for q in percentiles:
        out[_label(q)] = scale * percentile(values, q)
    return out


def _std(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def meets_slos(r: RequestResult, slos: dict[str, float]) -> bool:
    """Goodput: every SLO (milliseconds) met; TPOT of a one-token request counts as met."""
    values = {"ttft": r.ttft, "e2el": r.latency, "tpot": _tpot(r)}
    return all(values[k] is None or 1000.0 * values[k] <= limit for k, limit in slos.items())


def summarize(
    results: list[RequestResult], duration: float, percentiles=(99.0,), goodput: dict[str, float] | None = None
) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpot = [t for r in done if (t := _tpot(r)) is not None]
    itl = [g for r in done for g in r.itl]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_second = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    summary = {
        "duration_s": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_second(len(done)),
        "output_throughput": per_second(out_tokens),
        "total_token_throughput": per_second(in_tokens + out_tokens),
        "ttft_ms": _stats([r.ttft for r in done], percentiles),
        "tpot_ms": _stats(tpot, percentiles),
        "itl_ms": _stats(itl, percentiles),
        "e2el_ms": _stats([r.latency for r in done], percentiles),
    }
    if goodput:
        good = sum(meets_slos(r, goodput) for r in done)
        summary.update(goodput_slos_ms=goodput, good_requests=good, request_goodput=per_second(good))
    return summary


def format_summary(s: dict[str, Any], metrics=("ttft", "tpot", "itl", "e2el"), percentiles=(99.0,)) -> str:
    lines = [
        "============ Serving Benchmark Result ============",
        f"{'Successful requests:':<40}{s['completed']:>10}",
        f"{'Failed requests:':<40}{s['failed']:>10}",
        f"{'Benchmark duration (s):':<40}{s['duration_s']:>10.2f}",
        f"{'Total input tokens:':<40}{s['total_input_tokens']:>10}",
        f"{'Total generated tokens:':<40}{s['total_output_tokens']:>10}",
        f"{'Request throughput (req/s):':<40}{s['request_throughput']:>10.2f}",
    ]
    if "request_goodput" in s:
        lines.append(f"{'Request goodput (req/s):':<40}{s['request_goodput']:>10.2f}")
    lines += [
        f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:>10.2f}",
        f"{'Total token throughput (tok/s):':<40}{s['total_token_throughput']:>10.2f}",
    ]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key in metrics:
        short = key.upper()
        stats = s[f"{key}_ms"]
        lines.append(f"{titles[key]:-^50}")
        lines.append(f"{f'Mean {short} (ms):':<40}{stats['mean']:>10.2f}")
        lines.append(f"{f'Median {short} (ms):':<40}{stats['median']:>10.2f}")
        for q in percentiles:
            lines.append(f"{f'P{q:g} {short} (ms):':<40}{stats[_label(q)]:>10.2f}")
    if s["errors"]:
        lines.append(f"errors: {s['errors']}")
    lines.append("=" * 50)
    return "\n".join(lines)


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput {item!r}: expected ttft:MS, tpot:MS or e2el:MS")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: must not be negative")
    return slos
