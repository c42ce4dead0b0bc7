"""A tensor-parallel worker process (ranks 1..world_size-1).

It joins the process group, loads its shard of the model, and then follows rank 0 message by
message (engine/executor/step_codec.py): a KV layout (the same block count and layout as rank
0's, with this rank's KV heads), forwards (the model's collectives line up with rank 0's; the
output is discarded: sampling happens once, on rank 0), LM-head calls, block copies and swaps,
heartbeats, and exit. It never schedules or samples anything.

It exits when rank 0 says so, when a message fails (rank 0 gone: its connection closed), or
when its parent process dies (a thread waits on the parent's sentinel), so no worker outlives
the engine.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import traceback

from engine.config.process_setup import prepare_process

# The worker process's entry module (spawned: multiprocessing imports it before the worker's spec,
# which holds torch types), so it prepares the process before torch loads, as rank 0's entry point did.
prepare_process()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from engine.executor import step_codec as codec  # noqa: E402

logger = logging.getLogger(__name__)


def worker_main(spec, rank: int, errors) -> None:
    """Process entry point: run the worker; report a failure on `errors` and exit non-zero."""
    # Ctrl-C in a terminal reaches the whole process group: rank 0 shuts the workers down itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()
    try:
        Worker(spec, rank).run()
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, then the process ends
        try:
            errors.send(f"{type(exc).__name__}: {exc}")
        except Exception:  # noqa: BLE001
            pass
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(3)

    threading.Thread(target=watch, name="kiln-tp-parent-watch", daemon=True).start()


class Worker:
    def __init__(self, spec, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        settings = spec.settings
        if spec.backend == "nccl":
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
            from engine.worker.cpu_isa import apply_cpu_isa_limit
            from engine.worker.cpu_threads import apply_cpu_threads

            apply_cpu_threads(spec.cpu_threads, settings.cpu_bind)
            apply_cpu_isa_limit()  # (as rank 0: the same kernels on every rank)
        from engine.distributed.parallel import join_group

        self.tp = join_group(rank, spec.world_size, spec.init_method, spec.backend)
        self._load()
        self.kv_cache: torch.Tensor | None = None
        self.swapper = None
        self.types: list[type] = []

    def _load(self) -> None:
        from engine.layers.attention.selector import attention_backend_for
        from engine.models.config import ModelConfig
        from engine.models.loader.model_loader import load_model

        s = self.spec.settings
        if self.device.type == "cpu":  # (kiln's compile cache, not a temp dir, as rank 0)
            from compiler.kernels.cpu_gemv import GEMV

            GEMV.configure(s.resolved_compile_cache_dir())
        self.config = cfg = ModelConfig.from_dir(self.spec.model_dir, s.cache_dir)
        torch.manual_seed(s.seed)
        self.model = load_model(
            self.spec.model_dir,
            cfg,
            self.spec.dtype,
            self.device,
            self.spec.max_positions,
            s.load_format,
            s.seed,
            quantization=s.quantization,
            tp=self.tp,
        )
        self.backend = attention_backend_for(s, cfg, self.device, self.spec.dtype)
        self.model.set_backend(self.backend)
        if self.device.type == "cpu" and hasattr(self.model, "warm_cpu_linear"):  # as rank 0 does
            self.model.warm_cpu_linear(s.max_num_batched_tokens, s.max_num_seqs)
        if self.device.type == "cpu" and not s.enforce_eager:
            from compiler.kernels.cpu_attention import KERNEL

            KERNEL.configure(s.resolved_compile_cache_dir())
            if hasattr(self.model, "use_cpu_fused_ops"):
                # The same fused norms / RoPE / SiLU as rank 0 (engine_builder._compile_and_capture):
                # every rank normalises the replicated hidden states with the same code.
                self.model.use_cpu_fused_ops(s.resolved_compile_cache_dir())
        # The kiln:: custom ops import Dynamo on their first call (seconds): here, while rank 0 is
        # still building, not inside the first step (where rank 0 would wait for it).
        importlib.import_module("torch._dynamo")

    def kv_heads(self) -> int:
        from engine.models.sharding import kv_heads_of

        return kv_heads_of(self.config, self.tp)

    def _allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        from engine.layers.kv_cache import KVCache

        s = self.spec.settings
        self.kv_cache = KVCache(
            self.config.num_layers,
            num_blocks,
            s.block_size,
            self.kv_heads(),
            self.config.head_dim,
            self.spec.dtype,
            self.device,
        ).tensor
        if num_cpu_blocks > 0:
            from engine.worker.block_swapper import BlockSwapper

            self.swapper = BlockSwapper(self.kv_cache, num_cpu_blocks)

    def _profile_cache(self) -> torch.Tensor:
        """The 2-block cache of rank 0's start-up profile forward (before the layout is known)."""
        from engine.layers.kv_cache import KVCache

        return KVCache(
            self.config.num_layers,
            2,
            self.spec.settings.block_size,
            self.kv_heads(),
            self.config.head_dim,
            self.spec.dtype,
            self.device,
        ).tensor

    @torch.inference_mode()
    def run(self) -> None:
        message = torch.empty(codec.MESSAGE_BYTES, dtype=torch.uint8, device=self.device)
        while True:
            dist.broadcast(message, 0)
            r = codec.Reader(message[: codec.HEADER_BYTES].view(torch.int64).tolist())
            n = r.payload_bytes
            if n <= codec.INLINE_BYTES:
                data = message[codec.HEADER_BYTES : codec.HEADER_BYTES + n]
            else:
                data = torch.empty(n, dtype=torch.uint8, device=self.device)
                dist.broadcast(data, 0)
            payload = codec.Payload(data)
            op = r.op
            if op == codec.OP_FORWARD:
                self._forward(r, payload)
            elif op == codec.OP_LOGITS:
                dtype = codec._DTYPES[r.next()]
                rows, width = r.next(), r.next()
                self.model.compute_logits(payload.take((rows, width), dtype))
            elif op == codec.OP_COPY_BLOCKS:
                pairs = payload.take((r.next(), 2), torch.int64)
                torch.ops.kiln.copy_blocks(self.kv_cache, pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
            elif op == codec.OP_SWAP:
                n_out, n_in = r.next(), r.next()
                pairs = [tuple(p) for p in payload.take((n_out + n_in, 2), torch.int64).tolist()]
                self.swapper.launch(pairs[:n_out], pairs[n_out:])
                self.swapper.wait()
            elif op == codec.OP_LAYOUT:
                self._allocate(r.next(), r.next())
            elif op == codec.OP_SCHEMA:
                data = payload.take((r.next(),), torch.uint8).cpu().numpy().tobytes()
                self.types.append(codec.resolve_type(data.decode()))
            elif op == codec.OP_NOOP:
                continue
            elif op == codec.OP_EXIT:
                return
            else:
                raise RuntimeError(f"tensor parallel worker: unknown op {op}")

    def _forward(self, r: codec.Reader, payload: codec.Payload) -> None:
        plan, slots = codec.decode_forward(r, self.types)
        n = codec.int_payload_size(slots)
        ints = payload.take((n,), torch.int64) if n else None
        floats = [payload.take(s.shape, s.dtype) for s in slots if s.dtype.is_floating_point]
        input_ids, positions, *step = codec.fill_slots(plan, slots, ints, floats)
        kv = self.kv_cache if self.kv_cache is not None else self._profile_cache()
        self.model(input_ids, positions, kv, *step)
