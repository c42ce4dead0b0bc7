"""Tensor parallelism, rank 0's side: start the workers, mirror every step to them, watch them.

Rank 0 is the ordinary engine process: scheduler, sampler, detokenizer and server stay there as
single pure-CPU objects. `TensorParallelExecutor.start` spawns `world_size - 1` worker processes
(engine/executor/tp_worker.py), joins the process group with them (gloo on the CPU, NCCL on
GPUs) and hands the engine builder three wrappers, so the runner does not change:

- `ShardedModel` wraps rank 0's model shard: every `forward` / `compute_logits` first broadcasts
  a compact step description (engine/executor/step_codec.py), then runs this rank's shard;
  the all-reduces inside the model line up because every rank runs the same calls in order.
- `MirroredSwapper` wraps the BlockSwapper: a step's swap-out/in is applied on every rank.
- `TensorParallelRunner.launch` mirrors copy-on-write block copies before the step.

Each message and the model call it announces run under one lock, so the idle heartbeat (a
no-op message every HEARTBEAT_S, which keeps the workers' collective timeout for real hangs)
never interleaves with a step's collectives.

Worker death: a watchdog thread waits on the workers' process sentinels. When one exits, the
executor is marked dead (every later message raises WorkerDiedError at once), and the callbacks
registered with `on_death` run (the server fails in-flight requests, turns /health 503 and
exits). A step already inside a collective fails on its own: gloo errors out when a peer's
connection closes, and every collective has the process group's timeout as a backstop.
"""

from __future__ import annotations

