"""A process that called ``die_with_parent`` ends when its parent is SIGKILLed: through the kernel's parent-death
signal, and through the polling thread that stands in for it where that is unavailable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

# the parent: starts the child in a session of its own (as torchrun starts a rank), prints its pid, waits to be killed
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], start_new_session=True, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "armed"
print(child.pid, flush=True)
time.sleep(60)
"""
CHILD = {
    "pdeathsig": "from hybrid_rl.lifeline import die_with_parent; how = die_with_parent(); "
                 "assert how == 'pdeathsig', how; print('armed', flush=True); import time; time.sleep(60)",
    "watch": "import os; from hybrid_rl.lifeline import watch_parent; watch_parent(os.getppid(), poll_s=0.1); "
             "print('armed', flush=True); import time; time.sleep(60)",
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", sorted(CHILD))
def test_the_child_dies_within_seconds_of_its_parents_sigkill(how):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD[how]], stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = psutil.Process(int(parent.stdout.readline()))
        time.sleep(0.5)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE  # alive while its parent is
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        gone, alive = psutil.wait_procs([child], timeout=5)
        assert not alive, f"pid {child.pid} outlived its parent by 5 s"
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
