"""Compiling structured-output constraints with xgrammar, off the server's threads.

xgrammar's compile cannot be interrupted in a thread, and a pathological schema can take
minutes, so the server first compiles each new constraint in a bounded pool of worker processes
(`CompilePool`): a compile past its time limit, or whose client has gone, is stopped by killing
its process. One that finishes is compiled again in the server (StructuredOutputCompiler), as
long as it took there: handing the compiled grammar back would cost far more (xgrammar's only
format is JSON, 96 MB and 10 s for 500 properties). Offline use compiles inline with
`compile_with`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from engine.config.process_env import child_environment

logger = logging.getLogger(__name__)

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " (and "Check failed: ... is false: ").
_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed:.*? is false:\s*)?")


def compile_with(compiler: Any, entry: str, text: str, any_whitespace: bool) -> Any:
    if entry == "json":
        return compiler.compile_json_schema(text, any_whitespace=any_whitespace)
    if entry == "regex":
        return compiler.compile_regex(text)
    return compiler.compile_grammar(text)


def native_message(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or ["(no message)"]
    return _NATIVE_PREFIX.sub("", lines[0])


# The zygote runs one thread: nothing may hold a lock when it forks (OpenBLAS starts a pool as it
# loads unless told not to, and OpenMP one on first use): read by those libraries from its environment.
ZYGOTE_THREAD_LIMITS = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
# A compile's limit counts its worker's CPU time; its wall time may run to this many times the limit.
WALL_FACTOR = 4

Tenant = tuple[str, str]  # (who the client is: its address; a sub-key it chooses: OpenAI's `user`)


class _CompileJob:
    def __init__(self, source: tuple[str, str, bool], tenant: Tenant) -> None:
        self.source, self.tenant = source, tenant
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = threading.Event()  # the client left: stop the compile if it is running
        self.cpu_seconds: float | None = None  # what the worker's compile used (wall time where unknown)


def _die_with_parent() -> None:  # pragma: no cover - runs in the pool's processes
    """Linux: SIGKILL when the parent (thread) goes, even if the server is killed outright."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _zygote_main(control_fd: int) -> None:  # pragma: no cover - runs in the zygote
    """The workers' parent (`python -m engine.structured_output.compile_pool FD`): imports xgrammar
    (seconds: it loads torch) and reads the tokenizer's info once, single-threaded, then forks a
    worker per b"fork" on its control socket (handing back the worker's pid and socket) and
    kills one per b"kill PID" (only its own live children: a pid is never reused while the
    zygote has not reaped it)."""
    _die_with_parent()
    os.nice(5)  # (it and its workers yield the cores to serving, e.g. while it loads at start-up)
    import xgrammar

    control = socket.socket(fileno=control_fd)
    lines = control.makefile("rb")
    info = xgrammar.TokenizerInfo.deserialize_json(json.loads(lines.readline()))
    control.sendall(b"ready\n")
    children: set[int] = set()
    for line in lines:
        _reap(children, block=False)
        command, _, arg = line.decode().strip().partition(" ")
        if command == "kill":
            pid = int(arg)
            if pid in children:
                os.kill(pid, signal.SIGKILL)
                _reap(children, pid)
            control.sendall(b"killed\n")
            continue
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            for f in (ours, lines, control):  # (the worker holds its own socket only)
                f.close()
            _worker_main(theirs, info)
            os._exit(0)
        theirs.close()
        children.add(pid)
        socket.send_fds(control, [str(pid).encode()], [ours.fileno()])
        ours.close()


def _reap(children: set[int], pid: int = -1, block: bool = True) -> None:  # pragma: no cover - in the zygote
    while children:
        try:
            done, _ = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            return
        children.discard(done)
        if pid != -1:
            return


def _worker_main(sock: socket.socket, info: Any) -> None:  # pragma: no cover - runs in a worker
    """A compile worker (forked by the zygote): one job per line in, one answer per line out (JSON)."""
    _die_with_parent()
    import xgrammar

    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = sock.makefile("w", encoding="utf-8")
    for line in sock.makefile("r", encoding="utf-8"):
        entry, text, any_whitespace = json.loads(line)
        try:
            compile_with(compiler, entry, text, any_whitespace)
            answer = ["ok", ""]  # (it compiles in time: the server compiles it again itself)
        except Exception as exc:  # noqa: BLE001 - the constraint's fault: handed back
            answer = ["error", native_message(exc)]
        out.write(json.dumps(answer) + "\n")
        out.flush()


