"""Print the short table at the end of tools/gpu_check.sh from the JSON files under $OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(out: Path) -> None:
    for path in sorted(out.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            continue
        if isinstance(data, dict):
            keys = [k for k, v in data.items() if isinstance(v, (int, float, str)) and len(str(v)) < 40]
            print(f"{path.stem}: " + ", ".join(f"{k}={_fmt(data[k])}" for k in keys[:14]))
        elif isinstance(data, list):
            print(f"{path.stem}:")
            for row in data[:40]:
                print("   " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items() if not isinstance(v, (list, dict))))


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
