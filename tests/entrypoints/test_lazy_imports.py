"""What a start does not need stays unimported (issue 40: ready in seconds; `python -X importtime`
shows torch itself as most of a warm start's import time, so anything else adds to it)."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the kiln command's own module: `kiln --help`, a flag error, `kiln chat --url` answer without them
NOT_FOR_THE_COMMAND_LINE = ("torch", "numpy", "fastapi", "uvicorn", "transformers", "tokenizers")
# the server's module: these load after ready (transformers' tokenizer, the grammar compile
# workers: openai/main.py _after_ready) or on the first request that needs them
NOT_BEFORE_READY = ("transformers", "xgrammar", "jinja2", "safetensors", "gguf", "huggingface_hub")


def test_the_command_line_and_the_server_module_import_only_what_a_start_needs():
    code = (
        "import json, sys\n"
        "import engine.entrypoints.cli.main\n"
        "cli = sorted({m.split('.')[0] for m in sys.modules})\n"
        "import engine.entrypoints.openai.main\n"
        "server = sorted({m.split('.')[0] for m in sys.modules})\n"
        "print(json.dumps({'cli': cli, 'server': server}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert [m for m in NOT_FOR_THE_COMMAND_LINE if m in loaded["cli"]] == []
    assert [m for m in NOT_BEFORE_READY if m in loaded["server"]] == []
    assert "torch" in loaded["server"] and "fastapi" in loaded["server"]  # (the check sees what loads)
