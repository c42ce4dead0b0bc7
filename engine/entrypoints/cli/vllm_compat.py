"""vLLM's `vllm serve` flags on `kiln serve`: each is parsed with vLLM's value shape and answered
as vllm_flag_table.py says (implemented / no effect / refused).

Flags that are kiln settings already come from flags.py; this adds the rest: vLLM spellings of
kiln settings (stored as the setting), and flags kiln does not use (recorded, then checked once
after parsing by `check_vllm_flags`: refused ones raise, no-effect ones are logged once).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from typing import Any

from engine.config.sources import SettingsError
from engine.config.values import parse_human_int
from engine.entrypoints.cli.vllm_flag_table import IMPLEMENTED, REFUSED, VLLM_ALIASES, VLLM_FLAGS_TABLE, VllmFlag

logger = logging.getLogger("engine.entrypoints.cli.flags")

DEST_PREFIX = "setting__"  # (flags.py's; repeated here so the import stays one-way)
GIVEN = "vllm_flags_given"  # namespace attribute: [(flag, value), ...] of flags kiln does not use
DATA_PARALLEL = "data_parallel_size"  # namespace attribute: --data-parallel-size (replicas)
DATA_PARALLEL_FLAGS = ("--data-parallel-size", "-dp")

NARGS = {"b": 0, "s": 0, "v": None, "+": "+", "?": "?", "a": None}

# vLLM spellings whose value kiln's setting takes in another unit or sense.
CONVERT = {
    "--kv-cache-memory-bytes": lambda v: _bytes_to_gib(parse_human_int(v)),
    "--disable-log-requests": lambda v: not v,  # older vLLM: off-switch of enable_log_requests
    "--pooler-config": lambda v: _pooling_type(v),
}
# Options of structured_outputs_config that change outputs and that kiln's grammar engine lacks.
STRUCTURED_OUTPUT_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "enable_in_reasoning")
# vLLM 0.32's StructuredOutputsConfig: its backends (all served by kiln's grammar engine) and keys.
STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
STRUCTURED_OUTPUT_KEYS = ("backend", *STRUCTURED_OUTPUT_OPTIONS, "reasoning_parser", "reasoning_parser_plugin")


def _pooling_type(value: str) -> str | None:
    """--pooler-config's pooling_type (LAST / MEAN) as kiln's pooling_type; its other options are
    not kiln's."""
    config = _json_or_text(value) if value.strip() not in ("", "None", "null") else {}
    if not isinstance(config, dict) or set(config) - {"pooling_type"}:
        raise SettingsError(f"--pooler-config {value}: kiln takes only pooling_type (LAST or MEAN)")
    return str(config["pooling_type"]).lower() if config.get("pooling_type") else None


def _bytes_to_gib(value: Any) -> Any:
    return value / 2**30 if isinstance(value, int) else value  # (not a number: the setting's check names it)


class _VllmAction(argparse.Action):
    """A vLLM flag that is not a kiln setting flag: a kiln setting under vLLM's spelling, or a flag
    kiln does not use (recorded for check_vllm_flags)."""

    def __init__(self, *args: Any, flag: str, entry: VllmFlag, **kwargs: Any) -> None:
        self.flag, self.entry = flag, entry
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0:
            values = not (option_string or "").startswith("--no-")
        if self.flag == "--data-parallel-size":
            setattr(namespace, DATA_PARALLEL, values)
            return
        if self.entry.kind == IMPLEMENTED:
            assert self.entry.setting is not None
            if values == "None":  # (vLLM's spelling of "unset" for its optional values)
                return
            convert = CONVERT.get(self.flag)
            value = convert(values) if convert else values
            if value is not None:
                setattr(namespace, DEST_PREFIX + self.entry.setting, value)
            return
        given = list(getattr(namespace, GIVEN, []))
        setattr(namespace, GIVEN, [*given, (self.flag, values)])


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Every vLLM flag the parser lacks, with vLLM's value shape (help: docs/vllm_flags.md)."""
    known = {opt for action in parser._actions for opt in action.option_strings}
    aliases: dict[str, list[str]] = {}
    for alias, flag in VLLM_ALIASES.items():
        aliases.setdefault(flag, []).append(alias)
    for flag, entry in VLLM_FLAGS_TABLE.items():
        names = [flag, *aliases.get(flag, [])]
        if entry.shape == "b":
            names.insert(1, "--no-" + flag.removeprefix("--"))
        names = [n for n in names if n not in known]
        if not names:
            continue
        kwargs: dict[str, Any] = {"dest": GIVEN if entry.kind != IMPLEMENTED else DEST_PREFIX + str(entry.setting)}
        if flag == "--data-parallel-size":
            kwargs.update(type=int, dest=DATA_PARALLEL)
        parser.add_argument(
            *names,
            action=_VllmAction,
            flag=flag,
            entry=entry,
            nargs=NARGS[entry.shape],
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
            **kwargs,
        )


