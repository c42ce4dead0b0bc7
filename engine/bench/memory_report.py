"""What `kiln bench latency` reports about memory: the weights' bytes, the process's peak resident
memory (resettable on Linux), and the --load-only report of a built engine."""

from __future__ import annotations

from typing import Any

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all (unique) parameters, quantised layers' packed weights and scales included:
    what one decode step streams from memory."""
    from engine.models.loader.quant_loading import QUANT_BUFFERS

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        if getattr(module, "quant", None) is not None:
            total += sum(
                b.numel() * b.element_size() for n, b in module.named_buffers(recurse=False) if n in QUANT_BUFFERS
            )
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory since the last reset_peak_rss() (Linux: VmHWM), or
    since it started where the peak cannot be reset (getrusage)."""
    try:
        return _proc_status("VmHWM")
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (Linux reports kilobytes)


def reset_peak_rss() -> int:
    """Reset the peak resident memory to the current one (Linux) and return the current one: the
    growth measured from here is the load's own, not an earlier peak's (imports, a previous model)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except (OSError, StopIteration):
        return peak_rss_bytes()


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def memory_report(engine, name: str, rss_before: int, startup: float) -> dict[str, Any]:
    """Weights in memory against the same model in bf16, and how far resident memory grew while
    the engine was built (KV cache included; it is reported apart)."""
    wbytes = weight_bytes(engine.core.model)
    bf16 = engine.model_config.num_parameters() * 2
    kv = engine.core.kv_cache.tensor.numel() * engine.core.kv_cache.tensor.element_size()
    growth = peak_rss_bytes() - rss_before
    from engine.models.loader.quant_loading import QUANT_BUFFERS

    linears = [m for m in engine.core.model.quantizable_linears().values() if getattr(m, "quant", None) is not None]
    packed = sum(
        b.numel() * b.element_size() for m in linears for n, b in m.named_buffers(recurse=False) if n in QUANT_BUFFERS
    )
    dense = sum(m.in_features * m.out_features * 2 for m in linears)
    quant = engine.settings.quantization or (engine.model_config.quantization or {}).get("quant_method") or "none"
    row = {
        "model": name,
        "quantization": quant,
        "dtype": str(engine.core.dtype).removeprefix("torch."),
        "weight_GB": wbytes / 1e9,
        "bf16_weight_GB": bf16 / 1e9,
        "ratio_to_bf16": wbytes / bf16,
        "peak_rss_growth_GB": growth / 1e9,
        "peak_rss_over_weights": growth / wbytes,
        "kv_cache_GB": kv / 1e9,
        "startup_s": startup,
        "linear_ratio_to_bf16": packed / dense if dense else 1.0,
        "peak_rss_over_weights_without_kv": (growth - kv) / wbytes,
    }
    print(
        f"kiln bench latency --load-only: {name}, quantization {quant}, {row['dtype']}: weights "
        f"{row['weight_GB']:.3f} GB = {row['ratio_to_bf16']:.3f}x the bf16 model ({row['bf16_weight_GB']:.3f} GB; "
        f"linear layers alone {row['linear_ratio_to_bf16']:.3f}x); "
        f"peak RSS grew {row['peak_rss_growth_GB']:.3f} GB while loading = {row['peak_rss_over_weights']:.2f}x "
        f"the weights ({row['peak_rss_over_weights_without_kv']:.2f}x without the {kv / 1e9:.3f} GB KV cache); "
        f"start-up {startup:.1f}s"
    )
    return row
