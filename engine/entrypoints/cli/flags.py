"""Command-line flags for kiln's settings, under vLLM's names.

Every EngineSettings / ServerSettings field is a flag, generated from the field (a new field gets
a flag with its description, default and choices in --help): `--field-name`, or vLLM's name where
vLLM calls it something else (VLLM_NAMES). Booleans are `--x` / `--no-x`, lists take several
values, sizes take `32k`. Unset flags stay out of the result, so KILN_* variables and kiln.toml
still apply underneath them.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from engine.config.build import build_settings
from engine.config.settings import EngineSettings
from engine.config.sources import SettingsError
from engine.config.values import DTYPE_ALIASES, did_you_mean

logger = logging.getLogger("engine.entrypoints.cli.flags")

DEST_PREFIX = "setting__"

# Settings whose vLLM flag is named differently from the setting.
VLLM_NAMES = {"swap_space_gb": "--swap-space", "num_gpu_blocks": "--num-gpu-blocks-override"}
SHORT_FLAGS = {"tensor_parallel_size": "-tp"}
# kiln's earlier flag names: still accepted for one release, with a warning naming the new flag.
DEPRECATED_FLAGS = {"--swap-space-gb": "swap_space_gb", "--num-gpu-blocks": "num_gpu_blocks"}

# vLLM flags that set a kiln setting (`vllm serve` spelling), each with an example in
# tests/config/test_cli_flags.py. Every other vLLM flag: vllm_flag_table.py / vllm_compat.py.
VLLM_FLAGS: dict[str, str] = {
    "MODEL": "model",  # the positional argument: `kiln serve /path/to/model`
    "--model": "model",
    "--tokenizer": "tokenizer",
    "--chat-template": "chat_template",
    "--dtype": "dtype",
    "--seed": "seed",
    "--load-format": "load_format",
    "--max-model-len": "max_model_len",
    "--block-size": "block_size",
    "--num-gpu-blocks-override": "num_gpu_blocks",
    "--gpu-memory-utilization": "gpu_memory_utilization",
    "--swap-space": "swap_space_gb",
    "--enable-prefix-caching": "enable_prefix_caching",
    "--no-enable-prefix-caching": "enable_prefix_caching",
    "--max-num-seqs": "max_num_seqs",
    "--max-num-batched-tokens": "max_num_batched_tokens",
    "--enable-chunked-prefill": "enable_chunked_prefill",
    "--no-enable-chunked-prefill": "enable_chunked_prefill",
    "--speculative-config": "speculative_config",
    "--enable-lora": "enable_lora",
    "--lora-modules": "lora_modules",
    "--max-loras": "max_loras",
    "--max-lora-rank": "max_lora_rank",
    "--enforce-eager": "enforce_eager",
    "--cuda-graph-sizes": "cuda_graph_sizes",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--quantization": "quantization",
    "--kv-cache-dtype": "kv_cache_dtype",
    "--kv-offloading-size": "kv_offloading_size",
    "--generation-config": "generation_config",
    "--max-logprobs": "max_logprobs",
    "--disable-log-stats": "disable_log_stats",
    "--trust-remote-code": "trust_remote_code",
    "--host": "host",
    "--port": "port",
    "--api-key": "api_key",
    "--served-model-name": "served_model_name",
    "--enable-auto-tool-choice": "enable_auto_tool_choice",
    "--tool-call-parser": "tool_call_parser",
    "--reasoning-parser": "reasoning_parser",
    "--uvicorn-log-level": "uvicorn_log_level",
    "--disable-uvicorn-access-log": "disable_uvicorn_access_log",
    "--enable-log-requests": "enable_log_requests",
    "--allowed-origins": "allowed_origins",
    "--root-path": "root_path",
    "--ssl-keyfile": "ssl_keyfile",
    "--ssl-certfile": "ssl_certfile",
}

_BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def flag_of(name: str) -> str:
    """The flag that sets a setting."""
    return VLLM_NAMES.get(name, "--" + name.replace("_", "-"))


def _is_bool(annotation: Any) -> bool:
    """bool, or bool | None (unset: kiln decides, e.g. async_scheduling): both are --x / --no-x."""
    return annotation is bool or (set(typing.get_args(annotation)) == {bool, type(None)})


def _is_list(annotation: Any) -> bool:
    return typing.get_origin(annotation) is list or any(
        typing.get_origin(a) is list for a in typing.get_args(annotation)
    )


def _choices(name: str, annotation: Any) -> list[str] | None:
    literal = [a for a in (annotation, *typing.get_args(annotation)) if typing.get_origin(a) is typing.Literal]
    if not literal:
        return None
    choices = [str(c) for c in typing.get_args(literal[0])]
    if name == "dtype":
        choices += [a for a, target in DTYPE_ALIASES.items() if target in choices]
    return choices


def _metavar(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    base = args[0]
    if typing.get_origin(base) is list:
        base = typing.get_args(base)[0]
    return {int: "INT", float: "FLOAT", Path: "PATH"}.get(base, "JSON" if typing.get_origin(base) is dict else "STR")


def default_text(field) -> str | None:
    """A setting's default as --help and the README show it (None: no default value)."""
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is None:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _help_default(field) -> str:
    text = default_text(field)
    return "" if text is None else f" (default: {text})"