def vllm_argv(argv: list[str]) -> list[str]:
    """vLLM's command-line spellings in kiln's: `--max_model_len` (underscores), `-O3` (the
    optimization level), and a JSON flag's keys given one by one (`--compilation-config.mode 3`,
    `-cc.mode=3`: gathered into one JSON object)."""
    out: list[str] = []
    gathered: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        flag, dot, path = name.partition(".")
        if token.startswith("--") and "_" in flag:  # (the flag's name only: not a JSON key, not a value)
            flag = flag.replace("_", "-")
            name = flag + dot + path
            token = name + eq + inline
        if token.startswith("-O") and token[2:].lstrip("=").isdigit():
            out += ["--optimization-level", token[2:].lstrip("=")]
        elif dot and path and re.match(r"--?[A-Za-z]", flag):
            if not eq and i + 1 < len(argv) and not _is_flag(argv[i + 1]):
                inline, i = argv[i + 1], i + 1
            target = gathered.setdefault(VLLM_ALIASES.get(flag, flag), {})
            *parents, leaf = path.split(".")
            for key in parents:
                target = target.setdefault(key, {})
            target[leaf] = _json_or_text(inline) if (eq or inline) else True
        else:
            out.append(token)
        i += 1
    for flag, value in gathered.items():
        out += [flag, json.dumps(value)]
    return out


def _is_flag(token: str) -> bool:
    return re.match(r"--?[A-Za-z]", token) is not None


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value).strip()


def _asks_nothing(value: Any, ok: tuple[str, ...]) -> bool:
    """Whether a value is one of the entry's accepted ones (lists: every element; numbers by value)."""
    if isinstance(value, list):
        return all(_asks_nothing(v, ok) for v in value)
    text = _text(value).replace(" ", "")
    if text in ok:
        return True
    try:
        return any(float(text) == float(o) for o in ok if o)
    except ValueError:
        return False


def _structured_outputs_refusal(value: Any) -> str | None:
    """--structured-outputs-config: any backend name is served by kiln's grammar engine; the
    options that change outputs are refused when on."""
    text = _text(value)
    if text in ("", "none", "None", "null"):
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        return f"--structured-outputs-config: {text!r} is not JSON"
    if not isinstance(config, dict):
        return "--structured-outputs-config: expected a JSON object"
    unknown = [k for k in config if k not in STRUCTURED_OUTPUT_KEYS]
    if unknown:
        return (
            f"--structured-outputs-config: unknown key {', '.join(map(repr, unknown))} "
            f"(vLLM's keys: {', '.join(STRUCTURED_OUTPUT_KEYS)})"
        )
    if config.get("backend", "auto") not in STRUCTURED_OUTPUT_BACKENDS:
        return (
            f"--structured-outputs-config: backend {config['backend']!r} is not one of "
            f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}"
        )
    if config.get("reasoning_parser"):
        return "--structured-outputs-config: give the reasoning parser as --reasoning-parser NAME"
    if config.get("reasoning_parser_plugin"):
        return "--structured-outputs-config: reasoning_parser_plugin: kiln does not load parser plugins"
    asked = [k for k in STRUCTURED_OUTPUT_OPTIONS if config.get(k)]
    if asked:
        return f"--structured-outputs-config: {', '.join(asked)} is not supported by kiln's grammar engine"
    return None


def _refusal(flag: str, entry: VllmFlag, value: Any) -> str | None:
    if flag == "--structured-outputs-config":
        return _structured_outputs_refusal(value)
    if entry.kind != REFUSED or _asks_nothing(value, entry.ok):
        return None
    shown = flag if value is True else " ".join([flag, *map(_text, value if isinstance(value, list) else [value])])
    return f"{shown}: kiln does not support {entry.what}"


def check_vllm_flags(args: argparse.Namespace) -> list[str]:
    """Raise SettingsError for a refused flag's value; return the flags given that have no effect
    in kiln (the caller logs them once). vLLM's attention backend names are among them."""
    no_effect: list[str] = []
    for flag, value in getattr(args, GIVEN, []):
        message = _refusal(flag, VLLM_FLAGS_TABLE[flag], value)
        if message:
            raise SettingsError(message)
        if flag not in no_effect:
            no_effect.append(flag)
    if getattr(args, DATA_PARALLEL, 1) < 1:
        raise SettingsError(f"--data-parallel-size {getattr(args, DATA_PARALLEL)}: must be at least 1")
    backend = getattr(args, DEST_PREFIX + "attention_backend", None)
    if isinstance(backend, str) and backend.isupper():  # vLLM's names (FLASH_ATTN, ...); kiln's are lower case
        delattr(args, DEST_PREFIX + "attention_backend")
        no_effect.append(f"--attention-backend {backend}")
    return no_effect


def replicas_argv(serve_argv: list[str], replicas: int, host: str, port: int) -> list[str]:
    """`kiln serve ARGV --data-parallel-size N` as `kiln serve-replicas` arguments: N replicas of
    the same serve line behind a router that listens where the serve line would have."""
    owned = (*DATA_PARALLEL_FLAGS, "--host", "--port")
    rest: list[str] = []
    skip = False
    for token in serve_argv:
        if skip:
            skip = False
        elif token in owned:
            skip = True  # (and its value)
        elif not token.startswith(tuple(f"{flag}=" for flag in owned)):
            rest.append(token)
    return ["--replicas", str(replicas), "--host", host, "--port", str(port), *rest]


def log_no_effect(flags: list[str]) -> None:
    if flags:
        logger.warning(
            "vLLM flags with no effect in kiln (docs/vllm_flags.md says why): %s",
            ", ".join(flags),
        )