class _Zygote:
    """The parent's handle on the zygote process (started on first use, restarted if it dies):
    a worker costs a fork, not a fresh interpreter importing torch (seconds of CPU, paid again
    after every compile that had to be killed)."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._shut = False

    def fork(self) -> tuple[int, socket.socket]:
        """(pid, socket) of a new worker."""
        with self._lock:
            for _ in range(2):  # (a zygote that died is replaced once)
                if self._shut:
                    break
                try:
                    self._ensure()
                    self._control.sendall(b"fork\n")
                    message, fds, _, _ = socket.recv_fds(self._control, 64, 1)
                    if message and fds:
                        return int(message), socket.socket(fileno=fds[0])
                except OSError:
                    pass
                self.close()
        raise RuntimeError("the grammar compile workers' parent process failed")

    def kill(self, pid: int) -> None:
        with self._lock:
            if self._control is None:
                return  # (gone: its workers died with it)
            try:
                self._control.sendall(f"kill {pid}\n".encode())
                self._control.recv(64)
            except OSError:
                self.close()

    def _ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        ours, theirs = socket.socketpair()
        # (no prepare_process there: it runs one OpenMP thread, and inherits this process's settings)
        env = child_environment(ZYGOTE_THREAD_LIMITS)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.structured_output.compile_pool", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self._control = ours
        if self._shut:  # (shut down while it started: close() may have missed it; fork() closes it now)
            raise OSError("the grammar compile pool is closing")
        ours.settimeout(120.0)
        ours.sendall((json.dumps(self._info) + "\n").encode())
        if ours.recv(16) != b"ready\n":
            raise OSError("the grammar compile workers' parent did not start")
        ours.settimeout(30.0)

    def close(self) -> None:
        """Kill the zygote (its workers die with it); the next fork starts another."""
        proc, self.proc = self.proc, None
        control, self._control = self._control, None
        if proc is not None:
            proc.kill()
            proc.wait(10)
        if control is not None:
            try:
                control.shutdown(socket.SHUT_RDWR)  # (wakes a thread waiting on it)
            except OSError:
                pass
            control.close()

    def shutdown(self) -> None:
        """close(), for good (the pool is closing)."""
        self._shut = True
        self.close()


class _Worker:
    """One compile process, forked by the zygote, driven by one thread of the parent."""

    def __init__(self, zygote: _Zygote) -> None:
        self._zygote = zygote
        self.pid: int | None = None
        self._sock: socket.socket | None = None
        self._reader = None
        self.job: _CompileJob | None = None  # what it compiles now

    def ensure(self) -> None:
        if self._sock is None:
            self.pid, self._sock = self._zygote.fork()
            self._reader = self._sock.makefile("r", encoding="utf-8")

    def send(self, item: Any) -> None:
        self._sock.sendall((json.dumps(item) + "\n").encode())

    def ready(self, timeout: float) -> bool:
        return bool(select.select([self._sock], [], [], timeout)[0])

    def read(self, timeout: float) -> Any:
        """The next answer; None on timeout or if the worker died (its socket ends)."""
        if not self.ready(timeout):
            return None
        line = self._reader.readline()
        return json.loads(line) if line else None

    @property
    def alive(self) -> bool:
        return self._sock is not None

    def cpu_seconds(self) -> float | None:
        """CPU time the worker has used (Linux /proc); None where that cannot be read."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
            return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
        except (OSError, ValueError, IndexError, TypeError):
            return None

    def kill(self) -> None:
        pid, sock, reader = self.pid, self._sock, self._reader
        self.pid = self._sock = self._reader = None
        if pid is not None:
            self._zygote.kill(pid)
        for f in (reader, sock):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


