#!/usr/bin/env bash
# Wheels of the packages the GPU image lacks (msgspec, pyzmq, xgrammar for G5b's structured output), for an offline
# install there; into the
# git-ignored .whl/ at the repository root, which travels with the working tree to the GPU machine.
# scripts/GPU_CHECK.md gives the command that installs them (and this tree) there and runs the GPU check.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "msgspec>=0.22,<0.24" "pyzmq>=27,<28" "xgrammar==0.2.8"
ls -l .whl
