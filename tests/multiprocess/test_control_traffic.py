"""Per-step control traffic of a pipeline: which collectives a training step posts, and a SIGTERM on one rank
stopping every rank at the same step."""

from __future__ import annotations

import json
import sys

import pytest

from tests.fixtures.helpers import run_script

pytestmark = pytest.mark.multiprocess

RUN = "tests.multiprocess.scripts.control_run"


def run(tmp_path, *args: str, timeout: float = 240) -> tuple[list[dict], str]:
    code, output = run_script([sys.executable, "-m", RUN, "--out", str(tmp_path), *args], timeout)
    records = sorted(tmp_path.glob("rank*.json"))
    return [json.loads(path.read_text()) for path in records], output


def steady_steps(tmp_path, devices: int) -> list[tuple[int, list]]:
    """``(rank, collectives of one step)`` for every steady-state step (from the third) of a 6-step run."""
    records, output = run(tmp_path, "--devices", str(devices), "--pipeline-size", "2", "--steps", "6")
    assert len(records) == devices, output[-4000:]
    assert all(len(record["collectives"]) >= 5 for record in records), output[-3000:]
    return [(rank, calls) for rank, record in enumerate(records) for calls in record["collectives"][2:]]


@pytest.mark.slow
def test_one_collective_per_step_on_one_pipeline(tmp_path):
    """One pipeline of two stages: a steady-state step posts one collective, the relay's message (Lightning's
    SIGTERM broadcast and a separate metrics broadcast were two)."""
    for rank, calls in steady_steps(tmp_path, 2):
        assert calls == [["all_reduce", 2]], (rank, calls)


@pytest.mark.slow
def test_no_whole_world_collective_per_step_with_replicas(tmp_path):
    """Two replicas of two stages: every collective of a steady-state step runs on a group of 2 of the 4
    processes: the gradient (and, on the last stage, loss) averaging over the replicas of a stage, the
    pipeline's message and the replicas' stop flag. Nothing over all 4 (Lightning's SIGTERM broadcast was)."""
    for rank, calls in steady_steps(tmp_path, 4):
        assert calls and all(size == 2 for _, size in calls), (rank, calls)
        assert [name for name, _ in calls].count("broadcast") == 0, (rank, calls)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "rank"), [(2, 1), (2, 0), (4, 3)], ids=["first-stage", "last-stage", "replica-first-stage"]
)
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step(tmp_path, devices, rank):
    """SIGTERM reaches one process after step 3; every rank stops before the same later step and runs
    `on_exception` there with `trainer.received_sigterm` set (Lightning would stop the receiving rank alone, or,
    for a rank other than 0, block it in a broadcast inside the signal handler)."""
    records, output = run(
        tmp_path,
        "--devices",
        str(devices),
        "--pipeline-size",
        "2",
        "--steps",
        "12",
        "--sigterm-rank",
        str(rank),
        "--sigterm-step",
        "3",
    )
    assert len(records) == devices, output[-4000:]
    stops = [record["stopped_at"] for record in records]
    assert stops[0] is not None and stops == [stops[0]] * devices, (stops, output[-3000:])
    # The flag is sampled at the next step's end and read a step later: two steps (three across replicas).
    expected = {5 if devices == 2 else 6}
    if rank == 0:
        # Rank 0 started the others and passes the signal on to them, as Lightning's launcher does; a child that
        # receives it before posting the same step's message puts its flag in that message, a step earlier.
        expected.add(4)
    assert stops[0] in expected, stops
    assert all(record["received_sigterm"] for record in records)
