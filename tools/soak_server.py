"""Hardening soak: every hostile-input probe of issue 39 through one `kiln serve` process, round
after round, beside well-formed traffic; then 0 5xx, 0 KV blocks in use, RSS within 5% of its
level after the warm-up rounds (both read with no request in flight and no block in use).

    python tools/soak_server.py [--duration 600] [--model DIR] [--log /tmp/soak.log]

One round, all at once: greedy streams (checked token for token against the idle server's
answers), streams their clients drop half-way, auth probes (no key, a wrong key, with and
without --root-path's prefix: every one a 401), oversized bodies (240,000 tools, 100,000 stop
strings with n=32, a 99,000-object body under the object cap: 400s), malformed and invalid
requests (each a 4xx), six slow schemas from one
address under six forged X-Forwarded-For values and six `user`s while another address
(127.0.0.2) asks for a small regex (it waits at most one compile; then the first slow schema's
400 and the other five clients leave, their compiles stopped), LoRA path probes (the same
400 for every path), and streams whose clients stop reading (they pause: still running when a
fast reader of the same length has long finished) and then read them to the end (every token
arrives). `flood_gaps` measures /health's slowest answer and another stream's longest gap while
floods of large bodies arrive (the tool prints them against the quiet baseline; the strict
0.25 s bound is the tool's, tests/entrypoints/test_server_soak.py checks a looser one on the same
server as the rest of its soak).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script from the checkout)

from tests.support.server import ROOT as ROOT_DIR  # noqa: E402
from tests.support.server import launch_server, stop_server  # noqa: E402

KEY = "soak-key"
ROOT = "/api"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPILE_TIMEOUT_S = 1.0
STALL_S = 30.0  # (the tool's; the CI test's server uses a shorter one: at least PAUSE_LOOK_S * 3)
PAUSE_LOOK_S = 2.5  # the longest the pausing probe leaves its streams unread before it looks
PAUSING_TOKENS = 400  # (enough to fill the small socket buffers, then 64 unread: they pause)
PROMPTS = ["The cat", "Once upon a time", "def main():", "1, 2, 3,", "Hello there", "Paris is"]


def server_flags(lora_root: Path, stall_s: float = STALL_S) -> list[str]:
    return [
        "--api-key", KEY, "--root-path", ROOT, "--served-model-name", "m",
        "--max-model-len", "1024", "--max-num-seqs", "96", "--num-gpu-blocks", "2560",
        "--grammar-compile-timeout-s", str(COMPILE_TIMEOUT_S), "--grammar-compile-workers", "2",
        "--stream-stall-timeout-s", str(stall_s), "--stream-pause-tokens", "64", "--http-send-buffer-kb", "16",
        "--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating",
        "--lora-adapter-roots", str(lora_root), "--log-level", "warning",
    ]  # fmt: skip


def start(model_dir: Path, work: Path, stall_s: float = STALL_S, tree: Path | None = None):
    """(process, url) of a `kiln serve` with the soak's flags (its log in work/server.log), from
    the checkout `tree` (default: this one)."""
    (work / "adapters").mkdir(parents=True, exist_ok=True)
    flags = server_flags(work / "adapters", stall_s)
    return launch_server(model_dir, work / "server.log", *flags, cwd=tree or ROOT_DIR)


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def gauges(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    names = ("kiln:num_requests_running", "kiln:num_requests_waiting", "kiln:num_kv_blocks_in_use")
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in names}


def wait_idle(url: str, timeout: float = 60.0) -> None:
    wait_for(lambda: not any(gauges(url).values()), timeout, 0.1, lambda: str(gauges(url)))


def wait_for(pred, timeout: float, step: float = 0.05, show=lambda: "") -> float:
    """Seconds until pred() holds (an AssertionError, with show(), past `timeout`)."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not so after {timeout:g}s: {show()}")
        time.sleep(step)
    return time.monotonic() - t0


