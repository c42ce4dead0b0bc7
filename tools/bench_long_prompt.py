"""How long a 6 MB text prompt stalls a running stream: handed to the engine as text (the engine
thread tokenises it: the old server path) vs sent to the server (admission refuses it before
tokenising; texts within bounds are tokenised on the server's threads).

Prints the largest gap between a concurrent stream's deltas in each case, and their ratio.

    PYTHONPATH=$PWD python tools/bench_long_prompt.py [--mb 6]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time


async def _largest_gap(state, send_big) -> tuple[float, str]:
    from engine.core.params import SamplingParams

    arrivals: list[float] = []

    async def stream() -> None:
        async for _ in state.engine.generate("Hello", SamplingParams(max_tokens=900, ignore_eos=True)):
            arrivals.append(time.perf_counter())

    task = asyncio.ensure_future(stream())
    while len(arrivals) < 5:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    outcome = await send_big()
    t1 = time.perf_counter()
    await asyncio.sleep(0.5)
    task.cancel()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:]) if b >= t0 and a <= t1 + 0.5]
    return max(gaps, default=time.perf_counter() - t0), outcome


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=6.0)
    args = ap.parse_args()

    import httpx

    from engine.config.server_settings import ServerSettings
    from engine.config.settings import EngineSettings
    from engine.core.admission_rules import InvalidRequestError
    from engine.core.params import SamplingParams
    from engine.entrypoints.openai.app import build_app, create_state
    from engine.models.tiny_model import make_tiny_model

    model = make_tiny_model(tempfile.mkdtemp() + "/tiny", arch="llama", seed=1)
    state = create_state(
        EngineSettings(
            model=str(model),
            device="cpu",
            enforce_eager=True,
            max_model_len=1024,
            num_gpu_blocks=256,
            max_num_seqs=4,
            log_stats_interval=0,
        ),
        ServerSettings(served_model_name="m"),
    )
    state.engine.start()
    text = "hello world " * int(args.mb * (1 << 20) / 12)
    app = build_app(state, manage_engine=False)

    async def run() -> tuple[float, str, float, str]:
        async def via_engine() -> str:
            try:
                stream = await state.engine.add_request(text, SamplingParams(max_tokens=4))
                stream.close()
                return "accepted"
            except InvalidRequestError as exc:
                return f"400 ({str(exc)[:60]}...)"

        async def via_server() -> str:
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600
            ) as http:
                resp = await http.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
                return f"{resp.status_code} ({resp.json()['error']['message'][:60]}...)"

        old, old_out = await _largest_gap(state, via_engine)
        new, new_out = await _largest_gap(state, via_server)
        return old, old_out, new, new_out

    try:
        old, old_out, new, new_out = asyncio.run(run())
    finally:
        state.close()
        state.engine.shutdown()
    print(f"{args.mb:g} MB prompt beside a running stream (largest gap between its deltas):")
    print(f"  engine thread tokenises (old path): {old * 1000:8.1f} ms  -> {old_out}")
    print(f"  server admission (new path):        {new * 1000:8.1f} ms  -> {new_out}")
    print(f"  ratio old / new: {old / new:.1f}x")


if __name__ == "__main__":
    main()
