#!/usr/bin/env bash
# Wheels of the packages the GPU image lacks (scripts/gpu_check/gpu_wheels.txt: msgspec, pyzmq, and xgrammar for G5b's structured
# output with its dependencies), for an offline install there; into the git-ignored .whl/ at the repository root,
# which travels with the working tree to the GPU machine. For the image's python and platform (below; the tests read
# them here). scripts/gpu_check/GPU_CHECK.md gives the command that installs them (and this tree) there and runs the GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -r scripts/gpu_check/gpu_wheels.txt
ls -l .whl