import atexit
import collections
import logging
import multiprocessing
import multiprocessing.connection
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from engine.distributed.parallel import join_group
from engine.executor import step_codec as codec
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HEARTBEAT_S = 30.0  # idle rank 0 sends a no-op this often (well inside COLLECTIVE_TIMEOUT_S)
START_TIMEOUT_S = 600.0  # workers must join the process group within this


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited: the engine cannot run another step."""


@dataclass
class WorkerSpec:
    """Everything a worker needs to build its shard (pickled once, at spawn)."""

    settings: Any  # EngineSettings
    model_dir: Path
    dtype: torch.dtype
    max_positions: int
    world_size: int
    init_method: str
    backend: str
    cpu_threads: int | None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def per_rank_cpu_threads(settings, world_size: int) -> int | None:
    """On the CPU the ranks share the cores: each gets its share unless cpu_threads is set."""
    if settings.cpu_threads is not None:
        return settings.cpu_threads
    from engine.config.process_setup import available_cores
    from engine.worker.cpu_threads import plan_threads

    default = plan_threads(None, settings.cpu_bind, available_cores()).threads
    return max(1, default // world_size)


class TensorParallelExecutor:
    """Rank 0's end of the workers: see the module docstring."""

    def __init__(self, tp, device: torch.device, procs: list, error_pipes: list) -> None:
        self.tp = tp
        self.device = device
        self.procs = procs
        self._error_pipes = error_pipes
        self.world_size = len(procs) + 1
        self.lock = threading.Lock()
        self._message = torch.zeros(codec.MESSAGE_BYTES, dtype=torch.uint8, device=device)  # under the lock
        self._types: dict[type, int] = {}
        self._dead: str | None = None
        self._closing = False
        self._callbacks: list[Callable[[str], None]] = []
        self._last_send = time.monotonic()
        self.sent: collections.Counter[int] = collections.Counter()  # messages sent per op code (stats)
        self.send_seconds = 0.0  # time spent broadcasting step descriptions
        self._wake = threading.Event()  # stops the heartbeat
        self._died = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="kiln-tp-watchdog", daemon=True)
        self._watchdog.start()
        self._heartbeat: threading.Thread | None = None
        atexit.register(self.shutdown)

    # ---- start-up ----
    @classmethod
    def start(
        cls, settings, model_dir: Path, device: torch.device, dtype: torch.dtype, max_positions: int
    ) -> "TensorParallelExecutor":
        world = settings.tensor_parallel_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        if dist.is_initialized():
            raise RuntimeError(
                "tensor_parallel_size: this process already runs a tensor-parallel engine (or "
                "another torch.distributed group); one per process"
            )
        if device.type == "cuda":
            visible = torch.cuda.device_count()
            if visible < world:
                raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs; {visible} visible")
            torch.cuda.set_device(0)
        spec = WorkerSpec(
            settings,
            model_dir,
            dtype,
            max_positions,
            world,
            f"tcp://127.0.0.1:{free_port()}",
            backend,
            per_rank_cpu_threads(settings, world) if device.type == "cpu" else None,
        )
        from engine.executor.tp_worker import worker_main

        ctx = multiprocessing.get_context("spawn")
        procs, pipes = [], []
        for rank in range(1, world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(spec, rank, send), name=f"kiln-tp-rank{rank}", daemon=True)
            p.start()
            send.close()
            procs.append(p)
            pipes.append(recv)
        logger.info(
            "tensor parallel: %d ranks over %s; started workers %s",
            world,
            backend,
            ", ".join(str(p.pid) for p in procs),
        )
        try:
            tp = _join_watching(procs, pipes, lambda: join_group(0, world, spec.init_method, backend))
        except BaseException:
            for p in procs:
                p.kill()
            raise
        return cls(tp, device, procs, pipes)

    def wrap_model(self, model) -> "ShardedModel":
        return ShardedModel(model, self)

    def wrap_swapper(self, swapper) -> "MirroredSwapper | None":
        return None if swapper is None else MirroredSwapper(swapper, self)

    def send_layout(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Every rank allocates its KV cache (and CPU swap pool) with rank 0's block counts; the
        idle heartbeat starts now that the workers wait in their step loop."""
        h = codec.Header(codec.OP_LAYOUT)
        h.add(num_blocks, num_cpu_blocks)
        with self.lock:
            self._send(h)
        self._heartbeat = threading.Thread(target=self._beat, name="kiln-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    # ---- messages (callers hold self.lock) ----
    def _check(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, 0)
        except Exception as exc:
            self._died.wait(1.0)  # the watchdog names the dead worker better than gloo's error does
            self._check()
            raise WorkerDiedError(f"tensor parallel: broadcast to the workers failed: {exc}") from exc

    def _send(self, header: codec.Header, *payloads: torch.Tensor | None) -> None:
        self._check()
        t0 = time.perf_counter()
        extra = codec.pack_message(header, payloads, self._message)
        self._broadcast(self._message)
        if extra is not None:
            self._broadcast(extra)
        self.send_seconds += time.perf_counter() - t0
        self.sent[header.op] += 1
        self._last_send = time.monotonic()

    def _type_id(self, cls: type) -> int:
        if cls not in self._types:
            data = codec.type_path(cls).encode()
            h = codec.Header(codec.OP_SCHEMA)
            h.add(len(data))
            self._send(h, torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device))
            self._types[cls] = len(self._types)
        return self._types[cls]

    def send_forward(self, args: tuple) -> None:
        h = codec.Header(codec.OP_FORWARD)
        ints, floats = codec.encode_forward(h, args, self._type_id)
        self._send(h, codec.pack_ints(ints, self.device), *(f.contiguous() for f in floats))

    def send_logits(self, hidden: torch.Tensor) -> None:
        h = codec.Header(codec.OP_LOGITS)
        h.add(codec._CODE[hidden.dtype], *hidden.shape)
        self._send(h, hidden.contiguous())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        h = codec.Header(codec.OP_COPY_BLOCKS)
        h.add(len(pairs))
        with self.lock:
            self._send(h, _pairs_tensor(pairs, self.device))

    def swap(self, swap_out, swap_in) -> None:
        h = codec.Header(codec.OP_SWAP)
        h.add(len(swap_out), len(swap_in))
        with self.lock:
            self._send(h, _pairs_tensor(list(swap_out) + list(swap_in), self.device))

    # ---- liveness ----
    @property
    def dead(self) -> str | None:
        """Why the workers can no longer run steps (None while they can)."""
        return self._dead

    def on_death(self, callback: Callable[[str], None]) -> None:
        """callback(reason) runs on the watchdog thread when a worker dies (at once if one has)."""
        self._callbacks.append(callback)
        if self._dead is not None:
            callback(self._dead)

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self.procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        rank, proc = sentinels[ready[0]]
        proc.join(1.0)
        detail = _worker_error(self._error_pipes[rank - 1])
        self._dead = f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}" + (
            f": {detail}" if detail else ""
        )
        logger.error("%s", self._dead)
        self._died.set()
        self._wake.set()
        for callback in list(self._callbacks):
            try:
                callback(self._dead)
            except Exception:  # noqa: BLE001 - every callback must run
                logger.exception("worker-death callback failed")

    def _beat(self) -> None:
        while not self._wake.wait(HEARTBEAT_S / 3):
            if time.monotonic() - self._last_send < HEARTBEAT_S:
                continue
            if self.lock.acquire(timeout=1.0):
                try:
                    if self._dead is None and not self._closing:
                        self._send(codec.Header(codec.OP_NOOP))
                except Exception:  # noqa: BLE001 - the watchdog reports the cause
                    logger.debug("tensor parallel heartbeat failed", exc_info=True)
                    return
                finally:
                    self.lock.release()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the workers to exit and wait for them (killed after `timeout`)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        if self._dead is None and self.lock.acquire(timeout=timeout):
            try:
                self._send(codec.Header(codec.OP_EXIT))
            except Exception:  # noqa: BLE001 - they are killed below
                pass
            finally:
                self.lock.release()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already gone
            pass
        atexit.unregister(self.shutdown)


def _pairs_tensor(pairs, device: torch.device) -> torch.Tensor | None:
    if not pairs:
        return None
    return torch.tensor([v for pair in pairs for v in pair], dtype=torch.int64).to(device)


def _worker_error(pipe) -> str | None:
    """The error a worker reported before exiting, if any."""
    try:
        if pipe.poll(0.5):
            return pipe.recv()
    except (EOFError, OSError):
        pass
    return None


def _join_watching(procs: list, pipes: list, join: Callable[[], Any]):
    """Run `join` (the rendezvous) while watching the workers: one failing to start raises its
    error here instead of leaving rank 0 waiting for it."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["tp"] = join()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            result["error"] = exc

    t = threading.Thread(target=run, name="kiln-tp-join", daemon=True)
    t.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while t.is_alive():
        t.join(0.1)
        for rank, (p, pipe) in enumerate(zip(procs, pipes), start=1):
            if not p.is_alive():
                detail = _worker_error(pipe)
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} failed to start (exit code "
                    f"{p.exitcode})" + (f": {detail}" if detail else "")
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel workers did not join within {START_TIMEOUT_S:.0f}s")
    if "error" in result:
        raise result["error"]
    return result.get("tp")


class ShardedModel:
    """Rank 0's model: each call is first described to the workers, then run on this shard.
    Everything else (config, lora_slots, set_backend, ...) is the shard's own."""

    def __init__(self, model, executor: TensorParallelExecutor) -> None:
        self.inner = model
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, *step: Any
    ) -> torch.Tensor:
        ex = self.executor
        with ex.lock:
            ex.send_forward((input_ids, positions, *step))
            return self.inner(input_ids, positions, kv_cache, *step)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ex = self.executor
        with ex.lock:
            ex.send_logits(hidden)
            return self.inner.compute_logits(hidden)


class MirroredSwapper:
    """The BlockSwapper, with every launch applied on the workers' KV caches too."""

    def __init__(self, swapper, executor: TensorParallelExecutor) -> None:
        self.inner = swapper
        self.executor = executor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def launch(self, swap_out, swap_in) -> None:
        if swap_out or swap_in:
            self.executor.swap(swap_out, swap_in)
        self.inner.launch(swap_out, swap_in)


class TensorParallelRunner(ModelRunner):
    """The ModelRunner, with a step's copy-on-write block copies applied on every rank."""

    executor: TensorParallelExecutor

    def launch(self, sched, defer_sampling: bool = False, bitmask=None):
        if sched.blocks_to_copy:
            self.executor.copy_blocks(sched.blocks_to_copy)
        return super().launch(sched, defer_sampling, bitmask)
