"""The peer side of tools/bench_kv_tiers.py: llama-server's answer to "a long prefix comes back",
its slot files (`--slot-save-path`, POST /slots/0?action=save|restore), on the same GGUF file and
the same prompt of token ids.

  off      cache_prompt false: the prompt computed (every return without a saved slot)
  on/cold  cache_prompt true on an erased slot: prefill (the slot then holds the prefix)
  pool hit the same prompt again: the slot's KV reused (llama-server's floor)
  restart  the slot saved to a file, the server stopped and started again, the slot restored
           (restore time reported apart: llama-server does not restore by itself, a client must
           know the file), then the prompt

llama.cpp is a peer here, never a dependency: without --llama-cpp-dir this is not run.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from pathlib import Path

from tools.peer_server import running_server


def _post(port: int, path: str, body: dict, timeout: float = 3600.0) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _ttft(port: int, prompt: list[int], cache: bool) -> tuple[float, int, int]:
    """Seconds for one token, the token, and the prompt tokens llama-server did not compute."""
    t0 = time.perf_counter()
    out = _post(
        port,
        "/completion",
        {
            "prompt": prompt,
            "n_predict": 1,
            "temperature": 0,
            "cache_prompt": cache,
            "id_slot": 0,
            "return_tokens": True,
        },
    )
    took = time.perf_counter() - t0
    tokens = out.get("tokens") or [-1]
    computed = int(out.get("timings", {}).get("prompt_n", len(prompt)))
    return took, int(tokens[0]), len(prompt) - computed


def run_llama_server(bin_dir: Path, model: str, prompt: list[int], threads: int, port: int) -> dict[str, float]:
    """TTFTs of llama-server's slot-file workflow (seconds), keyed like bench_kv_tiers.py's rows."""
    work = Path(tempfile.mkdtemp(prefix="kiln-kv-tiers-llamacpp-"))
    slots = work / "slots"
    slots.mkdir()
    cmd = [
        str(bin_dir / "llama-server"),
        "-m",
        model,
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        str(len(prompt) + 64),
        "-np",
        "1",
        "--port",
        str(port),
        "--slot-save-path",
        str(slots),
    ]
    env = dict(os.environ)
    rows: dict[str, float] = {}
    with running_server(cmd, env, work / "server1.log", port, 600.0, work):
        _ttft(port, prompt[:32], cache=False)  # (first-call costs out of the timings)
        rows["off"], tok_off, _ = _ttft(port, prompt, cache=False)
        _post(port, "/slots/0?action=erase", {})  # (the slot keeps the uncached run's KV: start empty)
        rows["on/cold"], _, _ = _ttft(port, prompt, cache=True)
        rows["pool hit"], tok_hit, reused = _ttft(port, prompt, cache=True)
        t0 = time.perf_counter()
        _post(port, "/slots/0?action=save", {"filename": "prefix.bin"})
        rows["save"] = time.perf_counter() - t0
    with running_server(cmd, env, work / "server2.log", port, 600.0, work):
        t0 = time.perf_counter()
        _post(port, "/slots/0?action=restore", {"filename": "prefix.bin"})
        rows["restore"] = time.perf_counter() - t0
        rows["restart"], tok_re, reused_re = _ttft(port, prompt, cache=True)
    size = (slots / "prefix.bin").stat().st_size
    print(
        f"llama-server: off {rows['off']:.2f} s, cold {rows['on/cold']:.2f} s, pool hit {rows['pool hit']:.2f} s "
        f"({reused} tokens reused), slot save {rows['save']:.2f} s ({size / 2**20:.0f} MiB), after a restart: "
        f"restore {rows['restore']:.2f} s + TTFT {rows['restart']:.2f} s ({reused_re} tokens reused); "
        f"first token: recompute {tok_off}, hit {tok_hit}, restored {tok_re}"
    )
    return rows