def aborted_requests(url: str) -> float:
    """Requests the server has ended as aborted (its client gone or stalled)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "kiln:request_success_total" and s.labels.get("finished_reason") == "abort"
    )


# ---- the bodies ----
def tools_body(count: int) -> bytes:
    tool = b'{"type": "function", "function": {"name": "f", "parameters": {}}}'  # (240,000: 13 MB, as in the issue)
    return (
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": ['
        + b",".join([tool] * count)
        + b"]}"
    )


def stops_body(count: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", "n": 32, "stop": [f"<s{i:06d}>" for i in range(count)]}).encode()


FLOODS = {  # name -> (path, body): each a 400
    "240k tools": ("/v1/chat/completions", tools_body(240_000)),
    "100k stop strings n=32": ("/v1/completions", stops_body(100_000)),
    "99k objects (33k tools)": ("/v1/chat/completions", tools_body(33_000)),
}


# ---- flood: /health and another stream while large bodies arrive ----
def flood_gaps(url: str, bodies: list[tuple[str, bytes]], copies: int) -> tuple[float, float, list[int]]:
    """(another stream's longest gap between chunks, /health's slowest answer, the bodies'
    statuses) while `copies` clients each post every body in turn (none: a quiet baseline of
    the same length, ~2 s)."""
    arrivals: list[float] = []
    health: list[tuple[float, float]] = []  # (asked at, seconds to answer)
    done = threading.Event()
    statuses: list[int] = []

    def stream() -> None:
        body = {"model": "m", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                if done.is_set():
                    break

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:  # (one connection: the server's time)
            while not done.is_set():
                asked = time.monotonic()
                http.get("/health")
                health.append((asked, time.monotonic() - asked))
                time.sleep(0.02)

    def post_all() -> None:
        with httpx.Client(base_url=url, headers={**AUTH, "content-type": "application/json"}, timeout=120) as http:
            for path, body in bodies:
                statuses.append(http.post(path, content=body).status_code)

    side = [threading.Thread(target=stream), threading.Thread(target=probe)]
    for t in side:
        t.start()
    deadline = time.monotonic() + 60
    while len(arrivals) < 5 or not health:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)
    t0 = time.monotonic()
    posters = [threading.Thread(target=post_all) for _ in range(copies)]
    for t in posters:
        t.start()
    for t in posters:
        t.join(120)
    time.sleep(max(0.0, 2.0 - (time.monotonic() - t0)) + 0.3)
    done.set()
    for t in side:
        t.join(60)
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0]
    return max(window), max(took for asked, took in health if asked + took >= t0), statuses


# ---- one soak round ----
@dataclass
class Round:
    statuses: list[int] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    small_regex_wait: float = 0.0
    paused_still_running: bool = True
    unread_tokens: list[int] = field(default_factory=list)


async def _greedy(http: httpx.AsyncClient, i: int, out: Round) -> tuple[str, str]:
    i %= 3 * len(PROMPTS)  # (one of the idle server's answers)
    prompt, max_tokens = PROMPTS[i % len(PROMPTS)], 4 + (i * 7) % 29
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = ""
    async with http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as resp:
        out.statuses.append(resp.status_code)
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                text += choices[0]["text"] if choices else ""
    return f"{prompt}|{max_tokens}", text


async def _dropped(http: httpx.AsyncClient, i: int, out: Round) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": 300}
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "ignore_eos": True}) as resp:
        out.statuses.append(resp.status_code)
        keep = 1 + i % 7
        async for _ in resp.aiter_lines():
            keep -= 1
            if keep == 0:
                break  # (leaving the block closes the connection half-way)


async def _auth_probes(url: str, out: Round) -> list[int]:
    """Every one must be a 401: no key or a wrong one, with and without the root path's prefix."""
    codes = []
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for prefix in ("", ROOT):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
                for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/model_info")):
                    resp = await http.request(method, prefix + path, headers=headers, json={"prompt": "hi"})
                    codes.append(resp.status_code)
    out.statuses += codes
    return codes


async def _floods(http: httpx.AsyncClient, out: Round) -> None:
    for path, body in FLOODS.values():
        resp = await http.post(path, content=body, headers={"content-type": "application/json"})
        out.statuses.append(resp.status_code)


