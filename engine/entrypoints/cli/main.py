"""The `kiln` command line, vLLM's flags: `kiln serve MODEL --max-model-len 32k ...`.

Every setting is also a flag (engine/entrypoints/cli/flags.py generates them); benchmarks register in BENCHMARKS.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
from importlib import import_module

from engine.config.process_setup import prepare_process
from engine.config.server_settings import ServerSettings
from engine.config.settings import SETTING_NAMES
from engine.config.sources import SettingsError, unknown_env_vars
from engine.entrypoints.cli.flags import (
    DEST_PREFIX,
    SuggestingParser,
    add_settings_flags,
    config_file_args,
    normalize_argv,
    print_error,
    settings_from_args,
)
from engine.entrypoints.cli.vllm_compat import (
    DATA_PARALLEL,
    add_vllm_flags,
    check_vllm_flags,
    log_no_effect,
    replicas_argv,
    vllm_argv,
)

# `kiln bench NAME`: the module whose main(argv) runs it, and a one-line description.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("engine.bench.throughput", "offline throughput, kiln vs transformers"),
    "latency": ("engine.bench.latency", "per-step latency of one batch"),
    "serve": ("engine.bench.serve", "load an OpenAI-compatible server (vLLM's bench serve)"),
    "swap": ("engine.bench.swap", "KV swap to and from CPU memory"),
    "kernels": ("engine.bench.kernels", "attention kernels vs the torch reference"),
    "moe": ("engine.bench.moe", "mixture-of-experts layer"),
    "spec": ("engine.bench.spec", "speculative decoding (ngram)"),
    "lora": ("engine.bench.lora", "batches mixing LoRA adapters"),
    "overhead": ("engine.bench.overhead", "host time per step with a stub model, serial vs overlapped loop"),
    "cpu": ("engine.bench.cpu", "CPU thread settings with and without a busy neighbour"),
    "timeline": ("engine.bench.timeline_report", "the slow steps of a step timeline (step_timeline), by cause"),
}


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.core.params import SamplingParams
    from engine.entrypoints.llm import LLM

    settings = settings_from_args(args)
    given = settings.model_dump(exclude_unset=True)
    prompts = args.prompt or ["The quick brown fox"]
    if not given.keys() & {"max_num_seqs", "num_gpu_blocks", "kv_cache_memory_gb"}:
        # The KV cache is sized for what runs at once: these prompts' samples, not a server's batch.
        given["max_num_seqs"] = max(1, len(prompts) * args.n)
    llm = LLM(**given)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.sampling_seed, n=args.n
    )
    for out in llm.generate(prompts, params, use_tqdm=False):
        for choice in out.outputs:
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": out.prompt,
                            "text": choice.text,
                            "token_ids": choice.token_ids,
                            "finish_reason": choice.finish_reason,
                        }
                    )
                )
            else:
                print(f"{out.prompt!r} -> {choice.text!r} [{choice.finish_reason}]")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from engine.entrypoints.cli.chat import run

    def engine_settings() -> dict:
        given = settings_from_args(args).model_dump(exclude_unset=True)
        if not given.keys() & {"max_num_seqs", "num_gpu_blocks", "kv_cache_memory_gb"}:
            given["max_num_seqs"] = 1  # (the KV cache is sized for one conversation, not a server's batch)
        return given

    return run(args, engine_settings)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.models.tiny_model import make_tiny_model

    path = make_tiny_model(
        args.dir,
        arch=args.arch,
        seed=args.seed,
        preset=args.preset,
        config_only=args.config_only,
        train_steps=args.train_steps,
    )
    print(path)
    return 0


def _cmd_grafana_dashboard(args: argparse.Namespace) -> int:
    from importlib.resources import files

    print(files("engine.entrypoints.openai") / "grafana_dashboard.json")
    return 0


# Start-up makes ~220,000 long-lived objects (torch's modules most of them), and the collector's
# default thresholds walk them all in ~3 full collections on the way that find next to nothing
# (0.25 s of the server's imports on a 2-core AMD Zen 4, issue 40). Until ready only the young
# generations are collected; serve() puts the thresholds back once ready, then freezes start-up's objects.
NO_FULL_COLLECTION = 1 << 30


def _cmd_serve(args: argparse.Namespace) -> int:
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], NO_FULL_COLLECTION)
    try:
        from engine.entrypoints.openai.main import serve

        return serve(settings_from_args(args), settings_from_args(args, ServerSettings), gc_thresholds=thresholds)
    finally:  # (a serve that ended before ready, or raised, leaves no thresholds of start-up behind)
        gc.set_threshold(*thresholds)


def parse_serve_args(argv: list[str]) -> tuple:
    """`kiln serve ARGV` parsed into (EngineSettings, ServerSettings) without serving (tests, tools)."""
    parser = build_parser()
    args = parser.parse_args(normalize_argv(_expand_config(["serve", *vllm_argv(argv)]), parser))
    _positional_model(args)
    log_no_effect(check_vllm_flags(args))
    return settings_from_args(args), settings_from_args(args, ServerSettings)


def _cmd_build_kernels(argv: list[str]) -> int:
    """Kernels go where `kiln serve` looks: --cache-dir is kiln's cache root (KILN_CACHE_DIR, as for
    every command) and the kernels its kernels/ folder, unless --kernel-cache-dir names another;
    with --cpu, the C++ CPU libraries go to its compile/ folder (or --compile-cache-dir)."""
    from compiler.kernels import cli as kernels_cli
    from engine.config.settings import EngineSettings

    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--cache-dir", dest=DEST_PREFIX + "cache_dir", default=argparse.SUPPRESS)
    pre.add_argument("--kernel-cache-dir", dest=DEST_PREFIX + "kernel_cache_dir", default=argparse.SUPPRESS)
    pre.add_argument("--compile-cache-dir", dest=DEST_PREFIX + "compile_cache_dir", default=argparse.SUPPRESS)
    pre.add_argument("--cpu", action="store_true")
    args, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(
            "kiln build-kernels: --cache-dir DIR is kiln's cache root (default: KILN_CACHE_DIR or ~/.cache/kiln;"
            " kernels go to DIR/kernels, where `kiln serve` looks); --kernel-cache-dir DIR names the kernel"
            " folder itself. --cpu builds the C++ CPU libraries instead (this CPU's; --all: every ISA level)"
            " into the compile cache (--compile-cache-dir).\n"
        )
    cpu = args.__dict__.pop("cpu")
    settings = settings_from_args(args, EngineSettings)
    if cpu:  # the C++ CPU libraries, where `kiln serve` looks (compiler/kernels/cpu_prebuild.py)
        from compiler.kernels import cpu_prebuild

        code = cpu_prebuild.main([*rest, "--into", str(settings.resolved_compile_cache_dir())])
        if code == 0 and not {"--all", "-h", "--help"} & set(rest):  # (then this machine's crossover: cached)
            from engine.runtime import builder_cpu_crossover as cpu_crossover

            code = cpu_crossover.measure_for_build(settings.resolved_compile_cache_dir(), settings.cache_dir)
        return code
    return kernels_cli.build_main([*rest, "--cache-dir", str(settings.resolved_kernel_cache_dir())])


def _cmd_bench(argv: list[str]) -> int:
    names = ", ".join(BENCHMARKS)
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: kiln bench {{{','.join(BENCHMARKS)}}} [options]\n")
        for name, (_, text) in BENCHMARKS.items():
            print(f"  {name:<12} {text}")
        return 0 if argv else 2
    kind, rest = argv[0], argv[1:]
    if kind not in BENCHMARKS:
        print(f"kiln bench: unknown benchmark {kind!r} ({names})", file=sys.stderr)
        return 2
    return import_module(BENCHMARKS[kind][0]).main(rest)


def _cmd_warmup(args: argparse.Namespace) -> int:
    import time

    from engine.runtime.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine.from_settings(settings_from_args(args))
    print(f"warm: engine ready in {time.perf_counter() - t0:.1f}s (backend {engine.core.backend.name})")
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kiln-serve")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="kiln", description="kiln: a compiler-driven LLM serving engine")
    parser.add_argument("--version", action="version", version=f"kiln {_version()}")
    parser.add_argument(
        "--log-level",
        default=None,
        type=str.upper,
        choices=["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG"],
        help="log level (default: INFO)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    formatter = argparse.RawDescriptionHelpFormatter

    gen = sub.add_parser("generate", help="generate text for prompts offline", formatter_class=formatter)
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt (default: 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="(default: 0, greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="(default: 1)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="seed of this run's sampling")
    gen.add_argument("-n", type=int, default=1, help="outputs per prompt (default: 1)")
    gen.add_argument("--json", action="store_true", help="one JSON line per output")
    add_settings_flags(gen)
    gen.set_defaults(func=_cmd_generate)

    from engine.entrypoints.cli.chat import HELP as CHAT_HELP
    from engine.entrypoints.cli.chat import add_chat_args

    chat = sub.add_parser(
        "chat",
        help="chat in the terminal, streamed: with MODEL in this process, or with a running server (--url)",
        formatter_class=formatter,
        description=f"kiln chat [MODEL] [flags]: the model's chat template, the history kept. {CHAT_HELP}.",
    )
    add_chat_args(chat)
    add_settings_flags(chat)
    chat.set_defaults(func=_cmd_chat)

    serve = sub.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        formatter_class=formatter,
        description="kiln serve [MODEL] [flags]: vLLM's `vllm serve` flags, plus kiln's (every vLLM 0.32 flag "
        "is accepted: docs/vllm_flags.md says which kiln implements, which have no effect, which it refuses)",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="an HF checkpoint directory or a GGUF file (same as --model)",
    )
    serve.add_argument(
        "--config",
        metavar="FILE",
        help="a YAML file of flags (`max-model-len: 4096`); flags given on the command line win",
    )
    add_settings_flags(serve)
    add_settings_flags(serve, ServerSettings)
    add_vllm_flags(serve)  # (the rest of vLLM's flags: docs/vllm_flags.md says what kiln does with each)
    serve.set_defaults(func=_cmd_serve)

    warm = sub.add_parser("warmup", help="load, compile and capture without serving")
    warm.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model")
    add_settings_flags(warm)
    warm.set_defaults(func=_cmd_warmup)

    from engine.models.tiny_model import ARCH_DEFAULTS, PRESETS  # (no torch import at module level)

    tiny = sub.add_parser("make-tiny-model", help="write a small random HF checkpoint with a tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--arch", default="llama", choices=list(ARCH_DEFAULTS))
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--preset", default=None, choices=list(PRESETS))
    tiny.add_argument("--config-only", action="store_true", help="config + tokenizer only (load_format=dummy)")
    tiny.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="train the random model this many Adam steps on the tokenizer's corpus (seconds on a "
        "CPU): peaked, attention-dependent outputs for fidelity gates such as the fp8 KV cache's",
    )
    tiny.set_defaults(func=_cmd_make_tiny_model)

    dash = sub.add_parser(
        "grafana-dashboard",
        help="print the path of kiln's Grafana dashboard (shipped in the "
        "package; it also answers vLLM's example dashboard's queries)",
    )
    dash.set_defaults(func=_cmd_grafana_dashboard)

    sub.add_parser("build-kernels", help="build the CUTLASS attention kernels ahead of time", add_help=False)
    sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHMARKS), add_help=False)
    sub.add_parser("serve-replicas", help="N `kiln serve` replicas behind sglang-router", add_help=False)
    sub.add_parser(
        "make-draft-model",
        help="train a draft model or EAGLE head for speculative decoding from the "
        "target's own outputs (CPU, minutes; cached)",
        add_help=False,
    )
    return parser


def _expand_config(argv: list[str]) -> list[str]:
    """`--config FILE` becomes the file's flags, placed before the command line's (which win)."""
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            path, rest = argv[i + 1], argv[:i] + argv[i + 2 :]
        elif token.startswith("--config="):
            path, rest = token.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        else:
            continue
        command = _command_index(rest) + 1
        return rest[:command] + config_file_args(path) + rest[command:]
    return argv


def _positional_model(args: argparse.Namespace) -> None:
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return
    given = getattr(args, DEST_PREFIX + "model", None)
    if given is not None and given != tag:
        raise SettingsError(f"model given twice: {tag!r} (MODEL) and {given!r} (--model)")
    setattr(args, DEST_PREFIX + "model", tag)


def main(argv: list[str] | None = None) -> int:
    prepare_process()  # (before any command imports torch: its runtimes read these once, at load)
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    command_at = _command_index(argv)
    command = argv[command_at] if command_at < len(argv) else None
    # `kiln --log-level X <command>`: honoured by every command, before anything logs.
    log_level = _global_log_level(argv[:command_at])
    if log_level:
        logging.getLogger().setLevel(log_level)
    for warning in unknown_env_vars(SETTING_NAMES):
        logging.getLogger("engine").warning(warning)
    try:
        # Subcommands that own their flags.
        if command == "build-kernels":
            return _cmd_build_kernels(argv[command_at + 1 :])
        if command == "bench":
            return _cmd_bench(argv[command_at + 1 :])
        if command == "serve-replicas":
            from engine.entrypoints.cli.replicas import main as serve_replicas

            return serve_replicas(argv[command_at + 1 :], parse_serve_args)
        if command == "make-draft-model":
            from engine.entrypoints.cli.make_draft import main as make_draft_model

            return make_draft_model(argv[command_at + 1 :])
        if command == "serve":
            argv = argv[: command_at + 1] + vllm_argv(argv[command_at + 1 :])
        argv = normalize_argv(_expand_config(argv), parser)
        args = parser.parse_args(argv)
        _positional_model(args)
        if args.command == "serve":
            log_no_effect(check_vllm_flags(args))
            if getattr(args, DATA_PARALLEL, 1) > 1:  # vLLM's data parallelism: kiln's replicas
                return _serve_data_parallel(args, argv[_command_index(argv) + 1 :])
        if args.command == "serve" and log_level and not hasattr(args, DEST_PREFIX + "log_level"):
            setattr(args, DEST_PREFIX + "log_level", log_level.lower())
        return args.func(args)
    except (SettingsError, ValueError, FileNotFoundError) as exc:
        print_error(exc)
        return 2


def _serve_data_parallel(args: argparse.Namespace, serve_argv: list[str]) -> int:
    from engine.entrypoints.cli.replicas import main as serve_replicas

    server = settings_from_args(args, ServerSettings)
    replicas = getattr(args, DATA_PARALLEL)
    logging.getLogger("engine").info(
        "--data-parallel-size %d: serving %d replicas behind a router at %s:%d (kiln serve-replicas)",
        replicas,
        replicas,
        server.host,
        server.port,
    )
    return serve_replicas(replicas_argv(serve_argv, replicas, server.host, server.port), parse_serve_args)


def _global_log_level(head: list[str]) -> str | None:
    for i, token in enumerate(head):
        if token == "--log-level" and i + 1 < len(head):
            return head[i + 1].upper()
        if token.startswith("--log-level="):
            return token.split("=", 1)[1].upper()
    return None


def _command_index(argv: list[str]) -> int:
    """Position of the subcommand (the first word that is not a global option or its value)."""
    i = 0
    while i < len(argv):
        if argv[i] == "--log-level":
            i += 2
        elif argv[i].startswith("-"):
            i += 1
        else:
            return i
    return len(argv)


if __name__ == "__main__":
    sys.exit(main())