class _SettingAction(argparse.Action):
    """Stores a setting's value; `--no-x` stores False; a deprecated name warns."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string in DEPRECATED_FLAGS:
            logger.warning("%s is deprecated; use %s", option_string, flag_of(DEPRECATED_FLAGS[option_string]))
        if (option_string or "").startswith("--no-"):
            values = False
        elif self.nargs == 0:
            values = True
        setattr(namespace, self.dest, values)


def add_settings_flags(parser: argparse.ArgumentParser, model_cls=EngineSettings, skip: tuple[str, ...] = ()) -> None:
    """One flag per setting of `model_cls` (descriptions, defaults and choices in --help)."""
    title = {"EngineSettings": "engine settings", "ServerSettings": "server settings"}.get(
        model_cls.__name__, model_cls.__name__
    )
    group = parser.add_argument_group(f"{title} (also KILN_<NAME> variables and kiln.toml)")
    for name, field in model_cls.model_fields.items():
        if name in skip:
            continue
        ann = field.annotation
        kwargs: dict[str, Any] = dict(
            dest=DEST_PREFIX + name,
            default=argparse.SUPPRESS,
            action=_SettingAction,
            help=(field.description or name.replace("_", " ")).replace("%", "%%") + _help_default(field),
        )
        names = [flag_of(name)] + ([SHORT_FLAGS[name]] if name in SHORT_FLAGS else [])
        if _is_bool(ann):
            names.append("--no-" + flag_of(name).removeprefix("--"))
            kwargs["nargs"] = 0
            if ann is not bool:  # bool | None: also `--x true|false`, for parsers that skip normalize_argv
                kwargs.update(nargs="?", const=True, type=_bool_word, metavar="true|false")
        elif _is_list(ann):
            kwargs.update(nargs="+", metavar=_metavar(ann))
        elif (choices := _choices(name, ann)) is not None:
            # (Shown, not enforced here: the setting's check names the value and its flag, and a
            # vLLM value kiln lacks is that clear error rather than argparse's "invalid choice".)
            kwargs["metavar"] = "{" + ",".join(choices) + "}"
        else:
            kwargs["metavar"] = _metavar(ann)
        group.add_argument(*names, **kwargs)
        for old, target in DEPRECATED_FLAGS.items():
            if target == name:
                group.add_argument(old, **{**kwargs, "help": argparse.SUPPRESS})


def _bool_word(text: str) -> bool:
    if text.lower() not in _BOOL_WORDS:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return _BOOL_WORDS[text.lower()]


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Accept `--flag true|false` / `--flag=false` for boolean flags (kiln's older spelling).
    Optional booleans (nargs "?") come out as `--flag=true|false`, so a bare one never takes the
    word after it (a MODEL) for its value."""
    kinds = {
        opt: action.nargs
        for action in _all_actions(parser)
        if isinstance(action, _SettingAction) and action.nargs in (0, "?")
        for opt in action.option_strings
    }
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, _, inline = token.partition("=")
        if flag in kinds and not flag.startswith("--no-"):
            value = inline if inline else (argv[i + 1] if i + 1 < len(argv) else "")
            on = _BOOL_WORDS.get(value.lower(), None)
            step = 1 if inline or on is None else 2
            on = True if on is None else on
            if kinds[flag] == "?":
                out.append(f"{flag}={'true' if on else 'false'}")
            else:
                out.append(flag if on else "--no-" + flag.removeprefix("--"))
            i += step
            continue
        if flag in kinds and kinds[flag] == "?" and not inline:  # `--no-x`
            out.append("--" + flag.removeprefix("--no-") + "=false")
            i += 1
            continue
        out.append(token)
        i += 1
    return out


def _all_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_actions(sub)


def config_file_args(path: str) -> list[str]:
    """vLLM's --config: a YAML (or TOML) file of flags, `max-model-len: 4096` / `max_model_len = 4096`."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise SettingsError(f"--config {path}: no such file")
    text = file.read_text()
    try:
        if file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text) or {}
    except Exception as exc:  # yaml / toml syntax errors: name the file
        raise SettingsError(f"--config {path}: cannot parse: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path}: expected a mapping of flag names to values")
    args: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, list):
            args += [flag, *(str(v) for v in value)]
        elif isinstance(value, dict):
            args += [flag, json.dumps(value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def given_settings(args: argparse.Namespace, model_cls) -> dict[str, Any]:
    values = {k.removeprefix(DEST_PREFIX): v for k, v in vars(args).items() if k.startswith(DEST_PREFIX)}
    return {k: v for k, v in values.items() if k in model_cls.model_fields}


def settings_from_args(args: argparse.Namespace, model_cls=EngineSettings, **extra: Any):
    """The settings object: flags over KILN_* variables over kiln.toml over defaults; errors name
    their source."""
    values = given_settings(args, model_cls)
    flags = {name: flag_of(name) for name in values}
    values.update(extra)
    return build_settings(model_cls, values, flags)


class SuggestingParser(argparse.ArgumentParser):
    """argparse without prefix matching, and with a "did you mean" for a misspelt flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [opt for action in _all_actions(self) for opt in action.option_strings]
            hints = [
                f"{word}{did_you_mean(word, known)}"
                for word in message.split(":", 1)[1].split()
                if word.startswith("-")
            ]
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        super().error(message)


def print_error(exc: Exception) -> None:
    for line in str(exc).splitlines():
        print(f"kiln: error: {line}", file=sys.stderr)