BAD_REQUESTS = [  # (path, body): each must be a 4xx
    ("/v1/completions", b'{"model": "m", "prompt": "' + b"a" * (2 << 20) + b'"}'),  # (longer than max_model_len)
    ("/v1/chat/completions", '{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}'.encode()),
    ("/v1/completions", b'{"model": "m", "prompt": "hi", "max_tokens": ,}'),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "temperature": -1}).encode()),
    ("/v1/completions", json.dumps({"model": "m", "prompt": "hi", "max_tokens": 10**6}).encode()),
    ("/v1/embeddings", json.dumps({"model": "nope", "input": "hi"}).encode()),
]


async def _bad_requests(http: httpx.AsyncClient, out: Round) -> None:
    for path, body in BAD_REQUESTS:
        resp = await http.post(path, content=body, headers={"content-type": "application/json"})
        out.statuses.append(resp.status_code)
        if not 400 <= resp.status_code < 500:
            out.mismatches.append(f"a bad request to {path} answered {resp.status_code}: {resp.text[:200]}")


def _slow_schema(tag: str) -> dict:
    return {"type": "object", "properties": {f"{tag}{i}": {"type": "string"} for i in range(10000)}}


async def _compiles(url: str, rnd: int, out: Round) -> None:
    """Six slow schemas from 127.0.0.1 under six forged X-Forwarded-For and six `user`s; a small
    regex from 127.0.0.2 meanwhile waits at most about one compile. Then the first slow schema's
    answer (a 400: over the compile limit) and the other five clients leave (their compiles are
    stopped: the next round's regex would wait behind them otherwise)."""
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as mallory:
        other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, transport=other) as alice:

            async def slow(k: int) -> None:
                body = {"model": "m", "prompt": "x", "max_tokens": 2, "guided_json": _slow_schema(f"r{rnd}u{k}_")}
                headers = {"X-Forwarded-For": f"10.9.{rnd % 250}.{k}"}
                resp = await mallory.post("/v1/completions", json={**body, "user": f"u{k}"}, headers=headers)
                out.statuses.append(resp.status_code)
                if resp.status_code != 400:
                    out.mismatches.append(f"a slow schema answered {resp.status_code}, not 400: {resp.text[:200]}")

            async def timed(body: dict) -> float:
                t0 = time.monotonic()
                resp = await alice.post("/v1/completions", json=body)
                out.statuses.append(resp.status_code)
                return time.monotonic() - t0

            tasks = [asyncio.ensure_future(slow(k)) for k in range(6)]
            await asyncio.sleep(0.5)
            plain = {"model": "m", "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
            regex, control = await asyncio.gather(
                timed({**plain, "guided_regex": f"[a-z]{{3}}{rnd % 7}"}), timed(plain)
            )  # (the control: the same request without a constraint, at the same time)
            out.small_regex_wait = max(0.0, regex - control)
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _lora_probes(http: httpx.AsyncClient, out: Round) -> list[tuple[int, str]]:
    """Every path outside the adapter roots, missing or too long: one and the same 400."""
    answers = []
    for path in ("/root", "/root/.ssh", "/etc/passwd", "x" * 5000, "/" + "a/" * 3000, "/proc/self"):
        resp = await http.post("/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": path})
        out.statuses.append(resp.status_code)
        answers.append((resp.status_code, resp.json()["error"]["message"]))
    resp = await http.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": "/root"})
    out.statuses.append(resp.status_code)  # (the base model's name: refused too)
    return answers


