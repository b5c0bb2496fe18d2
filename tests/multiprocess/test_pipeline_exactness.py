"""A real multi-process pipeline against the single-device trajectory (an independent code path)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from lightning_async_pp import AsyncPipelineStrategy
from tests.fixtures.helpers import fit, random_batches, run_group, run_script, tiny_gpt
from tests.multiprocess.scripts.pipeline_run import make_optimizer  # noqa: E402

RUNNER = "tests.multiprocess.scripts.pipeline_run"
TIMEOUT = 420


def run_pipeline(out: Path, devices: int, schedule: str, microbatches: int, steps: int, optimizer: str, *extra: str):
    command = [
        sys.executable,
        "-m",
        RUNNER,
        "--devices",
        str(devices),
        "--schedule",
        schedule,
        "--microbatches",
        str(microbatches),
        "--steps",
        str(steps),
        "--optimizer",
        optimizer,
        "--out",
        str(out),
        *extra,
    ]
    returncode, output = run_script(command, TIMEOUT)
    assert returncode == 0, output[-6000:]
    result = json.loads((out / "losses.json").read_text())
    weights = {}
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return result, weights


def reference(schedule: str, microbatches: int, steps: int, optimizer: str, model_kwargs=None, **trainer_kwargs):
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer(optimizer), **(model_kwargs or {}))
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=microbatches)
    losses = fit(model, random_batches(steps), strategy=strategy, **trainer_kwargs)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def assert_same_run(result, weights, ref_losses, ref_weights, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=rtol, atol=atol)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


NEEDS_RESEARCH = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_optimizer") is None,
    reason='SOAP and Adan come from the `research` extra: pip install -e ".[research]"',
)

MP = pytest.mark.multiprocess
# The first case runs in the default tier (make test): one real 2-stage pipeline against the reference.
CASES = [
    pytest.param(2, "2bw", 2, "adamw", id="P2-M2-2bw-adamw"),
    pytest.param(2, "2bw", 4, "adamw", id="P2-M4-2bw-adamw", marks=MP),
    pytest.param(2, "1f1b", 4, "adamw", id="P2-M4-1f1b-adamw", marks=MP),
    pytest.param(2, "2bw", 4, "corrected_muon", id="P2-M4-2bw-corrected_muon", marks=MP),
    pytest.param(2, "2bw", 2, "auto_adamw", id="P2-M2-2bw-auto_adamw", marks=MP),
    pytest.param(2, "2bw", 2, "corrected_soap", id="P2-M2-2bw-corrected_soap", marks=[MP, NEEDS_RESEARCH]),
    pytest.param(2, "2bw", 2, "corrected_adan", id="P2-M2-2bw-corrected_adan", marks=[MP, NEEDS_RESEARCH]),
]
SLOW_CASES = [
    pytest.param(2, "1f1b", 2, "corrected_muon", id="P2-M2-1f1b-corrected_muon"),
    pytest.param(4, "2bw", 4, "adamw", id="P4-M4-2bw-adamw"),
    pytest.param(4, "2bw", 8, "adamw", id="P4-M8-2bw-adamw"),
    pytest.param(4, "1f1b", 8, "adamw", id="P4-M8-1f1b-adamw"),
    pytest.param(4, "2bw", 4, "corrected_muon", id="P4-M4-2bw-corrected_muon"),
]


@pytest.mark.parametrize(("devices", "schedule", "microbatches", "optimizer"), CASES)
def test_pipeline_matches_single_device(tmp_path, devices, schedule, microbatches, optimizer):
    steps = 20
    result, weights = run_pipeline(tmp_path, devices, schedule, microbatches, steps, optimizer)
    ref_losses, ref_weights = reference(schedule, microbatches, steps, optimizer)
    assert len(result["losses"]) == steps
    assert_same_run(result, weights, ref_losses, ref_weights)


@pytest.mark.slow
@pytest.mark.parametrize(("devices", "schedule", "microbatches", "optimizer"), SLOW_CASES)
@pytest.mark.multiprocess
def test_pipeline_matches_single_device_slow(tmp_path, devices, schedule, microbatches, optimizer):
    steps = 20
    result, weights = run_pipeline(tmp_path, devices, schedule, microbatches, steps, optimizer)
    ref_losses, ref_weights = reference(schedule, microbatches, steps, optimizer)
    assert_same_run(result, weights, ref_losses, ref_weights)


@pytest.fixture(scope="module")
def clipped_2bw_run(tmp_path_factory):
    """One 2-stage 2BW job with gradient clipping for the two tests that read it: a job start (most of a
    10-step job's time) fewer."""
    return run_pipeline(tmp_path_factory.mktemp("clipped"), 2, "2bw", 2, 10, "sgd", "--clip", "0.05")


@pytest.mark.multiprocess
def test_pipeline_2bw_is_not_synchronous(clipped_2bw_run):
    """Guards the exactness tests: the 2BW pipeline must differ from the synchronous reference."""
    result, weights = clipped_2bw_run
    # The clip shrinks every update, yet after 10 steps the one-step-stale weights have moved the 2BW run about
    # 5e-3 away from the synchronous one: 50x the threshold, which is 100x the exactness tolerance.
    sync_losses, sync_weights = reference("1f1b", 2, 10, "sgd", gradient_clip_val=0.05)
    difference = max((weights[k] - v).abs().max().item() for k, v in sync_weights.items())
    assert difference > 1e-4


def _steady_bubbles(result) -> dict[str, float]:
    """Per stage, the lower quartile of the bubble fraction over the steps after warm-up.

    A flush costs the first stage the same idle time in every step; waits that come from other processes
    competing for the CPU come and go. The lower quartile keeps the first and drops most of the second.
    """
    quartiles = {}
    for stage, bubbles in result["stage_bubbles"].items():
        steady = sorted(bubbles[len(bubbles) // 4 :])
        quartiles[stage] = steady[len(steady) // 4]
    return quartiles


@pytest.mark.multiprocess
def test_2bw_has_no_flush_bubble(tmp_path):
    """P=2, M=4: the ideal 1F1B bubble is (P-1)/(M+P-1) = 20%; 2BW's steady state has none."""
    size = ("--width", "128", "--seq", "64", "--batch-size", "32")
    async_run, _ = run_pipeline(tmp_path / "2bw", 2, "2bw", 4, 24, "adamw", *size)
    sync_run, _ = run_pipeline(tmp_path / "1f1b", 2, "1f1b", 4, 24, "adamw", *size)
    async_bubble, sync_bubble = _steady_bubbles(async_run), _steady_bubbles(sync_run)
    print(f"steady-state bubble per stage: 2bw {async_bubble}, 1f1b {sync_bubble}")
    # A flush makes every stage idle through each warm-up and cool-down, so under 1F1B even the busiest stage
    # waits. Under 2BW the busiest stage never waits; only the faster one waits for it (imbalance, not a flush,
    # and it varies with how the two processes share the cores), so the least idle stage is what is compared.
    assert min(async_bubble.values()) < 0.5 * min(sync_bubble.values())
    assert set(async_run["version_lag"]["0"][2:]) == {1}  # step 0 has w[-1] = w[0]
    assert set(sync_run["version_lag"]["0"]) == {0}


@pytest.mark.multiprocess
def test_gradient_clipping_uses_the_global_norm_across_stages(clipped_2bw_run):
    """Each stage holds part of the gradient; clipping must use the norm over all of them."""
    result, weights = clipped_2bw_run
    ref_losses, ref_weights = reference("2bw", 2, 10, "sgd", gradient_clip_val=0.05)
    assert_same_run(result, weights, ref_losses, ref_weights)
    unclipped_losses, _ = reference("2bw", 2, 10, "sgd")
    assert abs(unclipped_losses[-1] - ref_losses[-1]) > 1e-4  # the clip is active


@pytest.mark.slow
@pytest.mark.multiprocess
def test_bf16_mixed_pipeline_tracks_single_device(tmp_path):
    result, weights = run_pipeline(tmp_path, 2, "2bw", 2, 8, "adamw", "--precision", "bf16-mixed")
    ref_losses, ref_weights = reference("2bw", 2, 8, "adamw", precision="bf16-mixed")
    assert_same_run(result, weights, ref_losses, ref_weights)
    # bfloat16 autocast was on: float32 runs the same steps to other losses.
    fp32_losses, _ = reference("2bw", 2, 8, "adamw")
    assert max(abs(a - b) for a, b in zip(fp32_losses, ref_losses)) > 1e-4


@pytest.mark.multiprocess
def test_checkpoint_holds_every_stage_and_both_versions(tmp_path):
    from lightning_async_pp.checkpoint import read_tensors

    result, weights = run_pipeline(tmp_path, 2, "2bw", 2, 6, "corrected_muon", "--save-checkpoint")
    saved = read_tensors(tmp_path / "final.ckpt")
    current = {k.removeprefix("state_dict."): v for k, v in saved.items() if k.startswith("state_dict.")}
    previous = {k.removeprefix("previous."): v for k, v in saved.items() if k.startswith("previous.")}
    assert sorted(current) == sorted(weights) == sorted(previous)  # each stage wrote its own names
    for name, value in weights.items():
        assert torch.equal(current[name], value)
    # w[t-1] differs from w[t] (the embedding and a hidden block, on different stages)
    assert not torch.equal(previous["layers.0.tok.weight"], current["layers.0.tok.weight"])
    assert not torch.equal(previous["layers.4.mlp.0.weight"], current["layers.4.mlp.0.weight"])
    # DelayCorrected keeps one previous-update buffer per parameter, next to the base optimizer state.
    assert {f"optimizer.state.{n}.previous_update" for n in weights} <= set(saved)
    meta = torch.load(tmp_path / "final.ckpt" / "meta.pt", weights_only=True)["async_pp"]
    assert meta["num_stages"] == 2 and meta["partition"] == [[0, 3], [3, 6]] and meta["version"] == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_spawn_start_method_returns_the_whole_trained_model():
    """With start_method="spawn" the main process gets every stage's trained weights back."""
    import re

    output = run_group(
        [sys.executable, "-m", "tests.multiprocess.scripts.spawn_run"],
        TIMEOUT,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
    )
    assert output.returncode == 0, output.stderr[-3000:]
    difference, moved = map(float, re.search(r"MAXDIFF (\S+) MOVED (\S+)", output.stdout).groups())
    assert moved > 1e-3 and difference < 1e-5


MOE = dict(n_experts=4, experts_per_token=2, aux_loss_coef=0.1)
MOE_ARGS = ("--experts", "4", "--experts-per-token", "2", "--aux-coef", "0.1")


def plain_accumulated(microbatches: int, steps: int, optimizer: str):
    """Plain Lightning (no strategy) over the micro-batches, accumulating the gradients of ``microbatches``."""
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer(optimizer), **MOE)
    parts = [
        tuple(t[i] for t in (x.chunk(microbatches), y.chunk(microbatches)))
        for x, y in random_batches(steps)
        for i in range(microbatches)
    ]
    losses = fit(model, parts, max_steps=steps, accumulate_grad_batches=microbatches)
    # Lightning reports each micro-batch's loss divided by accumulate_grad_batches: a step's loss is their sum.
    step_losses = [sum(losses[i : i + microbatches]) for i in range(0, len(losses), microbatches)]
    return step_losses, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize(("schedule", "optimizer"), [("2bw", "corrected_muon"), ("1f1b", "adamw")])
def test_a_mixture_of_experts_on_two_stages_matches_its_reference(tmp_path, schedule, optimizer):
    """The routers' load-balancing loss is attached on the stage that holds them: 2BW matches the one-device
    delayed path, 1F1B plain Lightning with gradient accumulation over the same micro-batches."""
    steps, microbatches = 8, 2
    result, weights = run_pipeline(tmp_path, 2, schedule, microbatches, steps, optimizer, *MOE_ARGS)
    if schedule == "2bw":
        ref_losses, ref_weights = reference(schedule, microbatches, steps, optimizer, model_kwargs=MOE)
    else:
        ref_losses, ref_weights = plain_accumulated(microbatches, steps, optimizer)
    assert_same_run(result, weights, ref_losses, ref_weights)
    # The balance loss acted: without it the routers end elsewhere.
    _, unbalanced = reference(schedule, microbatches, steps, optimizer, model_kwargs={**MOE, "aux_loss_coef": 0.0})
    router = "layers.1.mlp.router.weight"
    assert (unbalanced[router] - ref_weights[router]).abs().max() > 1e-4


def window_means(losses: list[float], window: int) -> list[float]:
    """Each optimizer step's mean loss from the loss Lightning returns per batch (divided by ``window``, the
    batches a step accumulates; the last step of an epoch may have fewer)."""
    losses = [loss * window for loss in losses]
    return [sum(losses[i : i + window]) / len(losses[i : i + window]) for i in range(0, len(losses), window)]


def plain_accumulated_means(
    microbatches: int, batches: int, max_steps: int, optimizer: str, accumulate: int, **model_kwargs
):
    """Plain Lightning over the micro-batches of ``batches`` batches, accumulating ``accumulate`` batches of
    ``microbatches`` each."""
    torch.set_num_threads(1)
    model = tiny_gpt(n_layer=4, optimizer=make_optimizer(optimizer), **model_kwargs)
    parts = [tuple(t.chunk(microbatches)[i] for t in batch) for batch in random_batches(batches) for i in range(2)]
    window = accumulate * microbatches
    losses = fit(model, parts, max_steps=max_steps, accumulate_grad_batches=window)
    return window_means(losses, window), {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["2bw", "1f1b"])
def test_accumulated_batches_on_two_stages_match_their_reference(tmp_path, schedule):
    """``accumulate_grad_batches=2`` over batches of 2 micro-batches: 7 batches are 4 optimizer steps, the last of
    one batch (Lightning steps at the end of the epoch; the pipeline drains around that shorter step). 2BW equals
    the one-device run with the same accumulation (which equals steps of 2 x 2 micro-batches bit for bit,
    ``tests/unit/strategy/test_accumulation.py``); 1F1B equals plain Lightning accumulating the micro-batches.
    The learning rate follows a per-step schedule, stepped once per optimizer step; SGD, whose steps scale with the
    gradient (Adam's hardly do), shows a wrong loss scale."""
    batches, steps, microbatches = 7, 4, 2
    extra = ("--total-steps", str(batches), "--accumulate", "2", "--lr-schedule", "cosine")
    cosine = {"lr_schedule": "cosine"}  # over max_steps: a new learning rate at each step
    result, weights = run_pipeline(tmp_path, 2, schedule, microbatches, steps, "sgd", *extra)
    if schedule == "2bw":
        losses, ref_weights = reference(
            schedule, microbatches, batches, "sgd", cosine, max_steps=steps, accumulate_grad_batches=2
        )
        ref_losses = window_means(losses, 2)
    else:
        ref_losses, ref_weights = plain_accumulated_means(microbatches, batches, steps, "sgd", 2, **cosine)
    assert len(result["losses"]) == steps
    assert_same_run(result, weights, ref_losses, ref_weights)


@pytest.mark.multiprocess
def test_an_optimizer_that_needs_its_closure_is_refused_on_several_stages(tmp_path):
    command = [sys.executable, "-m", RUNNER, "--devices", "2", "--optimizer", "lbfgs", "--out", str(tmp_path)]
    returncode, output = run_script(command, TIMEOUT)
    assert returncode != 0
    assert "`LBFGS.step` needs a closure" in output and "without a closure" in output, output[-3000:]
