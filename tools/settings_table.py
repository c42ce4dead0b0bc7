"""Generate the docs' settings, vLLM-flag and metrics tables from the code.

    python tools/settings_table.py --write docs/*.md   # rewrite the generated blocks in place
    python tools/settings_table.py --check docs/*.md   # exit 1 if any is out of date (tests run this)

Each block sits between `<!-- generated:NAME -->` and `<!-- /generated:NAME -->` markers, in
whichever of the files; every block must be in one of them.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _default(field) -> str:
    from engine.entrypoints.cli.flags import default_text

    if field.default_factory is not None:
        return "(computed)"  # (depends on the environment, e.g. the cache directory)
    text = default_text(field)
    return "" if text is None else text if text in ("on", "off") else f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def settings_table() -> str:
    from engine.config.server_settings import ServerSettings
    from engine.config.settings import EngineSettings
    from engine.entrypoints.cli.flags import flag_of

    rows = ["| setting | flag | environment | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for cls in (EngineSettings, ServerSettings):
        for name, field in cls.model_fields.items():
            flag = flag_of(name)
            if field.annotation is bool:
                flag += f" / --no-{flag[2:]}"
            rows.append(
                f"| `{name}` | `{flag}` | `KILN_{name.upper()}` | {_default(field)} | "
                f"{_cell(field.description or '')} |"
            )
    return "\n".join(rows)


def vllm_flags_table() -> str:
    from engine.config.settings import SETTING_NAMES
    from engine.entrypoints.cli.vllm_flag_table import IMPLEMENTED, NO_EFFECT, VLLM_ALIASES, VLLM_FLAGS_TABLE

    aliases: dict[str, list[str]] = {}
    for alias, flag in VLLM_ALIASES.items():
        aliases.setdefault(flag, []).append(alias)
    rows = ["| vLLM flag | kind | what kiln does |", "| --- | --- | --- |"]
    for flag, entry in VLLM_FLAGS_TABLE.items():
        names = " ".join(f"`{n}`" for n in [flag, *aliases.get(flag, [])])
        if entry.shape == "b":
            names += f" / `--no-{flag[2:]}`"
        if entry.kind == IMPLEMENTED:
            text = f"`{entry.setting}`" if entry.setting in SETTING_NAMES else ""
            if not entry.what.startswith("sets "):
                text += (": " if text else "") + entry.what
        elif entry.kind == NO_EFFECT:
            text = f"logged, ignored: {entry.what}"
        else:
            ok = {"b": "`--no-` form", "s": ""}.get(entry.shape, ", ".join(f"`{v}`" for v in entry.ok if v))
            text = f"one-line error: kiln lacks {entry.what}" + (f" (accepted: {ok})" if ok else "")
        rows.append(f"| {names} | {entry.kind} | {_cell(text)} |")
    return "\n".join(rows)


def metrics_table() -> str:
    from prometheus_client import CollectorRegistry

    from engine.entrypoints.openai.metrics import EngineMetrics

    metrics = EngineMetrics("model", log_stats_interval=0, registry=CollectorRegistry(auto_describe=True))
    rows = ["| metric | type | what it measures |", "| --- | --- | --- |"]
    for family in metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")  # (as /metrics shows it)
        rows.append(f"| `{name}` | {family.type} | {_cell(family.documentation)} |")
    return "\n".join(rows)


BLOCKS = {"settings": settings_table, "vllm-flags": vllm_flags_table, "metrics": metrics_table}


def render(text: str) -> tuple[str, set[str]]:
    """The text with its generated blocks rewritten, and the names of the blocks it holds."""
    found = set()
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(text):
            continue
        found.add(name)
        body = make() + "\n"
        text = pattern.sub(lambda m, body=body: m.group(1) + body + m.group(2), text)
    return text, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", nargs="+")
    mode.add_argument("--check", metavar="FILE", nargs="+")
    args = parser.parse_args(argv)
    stale, seen = [], set()
    for path in map(Path, args.write or args.check):
        text = path.read_text()
        new, found = render(text)
        seen |= found
        if new != text:
            stale.append(path)
            if args.write:
                path.write_text(new)
    missing = set(BLOCKS) - seen
    if missing:
        print(f"settings_table: no file holds the generated block(s) {sorted(missing)}", file=sys.stderr)
        return 1
    if args.check and stale:
        print(
            f"{', '.join(map(str, stale))}: generated tables are out of date; run `make settings-table`",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