def unread_stream(port: int, max_tokens: int, n: int) -> socket.socket:
    """A streaming request (n samples, logprobs 5) over a plain socket whose client then reads
    nothing (small socket buffers on both ends, so the server's writes back up soon)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    body = json.dumps(
        {
            "model": "m",
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "n": n,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 5,
            "stream_options": {"include_usage": True},
        }  # fmt: skip
    ).encode()
    s.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def _read_to_end(s: socket.socket) -> tuple[int, bytes]:
    """(status, the body de-chunked) of a chunked answer."""
    s.settimeout(60)
    data = b""
    while not data.endswith(b"\r\n0\r\n\r\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    body = b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        body, rest = body + rest[:n], rest[n + 2 :]
        if n == 0:
            break
    return int(head.split(b" ", 2)[1]), body


async def _pausing(url: str, port: int, count: int, n: int, out: Round) -> None:
    """`count` streams of n samples whose clients read nothing for a while: they pause (still
    running at 1.5x the time the same requests took read at once), then read to the end: every
    token arrives."""
    max_tokens = PAUSING_TOKENS
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": max_tokens, "n": n, "ignore_eos": True,
                "logprobs": 5}  # fmt: skip
        answers = await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(count)))
        out.statuses += [resp.status_code for resp in answers]
    fast = time.monotonic() - t0
    socks = [unread_stream(port, max_tokens, n) for _ in range(count)]
    await asyncio.sleep(min(max(1.5 * fast, 1.5), PAUSE_LOOK_S))
    # (the gauge counts sequences; nothing else runs now)
    out.paused_still_running = gauges(url)["kiln:num_requests_running"] == count * n
    # A thread for each (the default executor's few would leave the rest unread past the stall timeout).
    with concurrent.futures.ThreadPoolExecutor(len(socks)) as readers:
        loop = asyncio.get_running_loop()
        read = await asyncio.gather(*(loop.run_in_executor(readers, _read_to_end, s) for s in socks))
    for status, text in read:
        out.statuses.append(status)
        try:
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith(b"data: {")]
        except json.JSONDecodeError:  # (cut short: counted as lost below)
            events = []
            out.mismatches.append(f"an unread stream was cut short: ...{text[-200:]!r}")
        usage = next((e["usage"]["completion_tokens"] for e in events if e.get("usage")), -1)
        out.unread_tokens.append(usage // n if usage == max_tokens * n else -1)


async def soak_round(
    url: str, port: int, idle: dict[str, str], rnd: int, streams: int, unread: tuple[int, int]
) -> Round:
    out = Round()
    limits = httpx.Limits(max_connections=500, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120, limits=limits) as http:
        greedy = [_greedy(http, i, out) for i in range(streams)]
        dropped = [_dropped(http, i, out) for i in range(streams // 3)]
        results = await asyncio.gather(
            *greedy,
            *dropped,
            _auth_probes(url, out),
            _floods(http, out),
            _bad_requests(http, out),
            _compiles(url, rnd, out),
            _lora_probes(http, out),
        )
    await _pausing(url, port, *unread, out)  # (alone: the running gauge then counts its streams only)
    for key, text in results[:streams]:
        if idle[key] != text:
            out.mismatches.append(f"{key}: {text!r} != {idle[key]!r}")
    auth = results[streams + len(dropped)]
    lora = results[streams + len(dropped) + 4]
    if set(auth) != {401}:
        out.mismatches.append(f"auth probes answered {sorted(set(auth))}, not only 401")
    if len(set(lora)) != 1 or lora[0][0] != 400:
        out.mismatches.append(f"LoRA path probes answered differently: {lora}")
    return out


@dataclass
class Soak:
    rounds: int = 0
    requests: int = 0
    five_xx: int = 0
    mismatches: list[str] = field(default_factory=list)
    slowest_small_regex: float = 0.0
    not_paused: int = 0
    tokens_lost: int = 0
    rss_warm_kb: int = 0
    rss_end_kb: int = 0
    elapsed: float = 0.0

    def failures(self) -> list[str]:
        bad = [f"{self.five_xx} 5xx answers"] if self.five_xx else []
        bad += self.mismatches[:5]
        if self.slowest_small_regex > 1.5 * COMPILE_TIMEOUT_S:
            bad.append(f"a small regex waited {self.slowest_small_regex:.2f}s more than the same request without it")
        if self.not_paused:
            bad.append(f"{self.not_paused} rounds where unread streams finished instead of pausing")
        if self.tokens_lost:
            bad.append(f"{self.tokens_lost} paused streams ended without all their tokens")
        if self.rss_end_kb > self.rss_warm_kb * 1.05:
            bad.append(f"RSS grew {self.rss_warm_kb / 1024:.0f} -> {self.rss_end_kb / 1024:.0f} MB")
        return bad

    def summary(self) -> str:
        return (
            f"{self.rounds} rounds, {self.requests} requests in {self.elapsed:.0f}s: {self.five_xx} 5xx, "
            f"{len(self.mismatches)} wrong answers, 0 KV blocks in use after each round; a small regex beside "
            f"six forged-address slow schemas took at most {self.slowest_small_regex:.2f}s longer than without it "
            f"(compile limit "
            f"{COMPILE_TIMEOUT_S:g}s); unread streams paused in {self.rounds - self.not_paused}/{self.rounds} "
            f"rounds, {self.tokens_lost} lost tokens; RSS after warm-up {self.rss_warm_kb / 1024:.0f} MB, at the end "
            f"{self.rss_end_kb / 1024:.0f} MB ({100 * (self.rss_end_kb / self.rss_warm_kb - 1):+.1f}%)"
        )


def soak(
    proc, url: str, duration: float, warm_rounds: int = 2, streams: int = 24, unread: tuple[int, int] = (20, 4)
) -> Soak:
    """Rounds until `duration` seconds have passed (at least warm_rounds + 1); RSS is read after
    the warm-up rounds and at the end, both with the server idle (no request, no KV block).
    `unread`: (requests, samples each) of the streams that stop reading."""
    port = int(url.rsplit(":", 1)[1])
    result = Soak()
    t0 = time.monotonic()

    async def idle_answers() -> dict[str, str]:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as http:
            # (the first constraint builds the grammar compiler's tokenizer data: seconds, once)
            warm = await http.post("/v1/completions", json={"model": "m", "prompt": "Hi", "guided_regex": "[ab]+"})
            assert warm.status_code == 200, warm.text
            return dict([await _greedy(http, i, Round()) for i in range(len(PROMPTS) * 3)])

    idle = asyncio.run(idle_answers())
    rnd = 0
    while rnd < warm_rounds + 1 or time.monotonic() - t0 < duration:
        out = asyncio.run(soak_round(url, port, idle, rnd, streams, unread))
        wait_idle(url)
        rnd += 1
        result.rounds = rnd
        result.requests += len(out.statuses)
        result.five_xx += sum(s >= 500 for s in out.statuses)
        result.mismatches += out.mismatches
        result.slowest_small_regex = max(result.slowest_small_regex, out.small_regex_wait)
        result.not_paused += not out.paused_still_running
        result.tokens_lost += sum(t != PAUSING_TOKENS for t in out.unread_tokens)
        if rnd == warm_rounds:
            time.sleep(0.5)
            result.rss_warm_kb = rss_kb(proc.pid)
    time.sleep(0.5)
    result.rss_end_kb = rss_kb(proc.pid)
    result.elapsed = time.monotonic() - t0
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of soak rounds (after warm-up)")
    parser.add_argument("--model", type=Path, help="a checkpoint to serve (default: a tiny random Llama)")
    parser.add_argument("--streams", type=int, default=24, help="greedy streams a round (and a third as many dropped)")
    parser.add_argument("--copies", type=int, default=4, help="concurrent copies of each flood body")
    parser.add_argument("--unread", type=int, default=20, help="streams (n=4 each) that stop reading, a round")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-soak-"))
    model = args.model
    if model is None:
        from engine.models.tiny_model import make_tiny_model

        model = make_tiny_model(work / "tiny-llama", arch="llama", seed=1)
    proc, url = start(model, work)
    try:
        quiet = flood_gaps(url, [], 0)
        print(f"quiet: another stream's longest gap {quiet[0]:.3f}s, slowest /health {quiet[1]:.3f}s")
        for name, body in FLOODS.items():
            for copies in (1, args.copies):
                gap, health, statuses = flood_gaps(url, [body], copies)
                ok = gap < 0.25 and health < 0.25 and all(s == 400 for s in statuses)
                print(
                    f"{name} x{copies}: statuses {sorted(set(statuses))}; another stream's longest gap {gap:.3f}s, "
                    f"slowest /health {health:.3f}s ({'under' if ok else 'OVER'} 0.25 s)"
                )
        result = soak(proc, url, args.duration, streams=args.streams, unread=(args.unread, 4))
        print(f"soak: {result.summary()}")
        failures = result.failures()
        for failure in failures:
            print(f"FAILED: {failure}")
    finally:
        stop_server(proc, work / "server.log")
    print(f"(server log: {work / 'server.log'})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
