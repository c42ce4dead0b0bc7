"""Two kiln replicas behind sglang-router (`kiln serve-replicas`), on loopback, CPU only.

One launch serves the whole module, in order: many requests through the router with the
official openai client; a long shared prefix lands on one replica (its prefix-cache hits
show it); a replica killed mid-run leaves the router sending only to the survivor; SIGTERM to
the launcher stops the router and every replica.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import sglang_router  # noqa: F401  (the test extra installs it; missing, this file fails loudly)

REPO = Path(__file__).resolve().parents[2]
MODEL = "tiny"
NUM_REQUESTS = 200
API_KEY = "replica-secret"  # the replicas require it; serve-replicas hands it to the router


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _free_consecutive_ports(n: int) -> int:
    """A base port whose next n ports are free (replicas listen on base + i)."""
    for _ in range(50):
        base = _free_ports(1)[0]
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free consecutive ports")


def _metric(url: str, name: str) -> float:
    """Sum of a kiln metric over its label sets, read from a replica's /metrics (behind the key)."""
    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _get_json(url: str):
    import json

    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.loads(resp.read())


class Cluster:
    def __init__(self, proc, router_url, replicas):
        self.proc, self.router_url, self.replicas = proc, router_url, replicas  # replicas: [(pid, url)]
        self.client = openai.OpenAI(base_url=router_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def complete(self, prompt: str, max_tokens: int = 4):
        return self.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    router_port, metrics_port = _free_ports(2)
    replica_port = _free_consecutive_ports(2)
    log_dir = tmp_path_factory.mktemp("replica-logs")
    cmd = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "serve-replicas",
        "--replicas",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(router_port),
        "--replica-port",
        str(replica_port),
        "--router-metrics-port",
        str(metrics_port),
        "--log-dir",
        str(log_dir),
        "--startup-timeout",
        "120",
        "--one-at-a-time",
        "--router-arg=--health-check-interval-secs=1",
        "--router-arg=--log-level=warn",
        str(tiny_llama),
        "--served-model-name",
        MODEL,
        "--device",
        "cpu",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--api-key",
        API_KEY,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "router pid" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(150):
        _stop_launcher(proc, lines)
        logs = "".join(p.read_text()[-2000:] for p in log_dir.glob("*.log"))
        pytest.fail("serve-replicas did not come up:\n" + "".join(lines) + logs)
    replicas = [
        (int(m.group(1)), m.group(2)) for line in lines if (m := re.search(r"replica \d+ pid (\d+) at (\S+)", line))
    ]
    assert len(replicas) == 2
    c = Cluster(proc, f"http://127.0.0.1:{router_port}", replicas)
    c.lines = lines
    yield c
    _stop_launcher(proc, lines)


def _stop_launcher(proc, lines: list[str]) -> None:
    """After a failed test: SIGTERM (the launcher stops the router and replicas), SIGKILL as a last resort."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
        return
    except subprocess.TimeoutExpired:
        proc.kill()
    # The children live in their own sessions: the launcher's death does not end them.
    for line in lines:
        if m := re.search(r"(?:replica \d+|router) pid (\d+)", line):
            try:
                os.kill(int(m.group(1)), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_plan_from_argv_splits_launcher_and_replica_flags():
    from engine.entrypoints.cli.main import parse_serve_args
    from engine.entrypoints.cli.replicas import ReplicaPlan, ReplicaSet, plan_from_argv

    plan = plan_from_argv(
        [
            "--replicas",
            "3",
            "--port",
            "9000",
            "--replica-port",
            "9100",
            "--gpus",
            "0,1",
            "/models/x",
            "--max-model-len",
            "4k",
            "--router-arg=--health-check-interval-secs=2",
        ]
    )
    assert plan.serve_args == ["/models/x", "--max-model-len", "4k"]
    assert plan.replica_urls() == ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]
    assert plan.replica_command(2)[1:7] == [
        "-m",
        "engine.entrypoints.cli",
        "serve",
        "/models/x",
        "--max-model-len",
        "4k",
    ]
    assert plan.replica_command(2)[-4:] == ["--host", "127.0.0.1", "--port", "9102"]
    assert [plan.replica_env(i) for i in range(3)] == [{"CUDA_VISIBLE_DEVICES": g} for g in ("0", "1", "0")]
    router = plan.router_command()
    assert router[router.index("--worker-urls") + 1 : router.index("--policy")] == plan.replica_urls()
    assert router[-1] == "--health-check-interval-secs=2" and router[router.index("--port") + 1] == "9000"
    assert "--api-key" not in router
    keyed = plan_from_argv(["/models/x", "--api-key", "k1"], parse_serve_args).router_command()
    assert keyed[keyed.index("--api-key") + 1] == "k1"  # the replicas' key, for the router to send
    with pytest.raises(ValueError, match="--port is set by serve-replicas"):
        ReplicaSet(ReplicaPlan(serve_args=["/models/x", "--port=8001"]))
    with pytest.raises(ValueError, match="at least 1"):
        ReplicaSet(ReplicaPlan(replicas=0))


def test_router_lists_the_replicas_model(cluster):
    # The router learns the served name from each replica's /server_info and /model_info.
    assert [m.id for m in cluster.client.models.list().data] == [MODEL]
    workers = _get_json(cluster.router_url + "/workers")["workers"]
    assert sorted(w["url"] for w in workers) == sorted(url for _, url in cluster.replicas)
    assert all(w["model_id"] == MODEL and w["is_healthy"] for w in workers)
    # The key the replicas require is the router's too: a client without it is refused.
    with openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="wrong", max_retries=0, timeout=30) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_streaming_chat_through_router(cluster):
    stream = cluster.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) >= 1


def test_many_requests_through_router_all_complete(cluster):
    before = [_metric(url, "kiln:request_success_total") for _, url in cluster.replicas]
    # Unrelated openings: cache_aware sends prompts sharing most of their text to one replica by
    # design, and spreads prompts with no cached prefix to the replica with the smaller tree.
    prompts = [_distinct("many", i) for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(cluster.complete, prompts))
    assert len(results) == NUM_REQUESTS
    for r in results:
        assert r.choices[0].finish_reason in ("length", "stop")
        assert r.usage.completion_tokens >= 1
    after = [_metric(url, "kiln:request_success_total") for _, url in cluster.replicas]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == NUM_REQUESTS
    assert min(served) > 0, f"the router used only one replica: {served}"


def test_shared_long_prefix_lands_on_one_replica(cluster):
    prefix = " ".join(f"clause {i} of the shared system prompt says something long;" for i in range(10))
    before = [
        (_metric(url, "kiln:request_success_total"), _metric(url, "kiln:prefix_cache_hits_total"))
        for _, url in cluster.replicas
    ]
    n = 8
    for i in range(n):  # one at a time: the router's load-balancing override never triggers
        cluster.complete(prefix + f" question {i}?", max_tokens=2)
    after = [
        (_metric(url, "kiln:request_success_total"), _metric(url, "kiln:prefix_cache_hits_total"))
        for _, url in cluster.replicas
    ]
    served = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [a[1] - b[1] for a, b in zip(after, before)]
    assert sorted(served) == [0, n], f"requests per replica: {served}"
    home = served.index(n)
    # Every request after the first reuses the prefix's cached blocks on that replica (16-token blocks).
    assert hits[home] >= (n - 1) * 16, hits
    assert hits[1 - home] == 0, hits


def _distinct(tag: str, i: int) -> str:
    return f"{hashlib.sha1(f'{tag}{i}'.encode()).hexdigest()[:16]} {tag} request {i} says"


def test_killed_replica_leaves_rotation_and_later_requests_succeed(cluster):
    (victim_pid, victim_url), (_, survivor_url) = cluster.replicas[1], cluster.replicas[0]
    victim_before = _metric(victim_url, "kiln:request_success_total")
    failures: list[Exception] = []

    def one(prompt):
        try:
            return cluster.complete(prompt, max_tokens=32)
        except openai.APIError as exc:  # in flight on the killed replica: an error, never a hang
            failures.append(exc)
            return None

    with ThreadPoolExecutor(8) as pool:
        first = list(pool.map(one, [_distinct("before", i) for i in range(16)]))
        assert _metric(victim_url, "kiln:request_success_total") > victim_before, "the victim got no traffic"
        # Kill the victim while the next batch is in flight on both replicas.
        batch = [pool.submit(one, _distinct("during", i)) for i in range(40)]
        time.sleep(0.5)
        os.kill(victim_pid, signal.SIGKILL)
        during = [f.result() for f in batch]
    assert all(r is not None for r in first)
    done = [r for r in during if r is not None]
    # sglang-router retries a failed request on another worker; what it cannot retry fails fast.
    print(f"mid-run: {len(done)} of {len(during)} completed, {len(failures)} failed around the kill")
    assert len(done) + len(failures) == len(during)

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = _get_json(cluster.router_url + "/readiness")
        if ready.get("healthy_workers") == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"the router still counts the killed replica healthy: {ready}")

    before = _metric(survivor_url, "kiln:request_success_total")
    with ThreadPoolExecutor(8) as pool:
        later = list(pool.map(cluster.complete, [_distinct("after", i) for i in range(30)]))
    assert all(r.choices[0].finish_reason in ("length", "stop") for r in later)
    assert _metric(survivor_url, "kiln:request_success_total") - before == 30


def test_sigterm_stops_router_and_replicas(cluster):
    proc = cluster.proc
    assert proc.poll() is None, "the launcher exited while one replica still served"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    router_pid = int(re.search(r"router pid (\d+)", "".join(cluster.lines)).group(1))
    for pid in [p for p, _ in cluster.replicas] + [router_pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    with pytest.raises(OSError):
        urllib.request.urlopen(cluster.router_url + "/health", timeout=2)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_killed_launcher(tmp_path):
    # A launcher killed by SIGKILL cannot stop its children; the kernel must (no orphaned replica on the GPU).
    script = tmp_path / "launcher.py"
    script.write_text(
        "import sys, time\n"
        "from engine.entrypoints.cli.replicas import ReplicaPlan, ReplicaSet\n"
        "p = ReplicaSet(ReplicaPlan())._spawn('x', ['sleep', '300'], {})\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(launcher.stdout.readline())
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":  # dead, waiting for its new parent to reap it
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the launcher's child outlived it")
