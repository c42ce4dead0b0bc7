"""README.md is short and self-contained, its links resolve, and the docs' generated tables
(settings, vLLM flags, metrics) are current and name every setting."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_generated_tables_are_up_to_date():
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "settings_table.py"), "--check", *map(str, DOCS)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr + " (run `make settings-table`)"


def test_the_table_check_fails_on_a_stale_table(tmp_path):
    stale = tmp_path / "settings.md"
    stale.write_text((ROOT / "docs" / "settings.md").read_text().replace("`KILN_MAX_NUM_SEQS`", "`KILN_OLD_NAME`"))
    others = [p for p in DOCS if p.name != "settings.md"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "settings_table.py"), "--check", str(stale), *map(str, others)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and "out of date" in result.stderr


def test_docs_name_every_setting():
    from engine.config.server_settings import ServerSettings
    from engine.config.settings import EngineSettings

    text = (ROOT / "docs" / "settings.md").read_text()
    for cls in (EngineSettings, ServerSettings):
        for name in cls.model_fields:
            assert f"`KILN_{name.upper()}`" in text, name


def test_readme_is_short_and_points_nowhere_outside_the_repo():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for path in [ROOT / "README.md", *DOCS]:
        body = path.read_text()
        assert "../" not in body.replace("](../", "") and "DESIGN.md" not in body, path
        for target in re.findall(r"\]\(([^)#:]+)\)", body):  # relative links resolve
            assert (path.parent / target).exists(), f"{path.name} links to missing {target}"


def test_every_file_path_the_docs_name_exists():
    for path in [ROOT / "README.md", *DOCS]:
        for name in re.findall(r"`((?:engine|compiler|templates|tools|tests)/[\w/.-]+)`", path.read_text()):
            assert (ROOT / name.rstrip("/")).exists(), f"{path.name} names {name}, which does not exist"
