"""Where settings come from besides flags and keyword arguments: kiln.toml (or the file $KILN_CONFIG
names) and KILN_* environment variables. Reading the file, refusing a key no setting has (with a
suggestion), warning of a KILN_* variable no setting reads, and saying where a value came from.
The settings themselves are defined in settings.py."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, InitSettingsSource

from engine.config.values import did_you_mean


class SettingsError(ValueError):
    """A settings problem, already phrased for the user (one line per problem)."""


# KILN_* variables that are not settings fields (read here and by default_cache_dir; the instruction-set
# limit, read by process_env before torch loads; or by the tests: soak sizes, the GPU check's strict mode).
OTHER_ENV_VARS = (
    "KILN_CONFIG",
    "KILN_CACHE_DIR",
    "KILN_CPU_ISA",
    "KILN_SOAK_REQUESTS",
    "KILN_SERVER_SOAK_STREAMS",
    "KILN_GPU_CHECK_STRICT",
)


def config_file_path() -> Path:
    return Path(os.environ.get("KILN_CONFIG", "kiln.toml"))


def read_config_file() -> tuple[Path, dict[str, Any], str] | None:
    """(path, table, text) of kiln.toml / $KILN_CONFIG; None when the default file is absent.

    A KILN_CONFIG naming a missing file and a TOML syntax error are errors naming the file."""
    path = config_file_path()
    if not path.is_file():
        if "KILN_CONFIG" in os.environ:
            raise SettingsError(f"KILN_CONFIG={os.environ['KILN_CONFIG']}: no such file")
        return None
    text = path.read_text()
    try:
        return path, tomllib.loads(text), text
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: TOML syntax error: {exc}") from None


def _config_line(text: str, key: str) -> int | None:
    for number, line in enumerate(text.splitlines(), 1):
        if re.match(rf"\s*{re.escape(key)}\s*=", line):
            return number
    return None


class ConfigFileSource(InitSettingsSource):
    """kiln.toml, shared by every settings class: each takes its own keys; a key that is no
    setting of any class (`known`) is an error with a suggestion."""

    def __init__(self, settings_cls: type[BaseSettings], known: Iterable[str]):
        found = read_config_file()
        data: dict[str, Any] = {}
        if found is not None:
            path, table, text = found
            known = set(known)
            for key in table:
                if key not in known:
                    where = f"{path}:{_config_line(text, key) or '?'}"
                    raise SettingsError(f"{where}: unknown setting {key!r}{did_you_mean(key, known)}")
            data = {k: v for k, v in table.items() if k in settings_cls.model_fields}
        super().__init__(settings_cls, data)


def unknown_env_vars(setting_names: Iterable[str]) -> list[str]:
    """Warnings for KILN_* variables that no setting reads (a misspelling is otherwise silent)."""
    known = {"KILN_" + name.upper() for name in setting_names}
    known.update(OTHER_ENV_VARS)
    return [
        f"{name} is not a kiln setting and is ignored{did_you_mean(name, known)}"
        for name in sorted(os.environ)
        if name.startswith("KILN_") and name not in known
    ]


def setting_source(name: str, flags: dict[str, str] | None = None) -> str:
    """Where a setting's value came from: the flag, the KILN_ variable, kiln.toml:LINE, or a default."""
    if flags and name in flags:
        return flags[name]
    if "KILN_" + name.upper() in os.environ:
        return "KILN_" + name.upper()
    try:
        found = read_config_file()
    except SettingsError:
        found = None
    if found is not None and name in found[1]:
        return f"{found[0]}:{_config_line(found[2], name) or '?'}"
    return "a keyword argument" if flags is None else "the default"
