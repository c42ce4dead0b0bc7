"""Compiling structured-output constraints with xgrammar, off the server's threads.

xgrammar's compile cannot be interrupted in a thread, and a pathological schema can take
minutes, so the server compiles in a bounded pool of worker processes (`CompilePool`): a compile
past its time limit, or whose client has gone, is stopped by killing its process. Offline use
compiles inline with `compile_with`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any

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


class _CompileJob:
    def __init__(self, source: tuple[str, str, bool], tenant: str) -> None:
        self.source, self.tenant = source, tenant
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.cancelled = threading.Event()  # the client left: stop the compile if it is running


def _worker_main() -> None:  # pragma: no cover - runs in a worker process
    """A compile worker (`python -m engine.structured_output.compile_pool`): the tokenizer's info on the first
    line of stdin, then one job per line in, one answer per line out (JSON)."""
    import signal
    import sys

    try:  # Linux: die with the parent's pool thread, even if the server is killed outright
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    import xgrammar

    info = xgrammar.TokenizerInfo.deserialize_json(json.loads(sys.stdin.readline()))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out = sys.stdout
    out.write('["ready", ""]\n')
    out.flush()
    for line in sys.stdin:
        entry, text, any_whitespace = json.loads(line)
        try:
            answer = ["ok", compile_with(compiler, entry, text, any_whitespace).serialize_json()]
        except Exception as exc:  # noqa: BLE001 - the constraint's fault: handed back
            answer = ["error", native_message(exc)]
        out.write(json.dumps(answer) + "\n")
        out.flush()


class _Worker:
    """One compile process (a fresh interpreter: never a fork of a process that runs threads),
    driven by one thread of the parent."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self.proc: subprocess.Popen | None = None
        self.job: _CompileJob | None = None  # what it compiles now

    def ensure(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.structured_output.compile_pool"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, bufsize=1 << 16)
        self.send(self._info)
        if self.read(120.0) != ["ready", ""]:
            self.kill()
            raise RuntimeError("the grammar compile worker did not start")

    def send(self, item: Any) -> None:
        self.proc.stdin.write(json.dumps(item) + "\n")
        self.proc.stdin.flush()

    def ready(self, timeout: float) -> bool:
        return bool(select.select([self.proc.stdout], [], [], timeout)[0])

    def read(self, timeout: float) -> Any:
        if not self.ready(timeout):
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(10)
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass


class CompilePool:
    """A bounded set of compile processes. A compile that runs past `timeout_s`, or whose client
    has gone, is stopped by killing its process (xgrammar's compile cannot be interrupted in a
    thread); the worker is replaced. Jobs are taken round-robin across tenants, so one tenant's
    pile of pathological constraints delays another tenant by at most one compile per worker."""

    def __init__(self, tokenizer_info_json: str, workers: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._info = tokenizer_info_json
        self._queues: collections.OrderedDict[str, collections.deque[_CompileJob]] = collections.OrderedDict()
        self._cond = threading.Condition()
        self._stopped = False
        self._workers = [_Worker(tokenizer_info_json) for _ in range(workers)]
        self._threads = [threading.Thread(target=self._serve, args=(w,), daemon=True, name="kiln-grammar-pool")
                         for w in self._workers]
        for t in self._threads:
            t.start()

    def submit(self, source: tuple[str, str, bool], tenant: str = "") -> _CompileJob:
        job = _CompileJob(source, tenant)
        with self._cond:
            if self._stopped:
                job.future.set_exception(CompileFailed("stopped", "the compile pool was closed"))
                return job
            self._queues.setdefault(tenant, collections.deque()).append(job)
            self._cond.notify()
        return job

    def _next(self) -> _CompileJob | None:
        with self._cond:
            while True:
                if self._stopped:
                    return None
                for tenant in list(self._queues):
                    queue = self._queues.pop(tenant)
                    job = queue.popleft()
                    if queue:
                        self._queues[tenant] = queue  # to the back of the round
                    if job.future.set_running_or_notify_cancel():
                        return job
                if not self._queues:
                    self._cond.wait()

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
        worker.ensure()
        worker.send(list(job.source))
        deadline = time.monotonic() + self.timeout_s
        while not worker.ready(0.05):
            if job.cancelled.is_set() or self._stopped:
                worker.kill()
                return ("stopped" if self._stopped else "cancelled"), "the request went away"
            if time.monotonic() > deadline:
                worker.kill()
                return "timeout", ""
            if not worker.alive:
                worker.kill()
                return "error", "the compiler crashed on this constraint"
        answer = worker.read(0)
        if answer is None:  # it died while answering
            worker.kill()
            return "error", "the compiler crashed on this constraint"
        return answer[0], answer[1]

    @property
    def busy(self) -> int:
        """Workers compiling right now."""
        return sum(1 for w in self._workers if w.job is not None)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            for queue in self._queues.values():
                for job in queue:
                    if job.future.set_running_or_notify_cancel():
                        job.future.set_exception(CompileFailed("stopped", "the compile pool was closed"))
            self._queues.clear()
            self._cond.notify_all()
        for w in self._workers:  # running or starting: stop now (their threads then exit)
            proc = w.proc
            if proc is not None:
                proc.kill()
        for t in self._threads:
            t.join(5)


class CompileCancelled(RuntimeError):
    """The compile pool was closed (the server is stopping) before the constraint compiled."""


class CompileFailed(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


if __name__ == "__main__":  # a compile worker of CompilePool
    _worker_main()
