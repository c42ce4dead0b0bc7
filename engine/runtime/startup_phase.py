"""A start-up phase, logged when it starts and with how long it took when it ends, so a cold start
says what it is doing."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)


class Phase:
    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> "Phase":
        logger.info("%s ...", self.what)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.t0
        if exc[0] is None:
            logger.info("%s: done in %.1fs", self.what, self.seconds)
