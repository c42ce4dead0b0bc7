"""Tensor parallelism on the CPU: two ranks over gloo (rank 0 is this process, one worker process).

tensor_parallel_size=2 must give the same tokens as tensor_parallel_size=1, for the tiny Llama,
Qwen3, Gemma 2 and a mixture of experts, with prefix caching, chunked prefill, preemption by swap
and by recompute (a KV budget too small for the batch), n > 1 and a seeded sampled request in
the same batch; block accounting is checked after every step. One TP engine is built per
architecture (a worker process costs seconds to start). A killed worker ends a real
`kiln serve -tp 2` within 10 s, with an error to the client whose request was running.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.core.params import SamplingParams
from tests.support.engine import assert_engine_clean, run_checked

ROOT = Path(__file__).resolve().parents[2]

TP_ARCHS = ("llama", "qwen3", "gemma2", "qwen3_moe")


def _prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 400 + 20 for i in range(40)]  # a long shared prefix: prefix-cache hits
    return [
        shared + [11, 12, 13],
        shared + [21, 22],
        [(5 * i + 1) % 300 + 30 for i in range(70)],
        [40, 41, 42, 43],
        shared[:20] + [5, 6, 7, 8, 9],
    ]


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy),
        SamplingParams(n=2, temperature=0.9, seed=1234, max_tokens=8, ignore_eos=True),  # fork + seeded
        SamplingParams(**greedy),
        SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True),
    ]


def _run(engine) -> dict[str, list[list[int]]]:
    """Add the batch, step it to the end checking block accounting; returns tokens per request."""
    for i, (prompt, params) in enumerate(zip(_prompts(), _params())):
        engine.add_request(prompt, params, request_id=f"r{i}")
    done = run_checked(engine)
    assert_engine_clean(engine)
    return {rid: [list(c.token_ids) for c in out.outputs] for rid, out in done.items()}


def _engine(model: Path, tp: int, **extra):
    from engine.config.settings import EngineSettings
    from engine.runtime.llm_engine import LLMEngine

    # 16 blocks of 8 tokens for ~200 tokens of prompts + output: sequences are preempted;
    # 24-token chunks: prompts are split over steps.
    settings = dict(
        model=str(model),
        device="cpu",
        enforce_eager=True,
        tensor_parallel_size=tp,
        block_size=8,
        num_gpu_blocks=16,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        log_stats_interval=0,
    )
    settings.update(extra)
    return LLMEngine.from_settings(EngineSettings(**settings))


class _OneEngine:
    """One TP engine at a time (a process holds one torch.distributed group): a test asking for
    another configuration shuts the current one down first."""

    def __init__(self) -> None:
        self.key = None
        self.engine = None

    def get(self, key, build):
        if key != self.key:
            self.close()
            self.engine, self.key = build(), key
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            executor = self.engine.core.executor
            executor.shutdown()
            assert not any(p.is_alive() for p in executor.procs), "a worker outlived shutdown"
            self.engine = self.key = None


@pytest.fixture(scope="module")
def tp_engines():
    pool = _OneEngine()
    yield pool
    pool.close()


# Both preemption modes for a dense and a MoE model, one each for the others (a TP run is slow:
# every step waits on the collectives of two processes sharing the cores).
@pytest.mark.parametrize(
    "arch,mode",
    [
        ("llama", "swap"),
        ("llama", "recompute"),
        ("qwen3", "recompute"),
        ("gemma2", "swap"),
        ("qwen3_moe", "swap"),
        ("qwen3_moe", "recompute"),
    ],
)
def test_tp2_equals_tp1(tp_engines, tiny_models, arch, mode):
    """Greedy, n=2 seeded and top-p seeded requests; preemption by `mode` happens in both runs."""
    engine = tp_engines.get(arch, lambda: _engine(tiny_models[arch], 2, preemption_mode="swap", swap_space_gb=0.01))
    reference = _engine(tiny_models[arch], 1, preemption_mode=mode, swap_space_gb=0.01)
    expected = _run(reference)
    assert reference.core.scheduler.preemptions_by_mode[mode] > 0
    engine.core.scheduler.config = dataclasses.replace(engine.core.scheduler.config, preemption_mode=mode)
    engine.core.scheduler.preemption.mode = mode  # the preemptor keeps its own copy of the mode
    before = engine.core.scheduler.preemptions_by_mode[mode]
    assert _run(engine) == expected
    assert engine.core.scheduler.preemptions_by_mode[mode] > before


def test_tp2_spec_decode_structured_output_and_heartbeat(tp_engines, tiny_llama, monkeypatch):
    """Speculative decoding (ngram drafts verified in one forward) and a JSON-schema constrained
    request give TP 1's tokens; an idle engine keeps its workers with heartbeats and still runs."""
    from engine.core.params import StructuredOutputsParams
    from engine.executor import step_codec as codec
    from engine.executor import tp_executor as executor_module

    monkeypatch.setattr(executor_module, "HEARTBEAT_S", 0.3)
    spec = dict(speculative_method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, max_num_batched_tokens=64)
    engine = tp_engines.get("spec", lambda: _engine(tiny_llama, 2, **spec))
    reference = _engine(tiny_llama, 1, **spec)
    repetitive = [30, 31, 32, 33, 34] * 6
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    reqs = [
        (repetitive, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
        (
            "Numbers: 0 1 2",
            SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema)),
        ),
    ]

    def run(e):
        for i, (prompt, params) in enumerate(reqs):
            e.add_request(prompt, params, request_id=f"s{i}")
        done = run_checked(e)
        assert_engine_clean(e)
        return {rid: list(out.outputs[0].token_ids) for rid, out in done.items()}

    expected = run(reference)
    assert run(engine) == expected
    beats = engine.core.executor.sent[codec.OP_NOOP]
    time.sleep(1.5)
    assert engine.core.executor.sent[codec.OP_NOOP] > beats  # idle: heartbeats went out, answered by nobody
    assert run(engine) == expected


