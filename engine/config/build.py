"""Settings built from their sources, with every validation error told in one line: the setting,
its value, where the value came from (a flag, KILN_X, kiln.toml:LINE or a keyword) and what is
allowed."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from pydantic_settings import BaseSettings

from engine.config.sources import SettingsError, setting_source
from engine.config.values import did_you_mean


def build_settings(cls: type[BaseSettings], values: dict[str, Any], flags: dict[str, str] | None = None):
    """cls(**values), with each validation error turned into one line naming the setting, its
    value, where that came from (flag / KILN_X / kiln.toml:LINE) and what is allowed."""
    from pydantic_settings import SettingsError as SourceError

    try:
        return cls(**values)
    except ValidationError as exc:
        raise SettingsError("\n".join(_explain(err, cls, flags) for err in exc.errors())) from None
    except SourceError as exc:  # a KILN_* value the environment source could not read
        raise SettingsError(str(exc)) from None


def _explain(err: ErrorDetails, cls: type[BaseSettings], flags: dict[str, str] | None) -> str:
    loc = [str(part) for part in err.get("loc", ())]
    msg = err.get("msg", "invalid").removeprefix("Value error, ")
    if not loc:  # a rule over several settings
        return f"settings: {msg}"
    name = loc[0]
    if err.get("type") == "extra_forbidden":
        return f"unknown setting {name!r}{did_you_mean(name, cls.model_fields)}"
    value = err.get("input")
    allowed = ""
    ctx = err.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in msg:
        allowed = f" (allowed: {ctx['expected']})"
    return f"{name} = {value!r} (from {setting_source(name, flags)}): {msg}{allowed}"
