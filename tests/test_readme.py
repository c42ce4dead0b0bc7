"""README.md is self-contained and its generated tables (settings, vLLM flags, metrics) are current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_tables_are_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "settings_table.py"), "--check",
                             str(ROOT / "README.md")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr + " (run `make settings-table`)"


def test_readme_names_every_setting_and_points_nowhere_outside_the_repo():
    from engine.config.settings import EngineSettings, ServerSettings

    text = (ROOT / "README.md").read_text()
    assert "../" not in text and "DESIGN.md" not in text
    for cls in (EngineSettings, ServerSettings):
        for name in cls.model_fields:
            assert f"`KILN_{name.upper()}`" in text, name
