"""Tensor-parallel model shards on the CPU: per-step forward time of tp=N (gloo, N processes) against
tp=1, measured in the same run, and the gloo all-reduce latency per call.

On the CPU this measures the overhead of tensor parallelism (the collectives: 2 all-reduces per layer,
one for the embedding, one all-gather of the logits per step), not a speed-up: every rank runs with
one thread, and the tp=1 baseline too (rank 0 alone, the other ranks waiting), so that the ratio
compares like with like on a machine with few cores.

    PYTHONPATH=$PWD python tools/bench_tp_model.py [--model DIR | --hidden 1024 --layers 8] [--world 2]

--hidden/--layers: a Llama of that width and depth (head_dim 64, MLP 4x hidden, vocab 32000) with
dummy weights, for a step where the matmuls, not the per-call overheads, dominate.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.distributed.parallel import TensorParallel, all_reduce, init_tensor_parallel
from engine.layers.attention.base import AttentionMetadata
from engine.layers.attention.layer import local_heads
from engine.layers.attention.torch_backend import TorchAttentionBackend
from engine.layers.kv_cache import KVCache
from engine.models.config import ModelConfig
from engine.models.loader.model_loader import load_model

BLOCK = 16


class CollectiveClock:
    """Wall time spent inside torch.distributed's all_reduce / all_gather (the model's collectives)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "all_gather"):
            setattr(dist, name, self._timed(getattr(dist, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        return call

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


def _step_inputs(batch: int, tokens_per_seq: int, context: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """batch sequences of `context` tokens, the last tokens_per_seq of each computed this step."""
    per_seq = -(-context // BLOCK)
    tables = torch.arange(batch * per_seq, dtype=torch.int32).view(batch, per_seq)
    positions = torch.arange(context - tokens_per_seq, context).repeat(batch)
    seq = torch.arange(batch).repeat_interleave(tokens_per_seq)
    slots = tables[seq, positions // BLOCK].long() * BLOCK + positions % BLOCK
    starts = torch.arange(batch + 1, dtype=torch.int32) * tokens_per_seq
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=starts,
        seq_lens=torch.full((batch,), context, dtype=torch.int32),
        block_tables=tables,
        max_query_len=tokens_per_seq,
        max_seq_len=context,
        num_decodes=batch if tokens_per_seq == 1 else 0,
    )
    ids = (torch.arange(batch * tokens_per_seq) * 7) % 100
    return ids, positions, meta


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def _time_steps(
    model, kv, inputs, steps: int, tp: TensorParallel | None, clock: CollectiveClock | None = None
) -> tuple[float, float, int]:
    """Seconds per forward + logits and seconds of it inside collectives (medians of `steps`
    after two warm-ups), and the collectives per step."""
    ids, positions, meta = inputs
    last = meta.query_start_loc[1:].long() - 1
    times, waits, calls = [], [], 0
    with torch.inference_mode():
        for i in range(steps + 2):
            if tp is not None:
                dist.barrier()
            if clock is not None:
                clock.reset()
            t = time.perf_counter()
            model.compute_logits(model(ids, positions, kv.tensor, meta)[last])
            if i >= 2:
                times.append(time.perf_counter() - t)
                waits.append(clock.seconds if clock else 0.0)
                calls = clock.calls if clock else 0
    return _median(times), _median(waits), calls


def _load(path: Path, dummy: bool, tp: TensorParallel | None, max_len: int):
    config = ModelConfig.from_dir(path)
    model = load_model(
        path, config, torch.float32, torch.device("cpu"), max_len, load_format="dummy" if dummy else "auto", tp=tp
    )
    model.set_backend(TorchAttentionBackend())
    kv = KVCache(
        config.num_layers, 256, BLOCK, local_heads(config, tp)[1], config.head_dim, torch.float32, torch.device("cpu")
    )
    return model, kv


def _rank(rank: int, world: int, init: str, args, path: str) -> None:
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, world, init, "gloo")
    dummy = args.hidden is not None
    shapes = {"decode": (args.batch, 1, args.context), "prefill": (1, args.prefill, args.prefill)}
    single = {}
    if rank == 0:  # the baseline: the whole model, this process alone
        model, kv = _load(Path(path), dummy, None, args.prefill + args.context)
        single = {name: _time_steps(model, kv, _step_inputs(*s), args.steps, None)[0] for name, s in shapes.items()}
        del model, kv
    dist.barrier()
    model, kv = _load(Path(path), dummy, tp, args.prefill + args.context)
    clock = CollectiveClock()
    sharded = {name: _time_steps(model, kv, _step_inputs(*s), args.steps, tp, clock) for name, s in shapes.items()}
    hidden = model.config.hidden_size
    reduce_times = {}
    for name, (batch, per_seq, _) in shapes.items():
        x = torch.randn(batch * per_seq, hidden)
        times = []
        for i in range(args.steps * 4 + 5):
            dist.barrier()
            t = time.perf_counter()
            all_reduce(x, tp)
            if i >= 5:
                times.append(time.perf_counter() - t)
        reduce_times[name] = _median(times)
    if rank == 0:
        layers = model.config.num_layers
        print(
            f"model {path if args.hidden is None else 'llama (dummy weights)'}: {layers} layers, hidden {hidden}, "
            f"vocab {model.config.vocab_size}, tp={world} (gloo, 1 thread per rank)"
        )
        for name, (batch, per_seq, context) in shapes.items():
            a, (b, spent, calls), r = single[name], sharded[name], reduce_times[name]
            print(
                f"{name:8s} {batch} x {per_seq} tokens (context {context}): tp=1 {a * 1e3:7.2f} ms  "
                f"tp={world} {b * 1e3:7.2f} ms  ratio tp{world}/tp1 {b / a:5.2f}  | {calls} collectives/step, "
                f"{spent * 1e3:6.2f} ms in them ({spent / b:4.0%} of the step); "
                f"one all-reduce of [{batch * per_seq}x{hidden}] alone {r * 1e6:5.0f} us"
            )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: a tiny llama made here)")
    ap.add_argument("--hidden", type=int, default=None, help="a Llama of this hidden size, dummy weights")
    ap.add_argument("--layers", type=int, default=8, help="its layers (with --hidden)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    from engine.models.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        if args.hidden is not None:
            h = args.hidden
            path = make_tiny_model(
                Path(tmp) / "model",
                arch="llama",
                config_only=True,
                overrides=dict(
                    hidden_size=h,
                    intermediate_size=4 * h,
                    num_hidden_layers=args.layers,
                    num_attention_heads=h // 64,
                    num_key_value_heads=max(h // 256, 2),
                    head_dim=64,
                    vocab_size=32000,
                ),
            )
        else:
            path = Path(args.model) if args.model else make_tiny_model(Path(tmp) / "model", arch="llama")
        mp.spawn(_rank, args=(args.world, f"file://{tmp}/rendezvous", args, str(path)), nprocs=args.world)


if __name__ == "__main__":
    main()
