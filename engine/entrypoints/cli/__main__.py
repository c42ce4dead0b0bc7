"""`python -m engine.entrypoints.cli ...`: the `kiln` command without the console script."""

import sys

from engine.entrypoints.cli.main import main

sys.exit(main())
