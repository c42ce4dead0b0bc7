"""`kiln bench overhead`: the engine loop's host time per step, with the model stubbed out.

The forward is replaced by a stub returning hidden states of zeros and fixed logits (one
random row per batch position, so every sequence keeps producing tokens), so what is timed is
kiln's own work: scheduling, input preparation, sampling and output processing
(token bookkeeping, stop checks, detokenisation, RequestOutput building). At each batch size
(default 1, 64 and 256) `batch` requests decode together (greedy, ignore_eos, detokenised
as a server would) and the loop runs `--steps` decode steps, serial and overlapped in the
same run. Printed per step (µs, the median over the steps) and per sequence per step (µs):

  schedule      Scheduler.schedule
  prep          ModelRunner.prepare (inputs written and uploaded)
  sample        the sampler (device work on a GPU; host work here)
  launch        the rest of the runner's step (the stub forward, logits rows, bookkeeping)
  process       everything else in the step: output processing (tokens appended, stop checks,
                detokenisation, RequestOutputs)
  critical      host time the device waits for: the whole step in the serial loop; schedule +
                prep + sample + launch in the overlapped loop, whose output processing of step N
                runs while the device computes step N+1.

--offline runs the requests as `LLM.generate` and `kiln bench throughput` do: one output per
request when it finishes (output_kind "final_only") and, like the throughput bench, no
detokenisation; the default streams a delta per step, detokenised, as the server does.

--mix penalties|grammar puts that feature in one request of every 8 (at least one per batch):
frequency/presence/repetition penalties, or a JSON-schema grammar (a string field the request
keeps extending). Their steps overlap too: penalties take the in-flight token on the device;
a grammar step launches its forward, processes the previous step, then samples, so its
critical path also holds that deferred sampling (timed into `launch` and `sample`).

Torch runs with --torch-threads intra-op threads (default 1): on a small shared CPU more
threads spin against each other and time the contention, not kiln.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

PHASES = ("schedule", "prep", "sample", "launch", "process")


class _Timed:
    """Wrap a callable, adding its wall time into `totals[name]`."""

    def __init__(self, fn, totals: dict[str, float], name: str) -> None:
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.name] += time.perf_counter() - t0


class _TimedSampler:
    """The runner's sampler, timed (both the blocking call and launch)."""

    def __init__(self, sampler, totals: dict[str, float]) -> None:
        self._sampler = sampler
        self._call = _Timed(sampler, totals, "sample")
        self.launch = _Timed(getattr(sampler, "launch", sampler), totals, "sample")

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._sampler, name)


def stub_model(engine, max_rows: int) -> None:
    """Replace the forward with zeros and the logits with fixed random rows (no model work)."""
    import torch

    cfg = engine.model_config
    gen = torch.Generator().manual_seed(0)
    fixed = torch.randn(max_rows, cfg.vocab_size, generator=gen).to(engine.core.device)
    hidden = torch.zeros(
        max(max_rows, engine.settings.max_num_batched_tokens) * 4,
        cfg.hidden_size,
        dtype=engine.core.dtype,
        device=engine.core.device,
    )
    engine.core.runner.forward_fn = lambda ids, positions, kv, meta, ctx=None: hidden[: ids.shape[0]]
    engine.core.model.compute_logits = lambda h: fixed[: h.shape[0]]


def instrument(engine) -> dict[str, float]:
    totals: dict[str, float] = defaultdict(float)
    engine.core.scheduler.schedule = _Timed(engine.core.scheduler.schedule, totals, "schedule")
    engine.core.runner.prepare = _Timed(engine.core.runner.prepare, totals, "prep")
    runner = engine.core.runner
    if hasattr(engine.core, "_sample"):  # a step whose sampling waits for the previous step's processing
        engine.core._sample = _Timed(engine.core._sample, totals, "runner")
    if hasattr(runner, "launch"):
        runner.launch = _Timed(runner.launch, totals, "runner")
    else:  # (the serial-only loop, before overlap scheduling)
        runner.execute = _Timed(runner.execute, totals, "runner")
    engine.core.runner.sampler = _TimedSampler(engine.core.runner.sampler, totals)
    return totals


MIXES = ("none", "penalties", "grammar")
MIX_EVERY = 8  # one request in this many has the --mix feature


STREAMED = dict(output_kind="delta")  # the server's requests: a detokenised delta per step
OFFLINE = dict(output_kind="final_only", detokenize=False)  # LLM.generate's, as kiln bench throughput runs them


def mixed_params(engine, mix: str, max_tokens: int, kind: dict | None = None):
    """The --mix feature's SamplingParams (greedy, never ending early; `kind`: STREAMED or OFFLINE)."""
    from engine.core.params import SamplingParams, StructuredOutputsParams

    base = dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **(kind or STREAMED))
    if mix == "penalties":
        return SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, **base)
    # A string field the output keeps extending: a bias on one letter keeps the grammar from closing it.
    letter = engine.tokenizer.encode("a", add_special_tokens=False)[-1]
    schema = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    return SamplingParams(
        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        logit_bias={letter: 30.0},
        **base,
    )


