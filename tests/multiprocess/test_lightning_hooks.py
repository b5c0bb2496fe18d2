"""Lightning's optimizer-step hooks under the pipeline, and param-group keys that optimizers own."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.runtime.stage import StageRuntime
from tests.fixtures.helpers import fit, loader, random_batches, run_script, tiny_gpt
from tests.multiprocess.scripts.stage_run import CallbackCounter, hooked_gpt

pytestmark = pytest.mark.multiprocess

RUNNER = "tests.multiprocess.scripts.stage_run"
TIMEOUT = 420


def run_scenario(out: Path, scenario: str, *extra: str, check: bool = True) -> tuple[int, str]:
    returncode, output = run_script([sys.executable, "-m", RUNNER, scenario, "--out", str(out), *extra], TIMEOUT)
    if check:
        assert returncode == 0, output[-6000:]
    return returncode, output


class OwnKeySGD(torch.optim.SGD):
    """SGD that, like schedule-free (``k``) or Prodigy (``d``), keeps a counter of its own in each param group,
    and records the ``lr`` and ``k`` every step used."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.used: list[tuple[float, int]] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["k"] = group.get("k", 0) + 1
        self.used.append((self.param_groups[0]["lr"], self.param_groups[0]["k"]))
        return super().step(closure)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_optimizer_owned_param_group_keys_survive_delayed_updates():
    """A step's update runs with the learning rate the scheduler set for that step, and the optimizer's own
    key keeps counting: restoring the hyperparameters after the update must not undo what the optimizer wrote."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), nn.Linear(4, 1)]
    optimizer = OwnKeySGD([p for layer in layers for p in layer.parameters()], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    # One stage with clipping: each update waits for the clipping norm and is applied inside a later step,
    # after the scheduler has moved on (the clip is far above the norm, so it does not change the gradient).
    runtime = StageRuntime(
        kind="2bw",
        stage=0,
        num_stages=1,
        num_microbatches=2,
        layers=layers,
        optimizer=optimizer,
        inputs_fn=lambda mb: mb[0],
        loss_fn=lambda out, mb: ((out - mb[1]) ** 2).mean(),
        device=torch.device("cpu"),
        clip_grad_norm=1e9,
    )
    steps = 5
    for step in range(steps):
        runtime.run_step(step, (torch.randn(4, 4), torch.randn(4, 1)))
        scheduler.step()
    runtime.drain()
    assert [lr for lr, _ in optimizer.used] == pytest.approx([0.1 / (t + 1) for t in range(steps)])
    assert [k for _, k in optimizer.used] == list(range(1, steps + 1))
    assert optimizer.param_groups[0]["k"] == steps
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / (steps + 1))  # the scheduler's current value


def test_on_before_optimizer_step_sees_each_stages_gradients(tmp_path):
    """The hook (module and callback) runs once per step on every stage, with the gradient that stage's update
    applies: together the stages see exactly the gradients one device sees."""
    steps = 4
    run_scenario(tmp_path, "hooks", "--devices", "2", "--steps", str(steps))
    ranks = [json.loads((tmp_path / f"hooks_rank{r}.json").read_text()) for r in range(2)]

    torch.set_num_threads(1)
    model, counter = hooked_gpt(), CallbackCounter()
    fit(model, random_batches(steps), strategy=AsyncPipelineStrategy(num_microbatches=2), callbacks=[counter])
    assert counter.calls == steps and len(model.hook_calls) == steps

    for rank in ranks:
        assert rank["callback"] == steps
        assert len(rank["module"]) == steps
    for step, reference in enumerate(model.hook_calls):
        stages = [rank["module"][step] for rank in ranks]
        assert not set(stages[0]) & set(stages[1])  # each stage sees only its own parameters
        merged = {**stages[0], **stages[1]}
        assert sorted(merged) == sorted(reference)
        for name, norm in reference.items():
            assert merged[name] == pytest.approx(norm, rel=1e-5, abs=1e-7), (step, name)


class CustomClipping(type(tiny_gpt())):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")


def test_overridden_configure_gradient_clipping_is_refused():
    model = CustomClipping(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, lr_schedule="constant")
    trainer = Trainer(
        strategy=AsyncPipelineStrategy(start_method="spawn", num_microbatches=2),
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_progress_bar=False,
        max_steps=1,
    )
    with pytest.raises(Exception, match="configure_gradient_clipping.*gradient_clip_val"):
        trainer.fit(model, loader(random_batches(1)))
