"""A headless Chromium (Debian's package) driven by playwright, for the chat page's test. Missing
chromium or playwright: a failure under CI or as root (`make test` installs both: chromium with
apt-get as root, playwright with the test extras), else a skip that says what to install."""

from __future__ import annotations

import contextlib
import os
import shutil


def _missing(why: str, fail, skip) -> None:
    (fail if os.environ.get("CI") or os.geteuid() == 0 else skip)(why)


def chromium_executable(fail, skip) -> str:
    exe = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        _missing("chromium is not installed (apt-get install chromium; make test does it as root)", fail, skip)
    return exe


@contextlib.contextmanager
def headless_chromium(fail, skip):
    """A playwright Browser on the system's chromium (playwright downloads no browser of its own)."""
    exe = chromium_executable(fail, skip)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e '.[test]'; make test does it)", fail, skip)
    with sync_playwright() as pw:
        # --no-sandbox: Chromium's sandbox refuses to run as root, which is how CI runs.
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
