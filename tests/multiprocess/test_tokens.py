"""A token file under a real pipeline: every stage of a replica reads the same windows, replicas disjoint ones."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.fixtures.helpers import ROOT, run_group, run_script
from tests.fixtures.token_files import position_file

TIMEOUT = 420


@pytest.mark.multiprocess
def test_two_stages_times_two_replicas_read_one_order_and_disjoint_windows(tmp_path):
    """4 processes (P = 2, D = 2), 3 steps of 2 micro-batches: the two stages of each replica used the same window
    starts in every micro-batch (the first stage read them from the inputs, the last from the targets), and the
    two replicas' windows are distinct windows of one grid."""
    position_file(tmp_path / "t.bin", 2048)
    command = [sys.executable, "-m", "tests.multiprocess.scripts.tokens_run", str(tmp_path / "t.bin")]
    command += ["--devices", "4", "--stages", "2", "--steps", "3", "--out", str(tmp_path / "out")]
    returncode, output = run_script(command, TIMEOUT)
    assert returncode == 0, output[-6000:]
    records = [json.loads((tmp_path / "out" / f"seen_rank{r}.json").read_text()) for r in range(4)]
    by_place = {(r["stage"], r["replica"]): r["seen"] for r in records}
    assert sorted(by_place) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    shards = []
    for replica in range(2):
        first, last = by_place[0, replica], by_place[1, replica]
        assert len(first) == 3 * 2 and all(len(m) == 2 for m in first)  # 3 steps x 2 micro-batches of 2
        assert first == last
        shards.append([s for microbatch in first for s in microbatch])
    starts = shards[0] + shards[1]
    assert len(set(starts)) == len(starts) == 24  # no window read by both replicas, nor twice
    assert len({s % 16 for s in starts}) == 1


@pytest.mark.multiprocess
def test_the_llm_example_writes_its_token_file_and_trains_on_two_stages(tmp_path):
    """`fit --config examples/configs/llm_tokens.yaml`, from an empty folder: the data module writes the token file
    from Python's bundled text on the first run, and 2 stages train and validate on it."""
    from lightning_async_pp.models.token_format import TokenFileInfo

    config = ROOT / "examples" / "configs" / "llm_tokens.yaml"
    command = [sys.executable, "-m", "lightning_async_pp", "fit", "--config", str(config)]
    command += ["--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--trainer.limit_val_batches", "2"]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = run_group(command, TIMEOUT, cwd=tmp_path, env=env, merge_stderr=True)
    assert done.returncode == 0, done.stdout[-6000:]
    info = TokenFileInfo.read(tmp_path / "data" / "pydoc_bytes" / "train.bin")
    assert (info.vocab_size, info.eos_token_id) == (257, 256) and info.num_tokens > 400_000
    assert "pipeline stage 1/2" in done.stdout and list((tmp_path / "runs").rglob("events.out.tfevents*"))