class CompilePool:
    """A bounded set of compile processes. A compile that runs past `timeout_s`, or whose client
    has gone, is stopped by killing its process (xgrammar's compile cannot be interrupted in a
    thread); the worker is replaced.

    Fairness keys on what a client cannot multiply: its address. Jobs are taken round-robin
    across addresses, and within one address round-robin across its `user` sub-keys (which it
    chooses freely, so they only share out that address's turn); and one address never holds more
    than workers - 1 workers, so a pile of pathological constraints from one client leaves
    another client a worker at once (at the price of one worker for a client alone). An address
    may queue at most `max_queued_per_client` compiles (more are refused at once, CompileQueueFull):
    the queue, and the memory it holds, stays bounded whatever one client sends."""

    def __init__(
        self, tokenizer_info_json: str, workers: int, timeout_s: float, max_queued_per_client: int = 8
    ) -> None:
        self.timeout_s = timeout_s
        self.max_queued_per_client = max_queued_per_client
        self._info = tokenizer_info_json
        # address -> user -> queued jobs; both levels in round-robin order
        self._queues: collections.OrderedDict[str, collections.OrderedDict[str, collections.deque[_CompileJob]]] = (
            collections.OrderedDict()
        )
        self._running: collections.Counter[str] = collections.Counter()  # address -> compiles running
        self._cond = threading.Condition()
        self._stopped = False
        self._zygote = _Zygote(tokenizer_info_json)
        self._workers = [_Worker(self._zygote) for _ in range(workers)]
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), daemon=True, name="kiln-grammar-pool")
            for w in self._workers
        ]
        for t in self._threads:
            t.start()

    def submit(self, source: tuple[str, str, bool], tenant: Tenant = ("", "")) -> _CompileJob:
        job = _CompileJob(source, tenant)
        with self._cond:
            if self._stopped:
                job.future.set_exception(CompileFailed("stopped", "the compile pool was closed"))
                return job
            address, user = tenant
            queued = sum(len(q) for q in self._queues.get(address, {}).values())
            if queued >= self.max_queued_per_client:
                raise CompileQueueFull(
                    f"structured output: this client already has {queued} constraints waiting to "
                    f"compile (grammar_compile_queue_per_client={self.max_queued_per_client}); retry "
                    "when they are done"
                )
            users = self._queues.setdefault(address, collections.OrderedDict())
            users.setdefault(user, collections.deque()).append(job)
            self._cond.notify()
        return job

    def _may_start(self, address: str) -> bool:
        """One worker is always left to the other addresses (when there are two or more)."""
        return self._running[address] < max(1, len(self._workers) - 1)

    def _next(self) -> _CompileJob | None:
        """The next job in round-robin order (called with a worker free); counted as running."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                for address in list(self._queues):
                    if not self._may_start(address):
                        continue
                    users = self._queues.pop(address)
                    user, queue = users.popitem(last=False)
                    job = queue.popleft()
                    if queue:
                        users[user] = queue  # to the back of this address's round
                    if users:
                        self._queues[address] = users  # to the back of the round
                    if job.future.set_running_or_notify_cancel():
                        self._running[address] += 1
                        return job
                    break  # (a cancelled job: look again from the front)
                else:
                    self._cond.wait()

    def _done(self, job: _CompileJob) -> None:
        with self._cond:
            self._running[job.tenant[0]] -= 1
            if self._running[job.tenant[0]] <= 0:
                del self._running[job.tenant[0]]
            self._cond.notify_all()  # (an address held back by its share may go now)

    def _serve(self, worker: _Worker) -> None:
        while True:
            try:
                worker.ensure()  # a replacement starts at once, not on the next job
            except Exception:  # noqa: BLE001 - retried (and reported) on the next job
                if not self._stopped:
                    logger.exception("could not start a grammar compile worker")
            job = self._next()
            if job is None:
                worker.kill()
                return
            try:
                status, payload = self._run(worker, job)
            except Exception as exc:  # noqa: BLE001 - a broken worker fails this job only
                logger.exception("grammar compile worker failed")
                worker.kill()
                status, payload = "error", f"the compiler failed ({type(exc).__name__})"
            finally:
                self._done(job)
            if status == "ok":
                job.future.set_result(payload)
            else:
                job.future.set_exception(CompileFailed(status, payload))

    def _run(self, worker: _Worker, job: _CompileJob) -> tuple[str, str]:
        worker.job = job
        try:
            return self._compile(worker, job)
        finally:
            worker.job = None

    def _compile(self, worker: _Worker, job: _CompileJob) -> tuple[str, str]:
        """The limit counts the worker's CPU time, so that a busy machine (the worker waiting
        for a core) does not turn an ordinary constraint into a refused one; a worker that gets
        no CPU at all is stopped after WALL_FACTOR times the limit."""
        worker.ensure()
        start, cpu0 = time.monotonic(), worker.cpu_seconds()
        worker.send(list(job.source))

        def used() -> float:
            cpu = worker.cpu_seconds()
            job.cpu_seconds = time.monotonic() - start if cpu is None or cpu0 is None else cpu - cpu0
            return job.cpu_seconds

        while not worker.ready(0.05):
            if job.cancelled.is_set() or self._stopped:
                worker.kill()
                return ("stopped" if self._stopped else "cancelled"), "the request went away"
            if used() > self.timeout_s or time.monotonic() - start > WALL_FACTOR * self.timeout_s:
                worker.kill()
                return "timeout", ""
        used()
        answer = worker.read(0)
        if answer is None:  # it died (its socket ended)
            worker.kill()
            if self._stopped:  # (killed with the pool)
                return "stopped", "the compile pool was closed"
            return "error", "the compiler crashed on this constraint"
        return answer[0], answer[1]

    @property
    def busy(self) -> int:
        """Workers compiling right now."""
        return sum(1 for w in self._workers if w.job is not None)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            for users in self._queues.values():
                for job in (job for queue in users.values() for job in queue):
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(CompileFailed("stopped", "the compile pool was closed"))
            self._queues.clear()
            self._cond.notify_all()
        self._zygote.shutdown()  # running or starting workers die with it (their threads then exit)
        for t in self._threads:
            t.join(5)


class CompileQueueFull(RuntimeError):
    """One client has as many constraints queued as it may (the server answers 429)."""


class CompileCancelled(RuntimeError):
    """The compile pool was closed (the server is stopping) before the constraint compiled."""


class CompileFailed(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


if __name__ == "__main__":  # the zygote of a CompilePool
    _zygote_main(int(sys.argv[1]))
