"""`python -m engine.entrypoints.cli ...`: the `kiln` command without the console script."""

import sys

from engine.entrypoints.cli.main import main

if __name__ == "__main__":  # (importing the module, as the GPU check's import sweep does, runs nothing)
    sys.exit(main())
