"""D replicas of a P-stage pipeline equal one device training on the global batch."""

import pytest
import torch

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import fit, global_batches, tiny_gpt
from tests.multiprocess.scripts.pipeline_run import make_optimizer
from tests.multiprocess.test_pipeline_exactness import run_pipeline, window_means

pytestmark = pytest.mark.multiprocess


# Not Muon: torch's Newton-Schulz iteration runs in bfloat16, which turns the replicas' different summation
# order (~1e-7) into ~1e-3 differences. (Without replicas the order is the same and Muon matches exactly.)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_single_device(tmp_path, optimizer):
    steps, P, D, M = 10, 2, 2, 2
    result, weights = run_pipeline(
        tmp_path, P * D, "2bw", M, steps, optimizer, "--pipeline-size", str(P), "--total-steps", str(steps * D)
    )
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer(optimizer))
    # Same micro-batch size as each replica uses: D*M micro-batches of the global batch.
    ref_losses = fit(
        model, global_batches(steps, D), strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=D * M)
    )
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    # Replicas sum their gradients in another order than one device does. Where a gradient is zero in exact
    # arithmetic (the attention key bias: softmax ignores it) only rounding noise remains, which Adam
    # normalises into steps of up to lr * 1e-3 here; everything else agrees to 1e-5.
    for name, value in model.state_dict().items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_two_replicas_accumulating_equal_single_device_accumulating(tmp_path):
    """``accumulate_grad_batches=2`` with two replicas of one stage: each replica accumulates its own 2 batches of M
    micro-batches and the replicas average once per optimizer step, as one device accumulating 2 global batches of
    D x M micro-batches does. SGD: its steps scale with the gradient, so a wrong loss scale shows."""
    steps, D, M, k = 3, 2, 2, 2
    extra = ("--pipeline-size", "1", "--total-steps", str(steps * k * D), "--accumulate", str(k))
    result, weights = run_pipeline(tmp_path, D, "2bw", M, steps, "sgd", *extra)
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer("sgd"))
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=D * M)
    losses = fit(model, global_batches(steps * k, D), strategy=strategy, max_steps=steps, accumulate_grad_batches=k)
    ref_losses = window_means(losses, k)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for name, value in model.state_dict().items():  # tolerances as above: the replicas' order of summation
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")


def test_processes_must_divide_into_pipelines():
    from lightning.pytorch import Trainer

    with pytest.raises(Exception, match="multiple of 3"):
        Trainer(
            strategy=AsyncPipelineStrategy(pipeline_parallel_size=3, num_microbatches=4),
            accelerator="cpu",
            devices=4,
            logger=False,
        )
