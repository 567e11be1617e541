from __future__ import annotations

import sys

from loraplex.worker.process import main

if __name__ == "__main__":
    sys.exit(main())
