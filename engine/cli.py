"""The `kiln` command line. Every engine setting is also a flag (`--max-model-len 4096`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from typing import Any

from engine.config import EngineSettings, ServerSettings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_settings_flags(parser: argparse.ArgumentParser, model_cls=EngineSettings,
                       skip: tuple[str, ...] = ()) -> None:
    """One flag per setting; unset flags stay out of the result so env/toml values apply."""
    group = parser.add_argument_group(f"{model_cls.__name__} (also KILN_* variables and kiln.toml)")
    for name, field in model_cls.model_fields.items():
        if name in skip:
            continue
        ann = field.annotation
        args = typing.get_args(ann)
        kwargs: dict[str, Any] = dict(dest=f"setting__{name}", default=argparse.SUPPRESS,
                                      help=field.description or "")
        if ann is bool:
            kwargs.update(nargs="?", const=True, type=_parse_bool, metavar="BOOL")
        elif typing.get_origin(ann) is typing.Literal:
            kwargs.update(choices=list(args))
        elif any(typing.get_origin(a) is list for a in args) or typing.get_origin(ann) is list:
            kwargs.update(type=str, metavar="N,N,...")
        else:
            kwargs.update(type=str)
        group.add_argument(_flag(name), **kwargs)


def settings_from_args(args: argparse.Namespace, model_cls=EngineSettings, **extra: Any):
    values = {k.removeprefix("setting__"): v for k, v in vars(args).items() if k.startswith("setting__")}
    values = {k: v for k, v in values.items() if k in model_cls.model_fields}
    values.update(extra)
    return model_cls(**values)


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.request import SamplingParams

    settings = settings_from_args(args)
    llm = LLM(**settings.model_dump(exclude_unset=True))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.sampling_seed, n=args.n)
    prompts = args.prompt or ["The quick brown fox"]
    for out in llm.generate(prompts, params, use_tqdm=False):
        for choice in out.outputs:
            if args.json:
                print(json.dumps({"prompt": out.prompt, "text": choice.text, "token_ids": choice.token_ids,
                                  "finish_reason": choice.finish_reason}))
            else:
                print(f"{out.prompt!r} -> {choice.text!r} [{choice.finish_reason}]")
    return 0


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, arch=args.arch, seed=args.seed, preset=args.preset,
                           config_only=args.config_only)
    print(path)
    return 0


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.server.main import serve

    engine_settings = settings_from_args(args)
    server_settings = settings_from_args(args, ServerSettings)
    return serve(engine_settings, server_settings)


def _cmd_build_kernels(argv: list[str]) -> int:
    from compiler.kernels.cli import build_main

    return build_main(argv)


def _cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kiln bench {throughput,latency,serve,swap,kernels,moe,spec,lora,cpu} [options]")
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind == "throughput":
        from engine.bench.throughput import main
    elif kind == "latency":
        from engine.bench.latency import main
    elif kind == "serve":
        from engine.bench.serve import main
    elif kind == "swap":
        from engine.bench.swap import main
    elif kind == "kernels":
        from compiler.kernels.bench import main
    elif kind == "moe":
        from compiler.moe_bench import main
    elif kind == "spec":
        from engine.bench.spec import main
    elif kind == "lora":
        from engine.bench.lora import main
    elif kind == "cpu":
        from engine.bench.cpu import main
    else:
        print(f"kiln bench: unknown benchmark {kind!r} (throughput, latency, serve, swap, kernels, moe, spec, lora, cpu)",
              file=sys.stderr)
        return 2
    return main(rest)


def _cmd_warmup(args: argparse.Namespace) -> int:
    import time

    from engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(settings_from_args(args))
    print(f"warm: engine ready in {time.perf_counter() - t0:.1f}s (backend {engine.backend.name})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: a compiler-driven LLM serving engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts offline")
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("-n", type=int, default=1)
    gen.add_argument("--json", action="store_true", help="one JSON line per output")
    add_settings_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    add_settings_flags(serve)
    add_settings_flags(serve, ServerSettings)
    serve.set_defaults(func=_cmd_serve)

    warm = sub.add_parser("warmup", help="load, compile and capture without serving")
    add_settings_flags(warm)
    warm.set_defaults(func=_cmd_warmup)

    from engine.tiny_model import ARCH_DEFAULTS, PRESETS  # (no torch import at module level)

    tiny = sub.add_parser("make-tiny-model", help="write a small random HF checkpoint with a tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=list(ARCH_DEFAULTS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--preset", default=None, choices=list(PRESETS))
    tiny.add_argument("--config-only", action="store_true", help="config + tokenizer only (load_format=dummy)")
    tiny.set_defaults(func=_cmd_make_tiny_model)

    sub.add_parser("build-kernels", help="build the CUTLASS attention kernels ahead of time", add_help=False)
    sub.add_parser("bench", help="benchmarks: throughput, latency, serve, swap, kernels, moe, spec, lora, cpu",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Subcommands that own their flags.
    if argv and argv[0] == "build-kernels":
        return _cmd_build_kernels(argv[1:])
    if argv and argv[0] == "bench":
        return _cmd_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(args.log_level.upper())
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kiln: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
