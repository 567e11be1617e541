"""`loraplex [serve MODEL]` / scripts/launch_server.py: parse flags, start the server, exit non-zero with one line on
failure."""

from __future__ import annotations

import logging
import signal
import sys

from loraplex.frontend.entrypoints.cli import parse_command_line
from loraplex.frontend.model_files import ModelFilesError, resolve_model_files
from loraplex.protocol.config import ConfigError
from loraplex.protocol.curve import ClusterKey, ClusterKeyError, write_key_file
from loraplex.protocol.proc import setup_logging
from loraplex.protocol.quantization import read_hf_config, resolve_quantization


def keygen(argv: list[str]) -> None:
    """`loraplex keygen PATH`: a new cluster key file (mode 0600) for --cluster-key-file."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: loraplex keygen PATH  (writes a new --cluster-key-file, mode 0600)", file=sys.stderr)
        sys.exit(2)
    try:
        write_key_file(argv[0])
    except (ClusterKeyError, OSError) as e:
        print(f"loraplex keygen: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {argv[0]}: copy it to every node (and RPC client) as --cluster-key-file; keep it secret")


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["keygen"]:
        keygen(argv[1:])
        return
    try:
        config, notes = parse_command_line(argv)
        ClusterKey.of(config.cluster_key_file)  # a missing or open key file stops the start here, in one line
    except (ConfigError, ClusterKeyError) as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        sys.exit(2)
    setup_logging(config.log_level, "frontend")
    for note in notes:  # vLLM's and SGLang's flags that change nothing here, said once each
        logging.getLogger("loraplex").info("%s", note)
    # A Hub model is downloaded here, once per machine, before any rank starts. SIGTERM then unwinds (the file being
    # written is removed; finished files stay in the cache and the next start goes on from them).
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        model_files = resolve_model_files(config)
    except ModelFilesError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("loraplex: error: stopped while fetching the model (finished files are kept)", file=sys.stderr)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    try:  # a checkpoint whose quantization is not served never starts
        resolve_quantization(config.quantization, read_hf_config(model_files.model_dir))
    except ConfigError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        sys.exit(2)
    import uvloop
    from loraplex.frontend.entrypoints.headless import serve_headless
    from loraplex.frontend.entrypoints.http_server import serve
    from loraplex.frontend.runtime import Runtime

    try:
        if config.node_rank > 0:  # only this node's ranks, and /health
            sys.exit(uvloop.run(serve_headless(config, model_files)))
        uvloop.run(serve(Runtime(config, model_files)))
    except (RuntimeError, OSError, ValueError) as e:
        logging.getLogger("loraplex").debug("start-up failed", exc_info=True)
        print(f"loraplex: error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
