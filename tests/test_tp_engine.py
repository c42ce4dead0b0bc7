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

from engine.request import SamplingParams
from tests.conftest import assert_engine_clean, run_checked

ROOT = Path(__file__).resolve().parent.parent

TP_ARCHS = ("llama", "qwen3", "gemma2", "qwen3_moe")


def _prompts() -> list[list[int]]:
    shared = [(7 * i + 3) % 400 + 20 for i in range(40)]  # a long shared prefix: prefix-cache hits
    return [shared + [11, 12, 13], shared + [21, 22], [(5 * i + 1) % 300 + 30 for i in range(70)],
            [40, 41, 42, 43], shared[:20] + [5, 6, 7, 8, 9]]


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, max_tokens=14, ignore_eos=True)
    return [SamplingParams(**greedy), SamplingParams(**greedy),
            SamplingParams(n=2, temperature=0.9, seed=1234, max_tokens=10, ignore_eos=True),  # fork + seeded
            SamplingParams(**greedy), SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=12,
                                                     ignore_eos=True)]


def _run(engine) -> dict[str, list[list[int]]]:
    """Add the batch, step it to the end checking block accounting; returns tokens per request."""
    for i, (prompt, params) in enumerate(zip(_prompts(), _params())):
        engine.add_request(prompt, params, request_id=f"r{i}")
    done = run_checked(engine)
    assert_engine_clean(engine)
    return {rid: [list(c.token_ids) for c in out.outputs] for rid, out in done.items()}


def _engine(model: Path, tp: int, **extra):
    from engine.config import EngineSettings
    from engine.llm_engine import LLMEngine

    # 16 blocks of 8 tokens for ~200 tokens of prompts + output: sequences are preempted;
    # 24-token chunks: prompts are split over steps.
    settings = dict(model=str(model), device="cpu", enforce_eager=True, tensor_parallel_size=tp, block_size=8,
                    num_gpu_blocks=16, max_model_len=128, max_num_batched_tokens=24, max_num_seqs=4,
                    log_stats_interval=0)
    settings.update(extra)
    return LLMEngine(EngineSettings(**settings))


@pytest.fixture(scope="module", params=TP_ARCHS)
def tp_engine(request, tiny_models):
    """(architecture, a TP=2 engine) shared by the tests of one architecture; shut down after."""
    engine = _engine(tiny_models[request.param], 2, preemption_mode="swap", swap_space_gb=0.01)
    yield request.param, engine
    engine.executor.shutdown()
    assert not any(p.is_alive() for p in engine.executor.procs)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_tp2_equals_tp1(tp_engine, tiny_models, mode):
    """Greedy, n=2 seeded and top-p seeded requests; preemption by `mode` happens in both runs."""
    arch, engine = tp_engine
    reference = _engine(tiny_models[arch], 1, preemption_mode=mode, swap_space_gb=0.01)
    expected = _run(reference)
    assert reference.scheduler.preemptions_by_mode[mode] > 0
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, preemption_mode=mode)
    before = engine.scheduler.preemptions_by_mode[mode]
    assert _run(engine) == expected
    assert engine.scheduler.preemptions_by_mode[mode] > before


def test_killed_worker_ends_the_server(tiny_llama, tmp_path):
    """`kiln serve -tp 2`, a streaming request running, the worker rank SIGKILLed: the client gets
    an error (not a hang), /health turns 503 (or the port closes), and the server exits non-zero
    within 10 s."""
    import signal

    import httpx
    import psutil

    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "engine.cli", "serve", str(tiny_llama), "-tp", "2", "--port", "0",
           "--device", "cpu", "--enforce-eager", "--max-model-len", "512", "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("kiln: serving"), log.read_text()[-3000:]
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        base = url.removesuffix("/v1")
        assert httpx.get(f"{base}/health").status_code == 200
        workers = [c for c in psutil.Process(proc.pid).children(recursive=True)
                   if c.pid != proc.pid and "spawn_main" in " ".join(c.cmdline())]
        assert len(workers) == 1, [c.cmdline() for c in psutil.Process(proc.pid).children(recursive=True)]
        events: list[str] = []
        with httpx.Client(timeout=20) as client:
            body = {"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
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
