"""CPU of streaming one long tool call: the chat route's delta code (chat.chat_stream_delta, an auto
`hermes` call) and the Responses/Messages block code (answer_blocks, a named call), the output fed
in token-sized pieces (2-6 characters), per argument length. Compare two versions in one run by
pointing --old at a checkout of the older one (run from the repository root):

    mkdir /tmp/kiln-old && git archive <commit> | tar -x -C /tmp/kiln-old
    python tools/bench_tool_call_stream.py 1000 4000 --old /tmp/kiln-old

Each version runs in its own process, alternately, twice; the figures are ms per output and µs
per piece. Checks that the streamed pieces parse to the call's arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(n_chars: int) -> dict[str, tuple[float, int]]:
    from engine.entrypoints.openai.chat import chat_stream_delta
    from engine.entrypoints.openai.jobs import Choice, Job
    from engine.entrypoints.openai.messages import MessageEvents
    from engine.entrypoints.openai.tool_calls import ToolMode

    rng = random.Random(n_chars)
    args = {"path": "src/main.py", "code": "".join(rng.choice('abcdef \n"\\{}') for _ in range(n_chars))}
    compact = json.dumps(args, separators=(",", ":"))
    outputs = {
        "chat, auto hermes": (
            ToolMode("auto", {}, parser="hermes"),
            f'<tool_call>\n{{"name": "write", "arguments": {compact}}}\n</tool_call>',
        ),
        "messages, named": (ToolMode("named", {"write": {}}, name="write"), compact),
    }
    out = {}
    for label, (mode, text) in outputs.items():
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(2, 6)
            pieces.append(text[i : i + k])
            i += k
        job = Job("id", "chat", [], 1, [None], None)
        job.tool_mode = mode
        ch, got = Choice(), []
        blocks = MessageEvents("m", None) if label.startswith("messages") else None
        t0 = time.perf_counter()
        for j, piece in enumerate(pieces):
            finish = "stop" if j == len(pieces) - 1 else None
            if blocks is None:
                delta, _ = chat_stream_delta(job, ch, piece, finish)
                got += [tc["function"].get("arguments", "") for tc in delta.get("tool_calls", [])]
            else:
                out_piece = type("Output", (), {"text": piece, "finish_reason": finish, "stop_reason": None})
                got += blocks.feed(job, ch, out_piece)
        if blocks is not None:
            got += blocks.close()
            got = [
                e["delta"]["partial_json"]
                for e in (json.loads(s.split("data: ", 1)[1]) for s in got)
                if e["type"] == "content_block_delta"
            ]
        elapsed = time.perf_counter() - t0
        assert json.loads("".join(got)) == args, label
        out[label] = (elapsed, len(pieces))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lengths", nargs="+", type=int, help="argument lengths in characters")
    ap.add_argument("--old", type=Path, help="a checkout of the version to compare against")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (a child: this tree, printed as JSON)
    args = ap.parse_args()
    if args.one:
        print(json.dumps({n: measure(n) for n in args.lengths}))
        return
    trees = {"this": ROOT, **({"old": args.old} if args.old else {})}
    for rep in range(2):
        for name, tree in trees.items():
            cmd = [sys.executable, str(Path(__file__).resolve()), "--one", *map(str, args.lengths)]
            env = {**os.environ, "PYTHONPATH": str(tree)}
            done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout)
            for n, rows in result.items():
                for label, (elapsed, pieces) in rows.items():
                    print(
                        f"run {rep + 1} {name:4s} {int(n):6d} chars {label:18s}: {1e3 * elapsed:9.1f} ms "
                        f"({1e6 * elapsed / pieces:7.1f} us/piece, {pieces} pieces)"
                    )


if __name__ == "__main__":
    main()
