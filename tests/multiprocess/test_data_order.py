"""Every stage of a pipeline reads the same samples; when it cannot, the job stops at the first micro-batch."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.fixtures.helpers import run_script
from tests.multiprocess.scripts.stage_run import IndexedTokens, sample_ids

RUNNER = "tests.multiprocess.scripts.stage_run"
TIMEOUT = 420


def expected_order(size: int, epoch: int, seed: int = 0) -> list[int]:
    """A DistributedSampler's shuffle for one replica: the order the strategy promises every stage."""
    sampler = DistributedSampler(range(size), num_replicas=1, rank=0, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


@pytest.mark.multiprocess
def test_shuffled_loader_without_seeding_gives_every_stage_the_same_samples(tmp_path):
    """`DataLoader(shuffle=True)`, no seed_everything, 2 stages, 2 epochs: the first stage (inputs) and the last
    stage (targets) see the same samples in every micro-batch, in the order seeded by 0 and the epoch."""
    steps, per_epoch, microbatches = 4, 2, 2
    returncode, output = run_script(
        [
            sys.executable,
            "-m",
            RUNNER,
            "shuffled",
            "--devices",
            "2",
            "--steps",
            str(steps),
            "--epochs-of",
            str(per_epoch),
            "--microbatches",
            str(microbatches),
            "--out",
            str(tmp_path),
        ],
        TIMEOUT,
    )
    assert returncode == 0, output[-6000:]
    last, first = (json.loads((tmp_path / f"seen_rank{r}.json").read_text()) for r in range(2))  # rank 0: last
    assert len(first) == steps * microbatches
    assert first == last
    size = 8 * per_epoch
    expected = expected_order(size, 0) + expected_order(size, 1)
    assert [i for microbatch in first for i in microbatch] == expected
    assert expected_order(size, 0) != expected_order(size, 1) != sorted(expected_order(size, 0))


def test_same_order_loader_ignores_the_process_random_state_and_resumes_by_epoch():
    """Two processes with different global random states, and a resumed run that starts in epoch 3, draw the
    same order for the same epoch; worker base seeds too."""
    from lightning_async_pp.strategy.lifecycle import same_order_loader

    def order(global_seed: int, epoch: int) -> tuple[list[int], int]:
        torch.manual_seed(global_seed)
        loader = same_order_loader(
            DataLoader(IndexedTokens(16), batch_size=4, shuffle=True, drop_last=True), seed=7, num_replicas=1, replica=0
        )
        loader.sampler.set_epoch(epoch)
        worker_base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=loader.generator))
        return [i for batch in loader for i in sample_ids(batch)], worker_base_seed

    assert order(1, 0) == order(2, 0)
    assert order(1, 3) == order(2, 3)
    assert order(1, 3)[0] == expected_order(16, 3, seed=7)
    assert order(1, 0) != order(1, 3)


def test_replicas_read_disjoint_shards_in_the_same_order_on_every_stage():
    from lightning_async_pp.strategy.lifecycle import same_order_loader

    shards = []
    for replica in range(2):
        torch.manual_seed(replica)  # a different process
        loader = same_order_loader(
            DataLoader(IndexedTokens(16), batch_size=4, shuffle=True), seed=0, num_replicas=2, replica=replica
        )
        loader.sampler.set_epoch(1)
        shards.append([i for batch in loader for i in sample_ids(batch)])
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(16))


def test_loader_that_differs_per_rank_stops_the_job_in_its_first_micro_batch(tmp_path):
    """Data that depend on the rank cannot be made to agree: the last stage sees that its micro-batch is not the
    one the first stage sent an activation for, and the whole job stops at once with a message."""
    returncode, output = run_script(
        [
            sys.executable,
            "-m",
            RUNNER,
            "differing",
            "--devices",
            "2",
            "--steps",
            "4",
            "--out",
            str(tmp_path),
        ],
        TIMEOUT,
    )
    assert returncode != 0
    assert "Pipeline stages 0 and 1 read different data for step 0, micro-batch 0" in output, output[-4000:]
    assert "Seed those identically in every process" in output
    # Stage 1 (rank 0) raised before running the micro-batch: nothing was trained on, nothing was recorded.
    assert not (tmp_path / "seen_rank0.json").exists()


def test_fingerprint_tells_batches_apart():
    from lightning_async_pp.runtime.fingerprint import fingerprint

    torch.manual_seed(0)
    tokens, targets = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    images = torch.randn(4, 3, 8, 8)
    batch = {"tokens": tokens, "targets": targets, "images": images, "mask": tokens > 3}
    reference = fingerprint(batch)
    assert reference.dtype == torch.int64 and reference.shape == (2,)
    assert torch.equal(fingerprint({k: v.clone() for k, v in batch.items()}), reference)

    def changed(**replacement):
        return not torch.equal(fingerprint({**batch, **replacement}), reference)

    one_token = tokens.clone()
    one_token[2, 5] += 1
    assert changed(tokens=one_token)
    assert changed(tokens=tokens[[1, 0, 2, 3]])  # same samples, another order
    one_ulp = images.clone()
    one_ulp[1, 2, 3, 4] = torch.nextafter(one_ulp[1, 2, 3, 4], torch.tensor(float("inf")))
    assert changed(images=one_ulp)  # one float, by one unit in the last place
    assert changed(images=images.to(torch.bfloat16))
    assert changed(tokens=tokens.reshape(8, 8))
    large = torch.randn(64, 3, 32, 32)  # more elements than are hashed: a sample of them
    assert not torch.equal(fingerprint(large), fingerprint(large[[1, 0, *range(2, 64)]]))
    assert not torch.equal(fingerprint(large), fingerprint(torch.randn(64, 3, 32, 32)))
    assert torch.equal(fingerprint(large), fingerprint(large.clone()))


def test_seed_everything_workers_seeds_by_replica_not_by_rank(monkeypatch):
    """With seed_everything(workers=True) Lightning would seed workers from the global rank, which differs between
    the stages of a pipeline; the strategy seeds them from the replica."""
    from lightning.fabric.utilities.seed import pl_worker_init_function

    from lightning_async_pp.strategy.lifecycle import same_order_loader

    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    loader = same_order_loader(
        DataLoader(IndexedTokens(16), batch_size=4, shuffle=True), seed=0, num_replicas=2, replica=1
    )
    assert loader.worker_init_fn.func is pl_worker_init_function
    assert loader.worker_init_fn.keywords == {"rank": 1}
