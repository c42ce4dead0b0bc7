"""kiln's own Python per output token on the output side, in one process and counted in CPU time
(time.thread_time), so a loaded machine barely moves it: the output thread's part (OutputProcessor:
detokenising, RequestOutputs; handing each stream its delta through the loop's mailbox) and the
event loop's part (the mailbox's delivery, the stream, the job's read, the chat chunk's JSON), for
streams decoding in lockstep as a served batch does. The HTTP framework and the socket write after
the chunk's text are not included (tools/bench_output_cost.py measures the whole server).

    python tools/bench_output_path.py [--tree DIR ...] [--streams 16] [--tokens 64] [--rounds 5]

Each tree's code runs in its own child process (its directory first on sys.path); rounds
alternate between trees, and the table gives the median over rounds of us per token and each
tree's ratio to the first. The token ids are SmolLM2's tokenizer's text of a fixed English passage
(the tokenizer comes from --model, a GGUF file or a model directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

MODEL = "/root/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = (
    "The kiln fires the clay slowly, and the potter waits beside it. When the door opens, the pots "
    "are hard and bright; some crack, most hold. Paris, the capital of France, has many such workshops "
    "where people learn the craft over years of practice, patience and small mistakes. "
) * 8


def child(model: str, streams: int, tokens: int) -> dict[str, float]:
    """One measurement in this process (run from the tree being measured)."""
    import asyncio
    import time

    from engine.core.outputs import FinishReason, RequestUpdate, SeqUpdate
    from engine.core.params import SamplingParams
    from engine.entrypoints.openai.chat import ChatFormat
    from engine.entrypoints.openai.generation_request import GenerationRequest
    from engine.entrypoints.openai.jobs import ChunkEvents, Job, stream_events
    from engine.models.loader.model_loader import load_tokenizer
    from engine.runtime.output_gate import OutputGate
    from engine.runtime.output_thread import OutputThread
    from engine.runtime.request_stream import RequestStream

    tokenizer = load_tokenizer(model)
    ids = tokenizer(TEXT)["input_ids"]
    prompt, output = ids[:64], ids[64 : 64 + tokens]

    class Task:
        text_output = True

    class Admitted:
        def __init__(self, rid: str) -> None:
            self.request_id, self.prompt, self.prompt_token_ids = rid, None, prompt
            self.params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, output_kind="delta")
            self.arrival_time, self.task = time.monotonic(), Task()

    class Engine:  # what the output thread reads of the engine
        class core:
            timeline = None

    Engine.tokenizer = tokenizer  # type: ignore[attr-defined]

    class State:
        model_name = "m"

    State.tokenizer = tokenizer  # type: ignore[attr-defined]
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    side = OutputThread(Engine(), None, None, OutputGate(False), lambda items: None)  # type: ignore[arg-type]
    fmt = ChatFormat(State())
    got = {"chunks": 0, "want": 0}
    arrived = asyncio.Event()

    async def read(job: Job, events: ChunkEvents) -> None:
        async for _ in stream_events(job, events, None):
            got["chunks"] += 1
            if got["chunks"] >= got["want"]:
                arrived.set()

    readers = []
    for i in range(streams):
        rid = f"r{i}"
        stream = RequestStream(rid, loop)
        side.add(Admitted(rid), stream)  # type: ignore[arg-type]
        gen = GenerationRequest("chat", [prompt], [None], SamplingParams(), None, stream=True)  # type: ignore[arg-type]
        job = Job(f"chatcmpl-{rid}", "chat", [stream], 1, [None], gen.params)
        readers.append(loop.create_task(read(job, ChunkEvents(fmt, "m", gen))))
    got["want"] = streams  # (the opening chunks)
    loop.run_until_complete(arrived.wait())
    out_s = loop_s = 0.0
    for step in range(tokens):
        last = step == tokens - 1
        updates = [
            RequestUpdate(f"r{i}", [SeqUpdate(0, [output[step]], None, None, None, False, 0)], False)
            for i in range(streams)
        ]
        if last:
            updates = [
                RequestUpdate(u.request_id, [u.seqs[0]._replace(finish_reason=FinishReason.LENGTH)], True)
                for u in updates
            ]
        arrived.clear()
        got["want"] = got["chunks"] + streams * (2 if last else 1)  # (the last: its chunk and [DONE])
        t0 = time.thread_time()
        side.dispatch(side.process(updates))
        t1 = time.thread_time()
        loop.run_until_complete(arrived.wait())
        t2 = time.thread_time()
        out_s, loop_s = out_s + t1 - t0, loop_s + t2 - t1
    loop.run_until_complete(asyncio.gather(*readers))
    loop.close()
    n = streams * tokens
    return {"output thread us/tok": 1e6 * out_s / n, "event loop us/tok": 1e6 * loop_s / n}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", type=Path, help="a checkout (repeat; default: this one)")
    p.add_argument("--model", default=MODEL, help="where the tokenizer comes from")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        sys.path.insert(0, os.getcwd())  # the tree being measured
        print(json.dumps(child(args.model, args.streams, args.tokens)))
        return 0
    trees = [t.resolve() for t in (args.tree or [Path(__file__).resolve().parents[1]])]
    rows: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model", args.model]
    cmd += ["--streams", str(args.streams), "--tokens", str(args.tokens)]
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            run = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise SystemExit(f"{tree}: {run.stderr[-2000:]}")
            rows[tree].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {tree}: {rows[tree][-1]}", flush=True)
    keys = list(rows[trees[0]][0])
    med = {t: {k: statistics.median(row[k] for row in rows[t]) for k in keys} for t in trees}
    print(f"\nmedians of {args.rounds} rounds, {args.streams} streams x {args.tokens} tokens, CPU us per token")
    print("| | " + " | ".join(str(t) for t in trees) + (" | ratio" * (len(trees) - 1)) + " |")
    print("| --- |" + " ---: |" * (2 * len(trees) - 1))
    for k in keys:
        cells = [f"{med[t][k]:.1f}" for t in trees] + [f"{med[t][k] / med[trees[0]][k]:.2f}x" for t in trees[1:]]
        print(f"| {k} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
