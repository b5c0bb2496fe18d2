"""The test runner for multi-process commands leaves no process behind, whether the command returns or times out."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures.helpers import run_group

# Starts a child that would outlive it (an orphaned rank), prints the child's pid, and exits (or hangs).
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(child.pid, flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "hang":
        time.sleep(120)
    sys.exit(3)
    """
)


def alive(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        return False
    state = next((line for line in status.read_text().splitlines() if line.startswith("State:")), "")
    return "Z" not in state.split()[1:2]  # a zombie has exited


def wait_dead(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_run_group_kills_a_child_that_outlives_its_parent(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    done = run_group([sys.executable, script, "exit"], 60)
    assert done.returncode == 3 and done.stderr.strip() == "to stderr"
    assert wait_dead(int(done.stdout.split()[0]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_run_group_timeout_kills_every_process_of_the_command(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 3") as error:
        run_group([sys.executable, script, "hang"], 3, raise_on_timeout=True)
    assert time.monotonic() - started < 30
    child = int(str(error.value).splitlines()[1])
    assert wait_dead(child)


def test_run_group_merges_stderr_in_order(tmp_path):
    done = run_group(
        [sys.executable, "-c", "import sys; print('a', flush=True); print('b', file=sys.stderr)"],
        60,
        merge_stderr=True,
        env=dict(os.environ),
    )
    assert done.returncode == 0 and done.stdout.split() == ["a", "b"] and done.stderr == ""
