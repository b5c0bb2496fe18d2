"""Lightning features on several stages against one device: monitoring callbacks (ModelCheckpoint, EarlyStopping,
LearningRateMonitor), trainer.validate / test / predict, and sync_dist."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer

import lightning_async_pp  # noqa: F401  (registers strategy="async_pp")
from lightning_async_pp.runtime.microbatch import auto_num_microbatches
from tests.fixtures.helpers import run_script
from tests.multiprocess.scripts import callbacks_run
from tests.multiprocess.test_data_parallel import global_batches

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.callbacks_run"
TIMEOUT = 600


def run(out: Path, *args: str) -> list[dict]:
    """Run ``callbacks_run.py`` as its own job (Lightning's launcher starts the ranks); every rank's record."""
    devices = int(args[args.index("--devices") + 1])
    status, output = run_script([sys.executable, "-m", RUNNER, *args, "--out", str(out)], TIMEOUT)
    assert status == 0, output[-6000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(devices)]


def logged(out: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every row of the CSV logger that has ``tag``."""
    with open(out / "logs" / "version_0" / "metrics.csv") as f:
        return [(int(row["step"]), float(row[tag])) for row in csv.DictReader(f) if row.get(tag)]


def lr_column(out: Path) -> list[float]:
    return [value for _, value in logged(out, "lr-AdamW")]


def assert_logged_every_second_step(out: Path, stages: int) -> None:
    # log_every_n_steps=2: Lightning logs after steps 1, 3, 5 (0-based), and so do the stages' statistics.
    for tag in ("train/loss", *(f"pipeline/stage{s}/forward_sec" for s in range(stages))):
        steps = [step for step, _ in logged(out, tag)]
        assert steps and all(step % 2 == 1 for step in steps), (tag, steps)


def assert_same_callbacks(ranks: list[dict], reference: dict, last_stages: int) -> None:
    for rank, record in enumerate(ranks):
        where = f"rank {rank}"
        # EarlyStopping stopped every rank at the step one device stops at (not at max_steps).
        assert record["stopped"] and record["global_step"] == reference["global_step"] < callbacks_run.STEPS, where
        assert record["stopping_reason"] == reference["stopping_reason"], where
        # Every rank read the validation loss one device computed, at every validation.
        assert [s for s, _ in record["val_seen"]] == [s for s, _ in reference["val_seen"]], where
        torch.testing.assert_close(
            [v for _, v in record["val_seen"]], [v for _, v in reference["val_seen"]], rtol=1e-5, atol=1e-5
        )
        # The training loss is there from the first step on (the step's ModelCheckpoint reads it).
        assert record["train_loss_seen_from_step"] == 0, where
        for name in ("val_ckpt", "train_ckpt"):
            ours, theirs = record[name], reference[name]
            assert sorted(ours["best_k"]) == sorted(theirs["best_k"]) and ours["best"] == theirs["best"], (where, name)
            torch.testing.assert_close(ours["best_k"], theirs["best_k"], rtol=1e-5, atol=1e-5)
            if rank == 0:
                assert ours["files"] == theirs["files"], name


@pytest.mark.slow
def test_monitoring_callbacks_on_two_stages_match_one_device(tmp_path):
    ranks = run(tmp_path / "pipeline", "fit", "--devices", "2")
    torch.set_num_threads(1)
    # The pipeline runs with num_microbatches="auto" (2 for batches of 8 on 2 stages); one device needs it said.
    reference = callbacks_run.fit(1, tmp_path / "reference", microbatches=2)
    assert_same_callbacks(ranks, reference, last_stages=1)
    torch.testing.assert_close(lr_column(tmp_path / "pipeline"), lr_column(tmp_path / "reference"))
    assert len(lr_column(tmp_path / "reference")) == reference["global_step"] // 2
    assert_logged_every_second_step(tmp_path / "pipeline", stages=2)


@pytest.mark.slow
def test_monitoring_callbacks_on_two_stages_times_two_replicas_match_one_device(tmp_path):
    ranks = run(tmp_path / "pipeline", "fit", "--devices", "4", "--pipeline-size", "2")
    torch.set_num_threads(1)
    # One device reads the union of the replicas' batches, in as many micro-batches as the replicas together.
    reference = callbacks_run.fit(
        1, tmp_path / "reference", batches=global_batches(callbacks_run.STEPS, 2), microbatches=4
    )
    assert_same_callbacks(ranks, reference, last_stages=2)
    torch.testing.assert_close(lr_column(tmp_path / "pipeline"), lr_column(tmp_path / "reference"))


@pytest.mark.slow
def test_validate_test_predict_on_two_stages_match_one_device(tmp_path):
    ranks = run(tmp_path / "pipeline", "evaluate", "--devices", "2")
    (tmp_path / "reference").mkdir()
    torch.set_num_threads(1)
    reference = callbacks_run.evaluate(1, tmp_path / "reference", strategy=False)  # plain Lightning, one device
    last, first = ranks
    assert set(reference["validate"][0]) == {"val/loss", "val/loss_synced"}
    assert set(reference["test"][0]) == {"test/loss", "test/accuracy"}
    torch.testing.assert_close(last["validate"], reference["validate"])
    torch.testing.assert_close(last["test"], reference["test"])
    # The predictions of every batch, in order (the last batch is smaller), returned on rank 0.
    assert len(reference["predictions"]) == 100
    torch.testing.assert_close(last["predictions"], reference["predictions"])
    assert first["predictions"] is None
    # What the test logged is in callback_metrics on the first stage too.
    torch.testing.assert_close(first["test_callback_metrics"], last["test_callback_metrics"])
    assert set(first["test_callback_metrics"]) == {"test/loss", "test/accuracy"}


def test_auto_num_microbatches_is_the_smallest_divisor_from_the_stage_count():
    assert [auto_num_microbatches(8, p) for p in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert auto_num_microbatches(9, 2) == 3
    with pytest.raises(ValueError, match="multiple of 4"):
        auto_num_microbatches(3, 4)
    assert auto_num_microbatches(7, 2) == 7  # a prime batch size: one sample per micro-batch


def test_default_strategy_works_on_any_number_of_devices():
    # Trainer(strategy="async_pp", devices=4): the registered default must not need num_microbatches set.
    for devices in (1, 3, 4):
        strategy = Trainer(strategy="async_pp", accelerator="cpu", devices=devices, logger=False).strategy
        assert strategy.microbatches.pending and strategy.num_microbatches == devices
