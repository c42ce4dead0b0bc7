"""CPU thread settings: the plan (count, pinning), the wait policy set before torch loads, the log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config.process_setup import (
    QUIET_SPIN_COUNT,
    SHARED_SPIN_COUNT,
    available_cores,
    cores_busy_elsewhere,
    spin_count_for,
)
from engine.config.settings import EngineSettings
from engine.config.values import parse_core_list
from engine.worker.cpu_threads import apply_cpu_threads, plan_threads

ROOT = Path(__file__).resolve().parents[2]


def test_core_list_parsing():
    assert parse_core_list("0,2,4-6") == [0, 2, 4, 5, 6]
    assert parse_core_list(" 3 , 1 ") == [1, 3]
    for bad in ("x", "1-", "3-1", ",", "1.5"):
        with pytest.raises(ValueError):
            parse_core_list(bad)


def test_default_leaves_a_core_for_the_loop_and_server_from_four_cores():
    assert plan_threads(None, "auto", [0, 1]).threads == 2  # one of two idle would halve the compute
    assert plan_threads(None, "auto", [0]).threads == 1
    assert plan_threads(None, "auto", [0, 1, 2]).threads == 3
    assert plan_threads(None, "auto", [0, 1, 2, 3]).threads == 3
    assert plan_threads(None, "none", list(range(16))).threads == 15
    plan = plan_threads(None, "auto", list(range(8)))
    assert plan.cores is None and plan.available == 8


def test_explicit_threads_and_core_lists():
    assert plan_threads(2, "auto", [0, 1]).threads == 2
    plan = plan_threads(None, "1-3", [0, 1, 2, 3])
    assert plan.cores == [1, 2, 3] and plan.threads == 3
    assert plan_threads(1, "0,1", [0, 1]).threads == 1
    with pytest.raises(ValueError, match="not available"):
        plan_threads(None, "0-7", [0, 1])
    assert "pinned to cores 1-3" in plan.describe()


def test_settings_validate_cpu_bind():
    assert EngineSettings(cpu_bind="0-1", cpu_threads=2).cpu_bind == "0-1"
    with pytest.raises(ValueError, match="cpu_bind"):
        EngineSettings(cpu_bind="fast")
    with pytest.raises(ValueError):
        EngineSettings(cpu_threads=0)


def _run(code: str, env_extra: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra or {}, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


SPIN_CODE = (
    "import json, os; from engine.config.process_setup import prepare_process; prepare_process(); "
    "import torch; print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), "
    "prepare_process().wait_policy()]))"
)


def test_the_spin_is_set_before_torch_loads_and_a_user_choice_is_kept():
    policy, count, words = _run(SPIN_CODE)
    assert policy is None and count in (QUIET_SPIN_COUNT, SHARED_SPIN_COUNT)
    assert words.startswith(f"spin {count} then sleep (") and "at start" in words
    assert _run(SPIN_CODE, {"OMP_WAIT_POLICY": "PASSIVE"}) == ["PASSIVE", None, "passive"]
    assert _run(SPIN_CODE, {"OMP_WAIT_POLICY": "ACTIVE"}) == ["ACTIVE", None, "active"]
    assert _run(SPIN_CODE, {"GOMP_SPINCOUNT": "50"}) == [None, "50", "spin 50 then sleep"]
    late = _run(
        "import json, torch; from engine.config.process_setup import prepare_process; "
        "print(json.dumps(prepare_process().wait_policy()))"
    )
    assert "imported before kiln" in late


def test_the_spin_is_short_where_other_processes_keep_the_cores_busy():
    assert spin_count_for(0.0)[0] == spin_count_for(0.3)[0] == spin_count_for(None)[0] == QUIET_SPIN_COUNT
    count, why = spin_count_for(1.2)
    assert count == SHARED_SPIN_COUNT and "1.2 of kiln's cores busy" in why
    # One busy loop on every core this process may use: the start-up look sees them, not itself.
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in available_cores()]
    try:
        assert cores_busy_elsewhere(0.3) >= 0.5 * len(loops)
        _, count, words = _run(SPIN_CODE)
        assert count == SHARED_SPIN_COUNT and "other processes kept" in words
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


# A thread runs 1000 parallel regions 30 µs apart after the main thread made a team of its own;
# prints the sleeps (voluntary context switches) of the process's threads per region.
TEAMS_CODE = """
import json, os, sys, threading, time
import torch
from engine.worker.cpu_threads import release_openmp_team
torch.set_num_threads(2)
x = torch.randn(1 << 20); y = torch.empty_like(x)
def sleeps():
    n = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            n += sum(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
    return n
def regions(out):
    torch.add(x, 1, out=y)
    s0 = sleeps()
    for _ in range(1000):
        torch.add(x, 1, out=y)
        t = time.perf_counter()
        while time.perf_counter() - t < 30e-6:
            pass
    out.append((sleeps() - s0) / 1000)
torch.add(x, 1, out=y)  # the main thread's team
released = release_openmp_team() if sys.argv[1] == "release" else None
out = []
t = threading.Thread(target=regions, args=(out,)); t.start(); t.join()
torch.add(x, 1, out=y)  # (the main thread can still run parallel work: a new team)
print(json.dumps([released, out[0]]))
"""


@pytest.mark.skipif(
    len(available_cores()) < 2 or not sys.platform.startswith("linux"), reason="needs two cores and Linux's /proc"
)
def test_the_builder_thread_gives_its_openmp_team_back():
    """With two teams on two cores libgomp throttles the spin and the idle threads sleep between
    regions; once the main thread gave its team back they spin through the 30 µs gaps."""

    def run(mode: str) -> list:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env.update(GOMP_SPINCOUNT="1000000", PYTHONPATH=str(ROOT))  # (~10 ms: no sleeps but throttled ones)
        out = subprocess.run(
            [sys.executable, "-c", TEAMS_CODE, mode], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    released, sleeps_released = run("release")
    _, sleeps_kept = run("keep")
    assert released is True
    assert sleeps_released < 0.25 and sleeps_kept > 4 * sleeps_released, (sleeps_released, sleeps_kept)


def test_pinning_applies_to_the_process():
    core = available_cores()[-1]
    got = _run(
        f"import json, os, torch; from engine.worker.cpu_threads import apply_cpu_threads; "
        f"p = apply_cpu_threads(None, '{core}'); "
        f"print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads(), p.threads]))"
    )
    assert got == [[core], 1, 1]


def test_engine_start_logs_and_applies_the_thread_choice(tiny_llama, caplog):
    from engine.runtime.llm_engine import LLMEngine

    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="engine.worker.cpu_threads"):
            engine = LLMEngine.from_settings(
                EngineSettings(model=str(tiny_llama), enforce_eager=True, cpu_threads=1, max_model_len=256)
            )
        assert torch.get_num_threads() == 1
        assert engine.core.cpu_threads.threads == 1
        assert any("CPU threads: 1 compute thread" in r.getMessage() for r in caplog.records)
    finally:
        torch.set_num_threads(before)
    del engine
    assert apply_cpu_threads(before, "none").threads == before