def measure(
    engine, totals: dict[str, float], batch: int, steps: int, overlap: bool, mix: str = "none", offline: bool = False
) -> dict[str, float]:
    from engine.core.params import SamplingParams

    if hasattr(engine.core, "async_scheduling"):
        engine.core.async_scheduling = overlap
    elif overlap:
        return {}
    kind = OFFLINE if offline else STREAMED
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True, **kind)
    special = params if mix == "none" else mixed_params(engine, mix, steps + 64, kind)
    ids = [
        engine.add_request(
            list(range(10 + i % 7, 26 + i % 7)), special if i % MIX_EVERY == 0 else params, f"ovh-{overlap}-{batch}-{i}"
        ).request_id
        for i in range(batch)
    ]
    for _ in range(8):  # prefill and a few decodes: every sequence is decoding from here on
        engine.step()
    steps_seen = []
    for _ in range(steps):
        totals.clear()
        t0 = time.perf_counter()
        engine.step()
        row = {k: totals[k] * 1e6 for k in ("schedule", "prep", "sample", "runner")}
        row["total"] = (time.perf_counter() - t0) * 1e6
        row["launch"] = row["runner"] - row["prep"] - row["sample"]
        row["process"] = row["total"] - row["schedule"] - row["runner"]
        row["critical"] = row["schedule"] + row["runner"] if overlap else row["total"]
        steps_seen.append(row)
    for rid in ids:
        engine.abort_request(rid)
    while engine.core.has_unfinished_requests():
        engine.step()
    # Medians per phase: a shared machine deschedules the process now and then.
    per_step = {k: statistics.median(r[k] for r in steps_seen) for k in steps_seen[0]}
    return per_step


def main(argv: list[str]) -> int:
    from engine.entrypoints.cli.flags import add_settings_flags, settings_from_args

    parser = argparse.ArgumentParser(
        prog="kiln bench overhead", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,64,256", help="batch sizes")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size and loop")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads (see above)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument(
        "--mix",
        choices=MIXES,
        default="none",
        help=f"a feature in one request of every {MIX_EVERY}: penalties or a JSON grammar",
    )
    parser.add_argument(
        "--offline", action="store_true", help="requests as LLM.generate runs them: final output only, not detokenised"
    )
    add_settings_flags(parser)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    settings = settings_from_args(args)
    update = {"max_num_seqs": max(batches + [settings.max_num_seqs]), "enforce_eager": True}
    if "cpu_threads" not in settings.model_fields_set:  # (the engine applies cpu_threads at start-up)
        update["cpu_threads"] = args.torch_threads
    if "num_gpu_blocks" not in settings.model_fields_set:
        update["num_gpu_blocks"] = max(batches) * (-(-(32 + args.steps + 80) // settings.block_size))
    settings = settings.model_copy(update=update)
    import torch

    from engine.runtime.llm_engine import LLMEngine

    engine = LLMEngine.from_settings(settings)
    stub_model(engine, max(batches))
    totals = instrument(engine)
    results = []
    mixed = "" if args.mix == "none" else f", {args.mix} in 1 of every {MIX_EVERY} requests"
    mixed += ", offline (final output only, no detokenisation)" if args.offline else ", streamed (detokenised deltas)"
    print(
        f"kiln bench overhead: stub model, {args.steps} decode steps per row (medians), "
        f"device {engine.core.device}, {torch.get_num_threads()} torch threads{mixed}"
    )
    print(
        f"{'batch':>5} {'loop':>8} "
        + " ".join(f"{p:>9}" for p in PHASES)
        + f" {'critical':>9} | per seq: {'process':>8} {'critical':>8}   (µs)"
    )
    for batch in batches:
        for overlap in (False, True):
            r = measure(engine, totals, batch, args.steps, overlap, args.mix, args.offline)
            if not r:
                continue
            loop = "overlap" if overlap else "serial"
            results.append({"batch": batch, "loop": loop, "mix": args.mix, "offline": args.offline, **r})
            print(
                f"{batch:>5} {loop:>8} "
                + " ".join(f"{r[p]:>9.1f}" for p in PHASES)
                + f" {r['critical']:>9.1f} | {'':9} {r['process'] / batch:>8.2f} {r['critical'] / batch:>8.2f}"
            )
        serial = [x for x in results if x["batch"] == batch and x["loop"] == "serial"]
        over = [x for x in results if x["batch"] == batch and x["loop"] == "overlap"]
        if serial and over:
            print(f"{batch:>5} critical path overlap / serial: {over[0]['critical'] / serial[0]['critical']:.2f}x")
    engine.core.check_integrity()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
