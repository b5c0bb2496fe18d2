"""The pieces of a requeue at a step boundary that need no processes: the checkpoint's name, the requeue command.
The signal path itself is tested on two stages in tests/multiprocess/test_requeue.py."""

from __future__ import annotations

import pytest

from lightning_async_pp.strategy import signals


def test_hpc_path_counts_only_complete_checkpoints(tmp_path):
    """The hidden directory a rank is already writing (``.hpc_ckpt_2.ckpt.partial``) does not count: every rank
    names the same checkpoint (Lightning's own count includes it, so a rank listing later would pick 3)."""
    assert signals.hpc_save_path(tmp_path / "missing").endswith("hpc_ckpt_1.ckpt")
    (tmp_path / "hpc_ckpt_1.ckpt").mkdir()
    (tmp_path / ".hpc_ckpt_2.ckpt.partial").mkdir()
    (tmp_path / "hpc_ckpt_notes.txt").write_text("")
    assert signals.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")


@pytest.mark.parametrize(
    ("env", "job"),
    [({"SLURM_JOB_ID": "123"}, "123"), ({"SLURM_ARRAY_JOB_ID": "77", "SLURM_ARRAY_TASK_ID": "4"}, "77_4")],
    ids=["job", "array-task"],
)
def test_requeue_runs_scontrol_on_the_job(monkeypatch, env, job):
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(signals.subprocess, "call", lambda command, **kwargs: calls.append(command) or 0)
    assert signals.requeue_slurm_job() == 0
    assert calls == [["scontrol", "requeue", job]]


def test_requeue_refuses_a_job_id_that_is_not_one(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "1; rm -rf /")
    with pytest.raises(ValueError, match="not a SLURM job id"):
        signals.requeue_slurm_job()
