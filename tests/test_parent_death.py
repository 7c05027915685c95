"""die_with_parent (agentrl/parent_death.py): a child started with it goes when the process
that started it is SIGKILLed, as the engines' servers (`preexec_fn`) and the grader's forks do."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import psutil

from waiting import wait_until

PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from agentrl.parent_death import die_with_parent
    kwargs = {"preexec_fn": die_with_parent} if sys.argv[1] == "with" else {}
    child = subprocess.Popen(["sleep", "60"], start_new_session=True, **kwargs)
    print(child.pid, flush=True)
    time.sleep(60)
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def start_and_kill_parent(mode: str) -> int:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, mode], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    return child


def test_a_child_started_with_die_with_parent_goes_with_its_killed_parent():
    child = start_and_kill_parent("with")
    wait_until(lambda: gone(child), timeout_s=10, what="the orphaned child's death")


def test_without_it_the_child_outlives_its_killed_parent():
    """The control: what the kill leaves behind when nothing asks the kernel (the test above
    would pass for any child that exits by itself otherwise)."""
    child = start_and_kill_parent("without")
    try:
        assert not gone(child)
    finally:
        psutil.Process(child).kill()
