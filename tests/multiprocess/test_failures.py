"""A failing stage brings the whole job down quickly, with a message, and leaves no process behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures.helpers import ROOT

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.pipeline_run"
LIMIT = 120  # seconds
TIMEOUT_S = 60  # the strategy's timeout in pipeline_run.py


def run_failing(tmp_path, devices, *extra):
    command = [
        sys.executable,
        "-m",
        RUNNER,
        "--devices",
        str(devices),
        "--microbatches",
        "2",
        "--steps",
        "12",
        "--out",
        str(tmp_path),
        *extra,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # for python -m tests...
    start = time.monotonic()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"the job did not come down within {LIMIT}s")
    elapsed = time.monotonic() - start
    leftovers = _alive_in_group(process.pid)
    if leftovers:
        os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, output, elapsed, leftovers


def _alive_in_group(pgid, grace=15.0):
    """Whether any process of the session is still alive after a grace period."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        time.sleep(0.5)
    return True


@pytest.mark.parametrize("rank", [1, 0], ids=["first-stage-killed", "last-stage-killed"])
@pytest.mark.slow
def test_killed_stage_brings_the_job_down(tmp_path, rank):
    code, output, elapsed, leftovers = run_failing(tmp_path, 2, "--kill-rank", str(rank), "--fail-step", "4")
    down = time.time() - float((tmp_path / "killed_at").read_text())
    print(f"rank {rank} killed: the job was down {down:.1f} s later, exit status {code}")
    assert not leftovers, "a process of the job is still running"
    # Noticed by the watchdog, not by a collective running into the strategy's 60 s timeout.
    assert down < TIMEOUT_S / 2, output[-3000:]
    if rank == 1:
        # The survivor (last stage, rank 0, the launcher) names the link that broke, or the stage that died, and
        # ends itself with an error, before the launcher's own SIGKILL of the job (SELF_EXIT_S).
        said = ("Pipeline link stage 1 <- stage 0", "stage 0 (rank 1) died")
        assert any(text in output for text in said), output[-3000:]
        assert code > 0, code
    else:
        # The job's own process was the one killed; the other rank notices that the store it hosted is gone.
        assert code == -signal.SIGKILL, code
        assert "stage 1 (rank 0) died or stopped responding" in output, output[-3000:]


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.slow
def test_nan_loss_stops_training_naming_step_and_microbatch(tmp_path, devices):
    code, output, elapsed, leftovers = run_failing(tmp_path, devices, "--nan-step", "3")
    assert code != 0 and not leftovers
    stage = devices - 1
    assert f"loss of step 3, micro-batch 0 is nan (computed on pipeline stage {stage})" in output, output[-3000:]
