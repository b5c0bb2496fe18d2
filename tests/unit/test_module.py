"""``PipelineModule``: one module, written as a pipeline, trains the same without the strategy, with
strategy="ddp" and with AsyncPipelineStrategy."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_async_pp import AsyncPipelineStrategy, PipelineModule
from lightning_async_pp.demos import GPT
from tests.multiprocess.scripts import callbacks_run
from tests.multiprocess.test_native import run


def assert_same_training(ours: dict, theirs: dict) -> None:
    torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
    for name, value in theirs["weights"].items():
        torch.testing.assert_close(torch.tensor(ours["weights"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_module_trains_on_one_device_without_the_strategy_as_with_it():
    # Plain Lightning calls the derived training_step; the strategy runs the contract itself (another code path).
    plain = callbacks_run.train_classifier(1, None)
    piped = callbacks_run.train_classifier(1, None, strategy=AsyncPipelineStrategy(schedule="1f1b"))
    assert len(plain["losses"]) == 5 and plain["losses"][-1] < plain["losses"][0]
    assert_same_training(piped, plain)


def ddp_global_batches(replicas: int = 2, per_replica: int = 16, epochs: int = 2) -> list:
    """What DDP's replicas read together at each step: Lightning gives training a shuffled DistributedSampler
    (seed 0, reshuffled per epoch); the global batch is the union of the replicas' batches."""
    dataset = callbacks_run.classification_data().dataset
    batches = []
    for epoch in range(epochs):
        shards = []
        for rank in range(replicas):
            sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), per_replica):
            index = torch.tensor([i for shard in shards for i in shard[start : start + per_replica]])
            batches.append(tuple(t[index] for t in dataset.tensors))
    return batches


@pytest.mark.slow
@pytest.mark.multiprocess
def test_module_trains_with_ddp_as_on_one_device(tmp_path):
    ranks = run(tmp_path, "ddp", "--devices", "2")
    reference = callbacks_run.train_classifier(1, None, data=DataLoader(ddp_global_batches(), batch_size=None))
    # DDP logs each rank's own loss (half the batch); the weights are those of the whole batch.
    for name, value in reference["weights"].items():
        torch.testing.assert_close(torch.tensor(ranks[0]["weights"][name]), torch.tensor(value), rtol=1e-5, atol=1e-6)


def test_evaluation_steps_follow_the_pipeline_hooks():
    model = callbacks_run.Classifier()
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    torch.testing.assert_close(
        model.predict_step((x, y), 0),
        model.layers[4](model.layers[3](model.layers[2](model.layers[1](model.layers[0](x))))),
    )
    assert GPT.training_step is PipelineModule.training_step and GPT.forward is PipelineModule.forward


def test_missing_contract_method_says_what_to_define():
    class Incomplete(PipelineModule):
        def pipeline_layers(self):
            return [torch.nn.Identity()]

    with pytest.raises(NotImplementedError, match="must define `pipeline_inputs"):
        Incomplete().training_step((torch.zeros(2, 3),), 0)
