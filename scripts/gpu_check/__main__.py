"""`python -m scripts.gpu_check [flags]`: runner.py's command line; exits 1 when a check failed or a group erred."""

from __future__ import annotations

import sys

from scripts.gpu_check.runner import main

if __name__ == "__main__":
    report = main()
    if report is not None:
        summary = report["summary"]
        sys.exit(1 if summary["fail"] or summary["error"] else 0)
