"""Headless Chromium for the console's tests and screenshots: Debian's /usr/bin/chromium driven by Playwright
(never `playwright install`). A missing browser is an error, not a skip: CI installs it (.ci/run)."""

from __future__ import annotations

import os

CHROMIUM_PATH = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
]


def launch_chromium(playwright):
    """A Browser; fails with what to install when /usr/bin/chromium is missing."""
    if not os.path.exists(CHROMIUM_PATH):
        raise RuntimeError(f"{CHROMIUM_PATH} is missing: install Debian's chromium (apt-get install chromium)")
    return playwright.chromium.launch(executable_path=CHROMIUM_PATH, args=CHROMIUM_ARGS)
