"""Start a loraplex server: python scripts/launch_server.py --model-path PATH [--tp N] [--lora-paths ...]."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from frontend.launch import main  # noqa: E402

if __name__ == "__main__":
    main()
