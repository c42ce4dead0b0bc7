"""`kiln serve-replicas`: N `kiln serve` processes behind sglang-router's cache-aware router.

kiln builds no cluster layer of its own: each replica is a plain `kiln serve` on a loopback
port, and sglang-router (pip install sglang-router) spreads requests over them, sending a
prompt to the replica whose prefix cache most likely holds its prefix. This module only
launches the processes, waits until they are healthy, and stops them all on Ctrl-C/SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from engine.config.process_env import child_environment

logger = logging.getLogger("engine.entrypoints.cli.replicas")

ROUTER_MODULE = "sglang_router.launch_router"
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
# Flags the launcher sets on every replica itself; given again they would silently fight.
OWNED_SERVE_FLAGS = ("--host", "--port", "--uds")


@dataclass
class ReplicaPlan:
    replicas: int = 2
    host: str = "0.0.0.0"  # the router's address; replicas always bind loopback
    port: int = 8000
    replica_port: int = 8100  # replica i listens on replica_port + i
    policy: str = "cache_aware"
    gpus: list[str] = field(default_factory=list)  # replica i sees gpus[i % len(gpus)]
    router_metrics_port: int = 29000
    router_args: list[str] = field(default_factory=list)
    serve_args: list[str] = field(default_factory=list)
    startup_timeout: float = 600.0
    one_at_a_time: bool = False  # start replica i+1 once i is healthy (replicas sharing a GPU)
    stop_timeout: float = 60.0
    log_dir: Path | None = None
    # The replicas' --api-key (flag, KILN_API_KEY or kiln.toml): the router sends it to them, for
    # /model_info when a replica registers and with every request it forwards.
    api_key: str | None = None

    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.replica_port + i}" for i in range(self.replicas)]

    def replica_command(self, i: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "engine.entrypoints.cli",
            "serve",
            *self.serve_args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.replica_port + i),
        ]

    def replica_env(self, i: int) -> dict[str, str]:
        """Environment additions for replica i (one GPU per replica when --gpus is given)."""
        return {"CUDA_VISIBLE_DEVICES": self.gpus[i % len(self.gpus)]} if self.gpus else {}

    def router_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            ROUTER_MODULE,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--worker-urls",
            *self.replica_urls(),
            "--policy",
            self.policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.router_metrics_port),
            # The router's default (60 s x 3 failures) keeps a dead replica listed for minutes;
            # --router-arg comes after this, so the user's value wins.
            "--health-check-interval-secs",
            "5",
            *(["--api-key", self.api_key] if self.api_key else []),
            *self.router_args,
        ]


def _die_with_launcher() -> None:
    """In the child before exec (Linux): SIGTERM it when the launcher dies, even by SIGKILL, so no
    replica keeps its GPU memory and no router outlives the launcher."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


