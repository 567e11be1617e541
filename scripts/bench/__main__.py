"""`python -m scripts.bench NAME [flags]` runs a ratio benchmark (a row of ratios.py); without NAME, or with --help,
it lists them and the benchmarks with a command line of their own (`python -m scripts.bench.NAME`)."""

from __future__ import annotations

import sys

from scripts.bench import TOOLS, ratios


def usage() -> str:
    width = max(map(len, [*ratios.RATIO_BENCHMARKS, *TOOLS]))
    lines = ["usage: python -m scripts.bench NAME [--quick] [--json PATH] [...]   (NAME --help: its flags)", "",
             "ratio benchmarks (both sides measured in one run, one table):"]
    lines += [f"  {name:<{width}}  {what}" for name, what in ratios.RATIO_BENCHMARKS.items()]
    lines += ["", "with a command line of their own: python -m scripts.bench.NAME [--help]"]
    lines += [f"  {name:<{width}}  {what}" for name, what in TOOLS.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(usage())
    elif sys.argv[1] in ratios.RATIO_BENCHMARKS:
        ratios.main(sys.argv[1], sys.argv[2:])
    else:
        sys.exit(f"unknown benchmark {sys.argv[1]!r}\n\n{usage()}")
