"""Start a loraplex server: python -m scripts.launch_server --model-path PATH [--tp N] [--lora-paths ...]."""

from loraplex.frontend.entrypoints.launch import main

if __name__ == "__main__":
    main()
