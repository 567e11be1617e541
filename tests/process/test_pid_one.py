"""A server that is PID 1 of its PID namespace (a container's entrypoint, as in tests/integrations/test_image.py)
keeps its children: a child compares its parent with the pid the server gave it (protocol/proc.py: die_with_parent),
since a parent that is PID 1 looks like the re-parenting that follows a dead parent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from loraplex.protocol.proc import PARENT_PID_ENV

CHILD = "from loraplex.protocol.proc import die_with_parent; die_with_parent(); print('alive')"
# PID 1 of a new PID namespace starts the child as the server's process group does, with or without its pid
PARENT = f"""
import os, subprocess, sys
assert os.getpid() == 1
env = dict(os.environ)
if sys.argv[1] == "with-pid":
    env[{PARENT_PID_ENV!r}] = str(os.getpid())
out = subprocess.run([sys.executable, "-c", {CHILD!r}], env=env, capture_output=True, text=True)
print(out.returncode, out.stdout.strip())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a PID namespace needs root")
def test_children_of_pid_one_live_when_given_its_pid():
    def run(mode: str) -> str:
        env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}
        cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", PARENT, mode]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, check=True).stdout.strip()

    assert run("with-pid") == "0 alive"
    assert run("without-pid") == "1"  # the old rule: a parent of 1 means the parent died


def test_a_child_whose_parent_is_not_the_one_named_exits():
    for named, expected in ((os.getpid(), "0 alive"), (os.getpid() + 1_000_000, "1 ")):
        env = dict(os.environ, **{PARENT_PID_ENV: str(named)})
        out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
        assert f"{out.returncode} {out.stdout.strip()}" == expected
