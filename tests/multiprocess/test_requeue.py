"""SLURM's requeue signal on one rank of a 2-stage job: every rank checkpoints at the same step boundary and stops,
rank 0 requeues the job, and the requeued job resumes the uninterrupted trajectory exactly.

SLURM is faked (tests/multiprocess/scripts/requeue_run.py): its variables, and an ``scontrol`` that records its
arguments. Lightning alone would save from inside the signal handler, in the middle of a pipeline step, on the
rank that got the signal, and hang there in the flush.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.fixtures.helpers import run_script

pytestmark = pytest.mark.multiprocess

RUN = "tests.multiprocess.scripts.requeue_run"
STEPS, SIGNAL_STEP, JOB_ID = 10, 3, "4242"


def _job(out, root, *extra: str) -> list[dict]:
    code, output = run_script([sys.executable, "-m", RUN, "--out", str(out), "--root", str(root), *extra], 240)
    assert code == 0, output[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _weights(out) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for rank in range(2):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return weights


def test_requeue_signal_on_one_rank_checkpoints_every_rank_at_one_step_and_resumes_exactly(tmp_path):
    root = tmp_path / "job"
    straight = _job(tmp_path / "straight", tmp_path / "straight-root", "--steps", str(STEPS))
    signalled = ("--steps", str(STEPS), "--signal-rank", "1", "--signal-step", str(SIGNAL_STEP))
    first = _job(tmp_path / "first", root, *signalled)

    stops = [record["stopped_at"] for record in first]
    assert stops[0] is not None and stops == [stops[0]] * 2, stops
    stop = stops[0]
    # The request is sampled at the next step's end and read a step later (see strategy/signals.py).
    assert stop == SIGNAL_STEP + 2, stops
    checkpoint = root / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in root.iterdir()) == ["hpc_ckpt_1.ckpt"]
    assert torch.load(checkpoint / "meta.pt", weights_only=True)["global_step"] == stop
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert (tmp_path / "first" / "scontrol.txt").read_text() == f"requeue {JOB_ID}\n"  # rank 0, once

    resumed = _job(tmp_path / "resumed", root, "--steps", str(STEPS))  # the requeued job: same root, no ckpt_path
    # Rank 0's record holds each step's own loss (relayed by the last stage; its own record lags by one step).
    assert straight[0]["steps"] == list(range(STEPS)) and resumed[0]["steps"] == list(range(stop, STEPS))
    assert resumed[0]["losses"] == straight[0]["losses"][stop:]
    expected, got = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
