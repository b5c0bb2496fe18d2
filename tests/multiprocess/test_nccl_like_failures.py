"""A failing stage in the middle of a 3-stage pipeline, on a transport that fails like NCCL (no error on a dead
peer, waits that never end: :mod:`tests.fixtures.nccl_like`): every rank ends within the strategy's timeout,
and the root cause is the first error the job prints.

The ranks are started as torchrun or SLURM start them, one process each: on one machine Lightning's own
launcher would also end the job when a rank's process exits, but not across machines. Without the failure
handling the neighbours of the failing rank wait forever for its messages and both tests hang. Each test
prints the time from the rank's failure to the end of the last process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.fixtures.helpers import ROOT

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.failure_run"
TIMEOUT = 30  # the strategy's timeout in these runs, seconds
LIMIT = 240  # the whole job, start-up included, on a loaded machine
# An exception's name with its message, or a rank's report of a failure or a death.
NAMES_AN_ERROR = re.compile(r"\w(Error|Exception):|\bfailed: |\bdied\b")


def _start_job(tmp_path, how: str) -> tuple[list[subprocess.Popen], object]:
    """Start the job's 3 processes as torchrun or SLURM start them (one each, ``LOCAL_RANK`` set, so no launcher
    of Lightning's watches them), in one process group, their stderr into one file (a job's log)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stderr = (tmp_path / "job.err").open("a")  # appends: the ranks' lines keep their order in time
    command = [sys.executable, "-m", RUNNER, "--devices", "3", "--fail-rank", "1", "--fail-step", "4", "--how", how,
               "--nccl-like", "--timeout", str(TIMEOUT), "--out", str(tmp_path)]  # fmt: skip
    processes: list[subprocess.Popen] = []
    for rank in range(3):
        env = dict(
            os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="3",
        )  # fmt: skip
        group = 0 if rank == 0 else processes[0].pid  # one group, to end it at once
        processes.append(
            subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT, env=env, process_group=group)
        )
    return processes, stderr


def _finish(processes: list[subprocess.Popen], stderr, tmp_path) -> tuple[list[int], str, float]:
    """Wait for every process (at most ``LIMIT``); their exit codes, the job's stderr, and the seconds from the
    failing rank's failure to the end of the last process."""
    deadline = time.monotonic() + LIMIT
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(processes[0].pid, signal.SIGKILL)
        pytest.fail(f"the job did not come down within {LIMIT} s")
    ended = time.time()
    stderr.close()
    output = open(stderr.name).read()
    death = tmp_path / "death.json"
    assert death.exists(), output[-4000:]
    return [p.returncode for p in processes], output, ended - json.loads(death.read_text())["time"]


def _first_error_line(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if NAMES_AN_ERROR.search(line)), "")


def test_middle_stage_error_ends_every_rank_root_cause_first(tmp_path):
    """Rank 1 (stage 1 of 3) raises inside a forward at step 4."""
    processes, stderr = _start_job(tmp_path, "raise")
    codes, output, seconds = _finish(processes, stderr, tmp_path)
    print(f"\nfailure to the end of the last rank: {seconds:.1f} s (strategy timeout {TIMEOUT} s)")
    assert all(code != 0 for code in codes), (codes, output[-4000:])
    first = _first_error_line(output)
    assert first.startswith("rank 1 (stage 1 of 3) failed: RuntimeError: injected failure at step 4"), output[-4000:]
    for rank, stage in ((0, 2), (2, 0)):  # each neighbour says why it stopped
        assert f"rank {rank} (stage {stage} of 3) stops: stage 1 (rank 1) failed: RuntimeError: injected" in output
    assert seconds < TIMEOUT, output[-4000:]


def test_middle_stage_killed_ends_every_rank_naming_it(tmp_path):
    """Rank 1 is killed (SIGKILL, no word) at step 4."""
    processes, stderr = _start_job(tmp_path, "kill")
    codes, output, seconds = _finish(processes, stderr, tmp_path)
    print(f"\nrank 1 killed to the end of the last rank: {seconds:.1f} s (strategy timeout {TIMEOUT} s)")
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0 and codes[2] != 0, (codes, output[-4000:])
    for rank, stage in ((0, 2), (2, 0)):
        assert f"rank {rank} (stage {stage} of 3) stops: stage 1 (rank 1) died or stopped responding" in output, output
    assert seconds < TIMEOUT, output[-4000:]