def test_worker_exits_when_rank0_dies(tiny_llama, tmp_path):
    """Rank 0 SIGKILLed (no chance to send the exit message): its worker exits on its own."""
    import psutil

    script = tmp_path / "rank0.py"
    script.write_text(
        "import sys, time\n"
        "from engine.entrypoints.llm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_llama)!r}, device='cpu', enforce_eager=True, tensor_parallel_size=2,\n"
        "              max_model_len=128, num_gpu_blocks=32)\n"
        "    print(llm.engine.core.executor.procs[0].pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        worker = psutil.Process(int(proc.stdout.readline()))
        proc.kill()
        proc.wait(10)
        worker.wait(10)  # raises psutil.TimeoutExpired if it lingers
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tensor_parallel_settings():
    """Accepted from 1 up; the combinations not built yet are refused at start-up by name."""
    from pydantic import ValidationError

    from engine.config.settings import EngineSettings

    assert EngineSettings(tensor_parallel_size=2).tensor_parallel_size == 2
    with pytest.raises(ValidationError, match="tensor_parallel_size"):
        EngineSettings(tensor_parallel_size=0)
    for name, value in (("enable_lora", True), ("quantization", "fp8"), ("cpu_compile_forward", True)):
        with pytest.raises(ValidationError, match=f"tensor_parallel_size=2: {name} is not supported"):
            EngineSettings(tensor_parallel_size=2, **{name: value})


def test_killed_worker_ends_the_server(tiny_llama, tmp_path):
    """`kiln serve -tp 2`, a streaming request running, the worker rank SIGKILLed: the client gets
    an error (not a hang), /health turns 503 (or the port closes), and the server exits non-zero
    within 10 s."""
    import signal

    import httpx
    import psutil

    log = tmp_path / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "serve",
        str(tiny_llama),
        "-tp",
        "2",
        "--port",
        "0",
        "--device",
        "cpu",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--disable-uvicorn-access-log",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=open(log, "w"),
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("kiln: serving"), log.read_text()[-3000:]
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        base = url.removesuffix("/v1")
        assert httpx.get(f"{base}/health").status_code == 200
        workers = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if c.pid != proc.pid and "spawn_main" in " ".join(c.cmdline())
        ]
        assert len(workers) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        events: list[str] = []
        with httpx.Client(timeout=20) as client:
            body = {"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with client.stream("POST", f"{url}/completions", json=body) as r:
                assert r.status_code == 200
                killed_at = None
                for event in r.iter_lines():
                    if event:
                        events.append(event)
                    if killed_at is None and len(events) >= 3:
                        os.kill(workers[0].pid, signal.SIGKILL)
                        killed_at = time.monotonic()
        assert killed_at is not None
        try:
            health = httpx.get(f"{base}/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone
        assert health in (503, None)
        assert any('"error"' in e for e in events), events[-3:]  # an error event, not a silent end
        assert not any('"finish_reason":"length"' in e for e in events)
        proc.wait(timeout=max(0.1, killed_at + 10 - time.monotonic()))
        assert time.monotonic() - killed_at < 10
        assert proc.returncode not in (0, None)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = log.read_text()
    assert "tensor-parallel worker rank 1" in text, text[-3000:]
    print(text[-2000:], f"\nexited {time.monotonic() - killed_at:.1f}s after the kill, code {proc.returncode}")


def test_step_codec_round_trip():
    """What rank 0 packs is what a worker rebuilds: ids, positions, AttentionMetadata (int32 and
    int64 tensors, a 2-D block table, ints, None) and a None context, inline and (a long prefill)
    out of line."""
    import torch

    from engine.executor import step_codec as codec
    from engine.layers.attention.base import AttentionMetadata

    for tokens in (5, 3000):  # 3000 tokens: the payload no longer fits the message
        meta = AttentionMetadata(
            slot_mapping=torch.arange(tokens, dtype=torch.int64) - 1,
            query_start_loc=torch.tensor([0, 2, tokens], dtype=torch.int32),
            seq_lens=torch.tensor([7, tokens + 4], dtype=torch.int32),
            block_tables=torch.arange(12, dtype=torch.int32).view(2, 6)[:, :4],
            max_query_len=tokens - 2,
            max_seq_len=tokens + 4,
            num_decodes=0,
        )
        ids, positions = torch.arange(tokens) * 3, torch.arange(tokens) + 4
        hidden = torch.randn(2, 8)
        types: list[type] = []

        def type_id(cls: type) -> int:  # (rank 0 announces each new type with OP_SCHEMA)
            if cls not in types:
                types.append(cls)
            return types.index(cls)

        header = codec.Header(codec.OP_FORWARD)
        ints, floats = codec.encode_forward(header, (ids, positions, meta, None), type_id)
        message = torch.zeros(codec.MESSAGE_BYTES, dtype=torch.uint8)
        extra = codec.pack_message(header, [codec.pack_ints(ints, torch.device("cpu")), *floats, hidden], message)
        assert (extra is None) == (tokens == 5)
        r = codec.Reader(message[: codec.HEADER_BYTES].view(torch.int64).tolist())
        assert r.op == codec.OP_FORWARD
        data = message[codec.HEADER_BYTES : codec.HEADER_BYTES + r.payload_bytes] if extra is None else extra
        payload = codec.Payload(data)
        plan, slots = codec.decode_forward(r, types)
        got_ids, got_pos, got_meta, got_ctx = codec.fill_slots(
            plan, slots, payload.take((codec.int_payload_size(slots),), torch.int64), []
        )
        assert torch.equal(got_ids, ids) and torch.equal(got_pos, positions) and got_ctx is None
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            want, got = getattr(meta, name), getattr(got_meta, name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
        assert (got_meta.max_query_len, got_meta.max_seq_len, got_meta.num_decodes) == (tokens - 2, tokens + 4, 0)
        assert torch.equal(payload.take((2, 8), torch.float32), hidden)  # a float part after the ints


def test_bench_throughput_tensor_parallel_prints_the_ratio(tiny_llama):
    """`kiln bench throughput --tensor-parallel-size 2` runs TP 1 and TP 2 and prints their ratio and
    the collectives per step (its own process: one TP engine per process)."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "bench",
            "throughput",
            "--tensor-parallel-size",
            "2",
            "--model",
            str(tiny_llama),
            "--device",
            "cpu",
            "--num-prompts",
            "8",
            "--input-len",
            "8,32",
            "--output-len",
            "4,8",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "ratio tensor_parallel_size 2 / 1 (median tok/s):" in out.stdout, out.stdout[-2000:]
    assert "all_reduce:" in out.stdout and "calls per step" in out.stdout
