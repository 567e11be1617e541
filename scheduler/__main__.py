"""`python -m loraplex.scheduler`: the scheduler process, started by the launcher (ProcessArgs in its environment)."""

from __future__ import annotations

import sys

from loraplex.scheduler.process import main

if __name__ == "__main__":
    sys.exit(main())