class ReplicaSet:
    """The replica processes and the router in front of them."""

    def __init__(self, plan: ReplicaPlan):
        if plan.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {plan.replicas}")
        for flag in OWNED_SERVE_FLAGS:
            if any(a == flag or a.startswith(flag + "=") for a in plan.serve_args):
                raise ValueError(
                    f"{flag} is set by serve-replicas for each replica (router: --host/--port, "
                    f"replicas: --replica-port); do not pass it to the replicas"
                )
        if importlib.util.find_spec("sglang_router") is None:
            raise ValueError("serve-replicas needs the router: pip install sglang-router")
        self.plan = plan
        self.replicas: list[subprocess.Popen] = []
        self.router: subprocess.Popen | None = None
        self._logs: list = []
        self.stop_requested = lambda: False  # main() points this at its signal flag

    def _check_stop(self) -> None:
        if self.stop_requested():
            raise RuntimeError("stopped by a signal while starting")

    def _spawn(self, name: str, cmd: list[str], env_extra: dict[str, str]) -> subprocess.Popen:
        out = None
        if self.plan.log_dir is not None:
            self.plan.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.plan.log_dir / f"{name}.log", "ab")
            self._logs.append(out)
        env = child_environment(env_extra) if env_extra else None  # None: inherit the launcher's
        # Own session: the launcher decides the stop order (router first), not the terminal's Ctrl-C.
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            start_new_session=True,
            preexec_fn=_die_with_launcher if sys.platform == "linux" else None,
        )

    def start(self) -> None:
        plan = self.plan
        for i, url in enumerate(plan.replica_urls()):
            proc = self._spawn(f"replica{i}", plan.replica_command(i), plan.replica_env(i))
            self.replicas.append(proc)
            print(f"kiln serve-replicas: replica {i} pid {proc.pid} at {url}", flush=True)
            if plan.one_at_a_time:
                # Each replica profiles free GPU memory at start-up: one at a time, they see each other's use.
                self._wait_replicas_healthy(only=[i])
        self._wait_replicas_healthy()
        self.router = self._spawn("router", plan.router_command(), {})
        self._wait_router_ready()
        url = f"http://{_probe_host(plan.host)}:{plan.port}"
        print(
            f"kiln serve-replicas: router pid {self.router.pid} serving {plan.replicas} replicas at {url}/v1 "
            f"(policy {plan.policy}; router metrics http://127.0.0.1:{plan.router_metrics_port}/metrics)",
            flush=True,
        )

    def _wait_replicas_healthy(self, only: list[int] | None = None) -> None:
        deadline = time.monotonic() + self.plan.startup_timeout
        urls = self.plan.replica_urls()
        pending = {i: urls[i] for i in (range(len(self.replicas)) if only is None else only)}
        while pending:
            self._check_stop()
            for i, url in list(pending.items()):
                if self.replicas[i].poll() is not None:
                    raise RuntimeError(
                        f"replica {i} exited with status {self.replicas[i].returncode} while starting (see its log)"
                    )
                if _get(url + "/health")[0] == 200:
                    del pending[i]
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {sorted(pending)} not healthy after {self.plan.startup_timeout:.0f} s")
            if pending:
                time.sleep(0.5)

    def _wait_router_ready(self) -> None:
        deadline = time.monotonic() + min(self.plan.startup_timeout, 120.0)
        url = f"http://{_probe_host(self.plan.host)}:{self.plan.port}/readiness"
        while True:
            self._check_stop()
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited with status {self.router.returncode} while starting")
            status, body = _get(url)
            if status == 200 and json.loads(body or b"{}").get("healthy_workers") == self.plan.replicas:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("the router did not see every replica healthy in time")
            time.sleep(0.3)

    def watch(self, stop_requested) -> int:
        """Block until a stop is requested (0) or the router dies or every replica has (1)."""
        dead: set[int] = set()
        while not stop_requested():
            if self.router is not None and self.router.poll() is not None:
                logger.error("the router exited with status %s; stopping the replicas", self.router.returncode)
                return 1
            for i, proc in enumerate(self.replicas):
                if i not in dead and proc.poll() is not None:
                    dead.add(i)
                    # The router's health checks take it out of rotation; it is not restarted.
                    logger.error("replica %d (pid %d) exited with status %s", i, proc.pid, proc.returncode)
            if len(dead) == len(self.replicas):
                logger.error("every replica has exited")
                return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        """Router first (no new requests reach a draining replica), then every replica; SIGKILL if stuck."""
        for group in ([self.router] if self.router else [], self.replicas):
            live = [p for p in group if p.poll() is None]
            for p in live:
                p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.plan.stop_timeout
            for p in live:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("pid %d did not stop within %.0f s; killing it", p.pid, self.plan.stop_timeout)
                    p.kill()
                    p.wait()
        for f in self._logs:
            f.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln serve-replicas",
        allow_abbrev=False,
        description="Launch N `kiln serve` replicas on loopback ports and sglang-router in front of them. "
        "Every flag not listed here (MODEL, --max-model-len, --gpu-memory-utilization, ...) goes "
        "to each replica's `kiln serve`.",
    )
    parser.add_argument("--replicas", type=int, default=2, help="number of kiln serve processes (default: 2)")
    parser.add_argument("--host", default="0.0.0.0", help="the router's address (default: 0.0.0.0)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default: 8000)")
    parser.add_argument(
        "--replica-port", type=int, default=8100, help="replica i listens on 127.0.0.1:REPLICA_PORT+i (default: 8100)"
    )
    parser.add_argument(
        "--policy",
        default="cache_aware",
        choices=ROUTER_POLICIES,
        help="the router's policy (default: cache_aware, prefix-cache-aware)",
    )
    parser.add_argument(
        "--gpus",
        default="",
        help="comma-separated GPU ids; replica i gets "
        "CUDA_VISIBLE_DEVICES=GPUS[i %% len] (default: inherit; replicas share the GPUs)",
    )
    parser.add_argument(
        "--router-metrics-port",
        type=int,
        default=29000,
        help="the router's Prometheus port on 127.0.0.1 (default: 29000)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more flag for sglang-router, repeatable: --router-arg=--health-check-interval-secs=2",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=600.0,
        help="seconds to wait for the replicas to load and become healthy (default: 600)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="start each replica once the previous one is healthy (replicas sharing one GPU)",
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="write replicaN.log and router.log here (default: the launcher's own output)",
    )
    return parser


def plan_from_argv(argv: list[str], parse_serve_args=None) -> ReplicaPlan:
    """The plan for `kiln serve-replicas ARGV`; parse_serve_args (the CLI's `kiln serve` parser)
    resolves the replicas' settings, to learn the API key they will require."""
    args, serve_args = build_parser().parse_known_args(argv)
    return ReplicaPlan(
        replicas=args.replicas,
        host=args.host,
        port=args.port,
        replica_port=args.replica_port,
        policy=args.policy,
        gpus=[g for g in args.gpus.split(",") if g.strip()],
        router_metrics_port=args.router_metrics_port,
        router_args=list(args.router_arg),
        serve_args=serve_args,
        startup_timeout=args.startup_timeout,
        one_at_a_time=args.one_at_a_time,
        log_dir=args.log_dir,
        api_key=_replicas_api_key(serve_args, parse_serve_args),
    )


def _replicas_api_key(serve_args: list[str], parse_serve_args) -> str | None:
    """The API key the replicas will require, resolved as `kiln serve` resolves it."""
    if parse_serve_args is None:
        return None
    try:
        return parse_serve_args(serve_args)[1].api_key
    except (SystemExit, ValueError):  # a bad serve line: the replicas report it themselves
        return None


def main(argv: list[str], parse_serve_args=None) -> int:
    plan = plan_from_argv(argv, parse_serve_args)
    replica_set = ReplicaSet(plan)
    stop: list[int] = []
    replica_set.stop_requested = lambda: bool(stop)
    previous = {
        sig: signal.signal(sig, lambda signum, frame: stop.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        replica_set.start()
        status = replica_set.watch(replica_set.stop_requested)
    except RuntimeError as exc:
        print(f"kiln serve-replicas: error: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        replica_set.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"kiln serve-replicas: stopped (status {status})", flush=True)
    return status
