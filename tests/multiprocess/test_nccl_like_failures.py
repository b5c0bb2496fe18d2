"""A failing stage in the middle of a 3-stage pipeline, on a transport that fails like NCCL (no error on a dead
peer, waits that never end: :mod:`tests.fixtures.nccl_like`): every rank ends within the strategy's timeout,
and the root cause is the first error the job prints.

Without the failure handling both runs hang: the failing rank drains (waiting on peers that are not draining)
and its neighbours wait forever for its messages. Each test prints the time from the rank's failure to the end
of the last process.
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


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def _start(tmp_path, how: str, name: str, **kwargs) -> tuple[subprocess.Popen, object]:
    """Start one process of the job, its stderr into a file (the ranks it starts write there too)."""
    stderr = (tmp_path / f"{name}.err").open("w")
    command = [sys.executable, "-m", RUNNER, "--devices", "3", "--fail-rank", "1", "--fail-step", "4", "--how", how,
               "--nccl-like", "--timeout", str(TIMEOUT), "--out", str(tmp_path)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT, **kwargs)
    return process, stderr


def _finish(started: list[tuple[subprocess.Popen, object]], tmp_path) -> tuple[list[int], str, float]:
    """Wait for every process (at most ``LIMIT``); their exit codes, the job's stderr, and the seconds from the
    failing rank's failure to the end of the last process."""
    deadline = time.monotonic() + LIMIT
    processes = [process for process, _ in started]
    try:
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(processes[0].pid, signal.SIGKILL)
        pytest.fail(f"the job did not come down within {LIMIT} s")
    _wait_for_session(processes[0].pid)  # ranks started by Lightning's launcher are not our children
    ended = time.time()
    errors = []
    for _, stderr in started:
        stderr.close()
        errors.append(open(stderr.name).read())
    death = tmp_path / "death.json"
    assert death.exists(), "\n".join(errors)[-4000:]
    return [p.returncode for p in processes], "".join(errors), ended - json.loads(death.read_text())["time"]


def _wait_for_session(pgid: int) -> None:
    """Return once no process of the session is left (at most ``LIMIT``); fail otherwise."""
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail("a process of the job is still running")


def _first_error_line(stderr: str) -> str:
    return next((line for line in stderr.splitlines() if NAMES_AN_ERROR.search(line)), "")


def test_middle_stage_error_ends_every_rank_root_cause_first(tmp_path):
    """Rank 1 (stage 1 of 3) raises inside a forward at step 4; Lightning's launcher started the ranks."""
    started = [_start(tmp_path, "raise", "job", env=_env(), start_new_session=True)]
    codes, stderr, seconds = _finish(started, tmp_path)
    print(f"\nfailure to the end of the last rank: {seconds:.1f} s (strategy timeout {TIMEOUT} s)")
    assert codes[0] != 0, stderr[-4000:]
    first = _first_error_line(stderr)
    assert first.startswith("rank 1 (stage 1 of 3) failed: RuntimeError: injected failure at step 4"), stderr[-4000:]
    for rank, stage in ((0, 2), (2, 0)):  # each neighbour says why it stopped
        assert f"rank {rank} (stage {stage} of 3) stops: stage 1 (rank 1) failed: RuntimeError: injected" in stderr
    assert seconds < TIMEOUT, stderr[-4000:]


def test_middle_stage_killed_ends_every_rank_naming_it(tmp_path):
    """Rank 1 is killed (SIGKILL, no word) at step 4. The ranks are started as torchrun or SLURM start them (one
    process each), so no launcher of Lightning's notices the death: only the watchdog can."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = []
    for rank in range(3):
        env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE="3")
        group = {"process_group": 0 if rank == 0 else started[0][0].pid}  # one group, to end it at once
        started.append(_start(tmp_path, "kill", f"rank{rank}", env=env, **group))
    codes, stderr, seconds = _finish(started, tmp_path)
    print(f"\nrank 1 killed to the end of the last rank: {seconds:.1f} s (strategy timeout {TIMEOUT} s)")
    assert codes[1] == -signal.SIGKILL
    assert codes[0] != 0 and codes[2] != 0, (codes, stderr[-4000:])
    for rank, stage in ((0, 2), (2, 0)):
        assert f"rank {rank} (stage {stage} of 3) stops: stage 1 (rank 1) died or stopped responding" in stderr, stderr
    assert seconds < TIMEOUT, stderr[-4000:]
