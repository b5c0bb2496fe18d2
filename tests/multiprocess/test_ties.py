"""Parameters shared by layers on different stages (tied weights) train as one parameter, as on one device."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.multiprocess.scripts.toy_run import ToyLM, reference_toy, run_toy

pytestmark = pytest.mark.multiprocess

TOL = dict(rtol=1e-5, atol=1e-6)


def print_differences(losses, weights, ref_losses, ref_weights):
    """The measured distance to the reference (shown with `pytest -s`)."""
    loss = max(abs(a - b) for a, b in zip(losses, ref_losses))
    weight = max((weights[k] - v).abs().max().item() for k, v in ref_weights.items() if k in weights)
    print(f"max |loss - reference| {loss:.2e}, max |weight - reference| {weight:.2e}")


def assert_same_run(result, weights, ref_losses, ref_weights):
    print_differences(result["losses"], weights, ref_losses, ref_weights)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), **TOL)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, **TOL, msg=lambda m: f"{name}: {m}")


def assert_copies_equal_after_every_update(tied_records, groups, steps):
    """Every rank's copy of a tied parameter is bitwise the same after each update (under every name)."""
    copies: dict[tuple[int, int], list[torch.Tensor]] = {}
    for records in tied_records:
        for step, values in records:
            for index, names in enumerate(groups):
                copies.setdefault((index, step), []).extend(values[n] for n in names if n in values)
    for index, names in enumerate(groups):
        for step in range(steps):
            held = copies.get((index, step), [])
            assert len(held) >= 2, f"tie {names} has {len(held)} copies after update {step}"
            for other in held[1:]:
                assert torch.equal(held[0], other), f"copies of {names} differ after update {step}"


TIES = ("--tie-embedding", "--tie-blocks")
CASES = [
    # [Embed, Block1, Block2 | Block3, Head]: the embedding/head tie and the Block1/Block3 tie cross stages.
    pytest.param(2, "2bw", ("--split-points", "3"), id="P2-2bw"),
    pytest.param(2, "1f1b", ("--split-points", "3"), id="P2-1f1b"),
    # [Embed, Block1 | Block2, Block3 | Head]: the middle stage owns only one end of one tie.
    pytest.param(3, "2bw", ("--split-points", "2,4"), id="P3-2bw"),
]


@pytest.mark.parametrize(("devices", "schedule", "split"), CASES)
def test_tied_model_on_stages_equals_one_device(tmp_path, devices, schedule, split):
    args = ("--schedule", schedule, "--microbatches", "3", *TIES)
    steps = 8
    result, weights, tied = run_toy(tmp_path, devices, *args, *split, "--steps", str(steps))
    ref_losses, ref_weights, model = reference_toy(*args, steps=steps)
    assert_same_run(result, weights, ref_losses, ref_weights)
    assert_copies_equal_after_every_update(tied, model.tied_names(), steps)


@pytest.mark.parametrize(
    ("devices", "split"),
    [
        pytest.param(2, "3", id="P2"),
        # [Embed | Block1, Block2 | Block3, Head]: stage 1 is the lowest holder of the Block1/Block3 tie, so it
        # adds that tie's squared norm (after waiting for its sum at UPDATE); stage 0 adds the embedding's.
        pytest.param(3, "1,3", id="P3-tie-held-lowest-by-stage-1"),
    ],
)
def test_tied_model_with_gradient_clipping(tmp_path, devices, split):
    """The global norm counts a tied parameter once, as clipping on one device does."""
    args, steps, clip = ("--schedule", "2bw", "--microbatches", str(devices), *TIES), 8, 0.3
    result, weights, tied = run_toy(tmp_path, devices, *args, "--split-points", split, "--clip", str(clip))
    ref_losses, ref_weights, model = reference_toy(*args, steps=steps, clip=clip)
    assert_same_run(result, weights, ref_losses, ref_weights)
    assert_copies_equal_after_every_update(tied, model.tied_names(), steps)
    unclipped, _, _ = reference_toy(*args, steps=steps)
    assert abs(unclipped[-1] - ref_losses[-1]) > 1e-4  # the clip is active


def test_tied_model_built_on_meta_and_checkpoint(tmp_path):
    """Copies materialised from meta start equal; the checkpoint holds every name the one-device model has."""
    args, steps = ("--schedule", "2bw", "--microbatches", "2", "--tie-embedding"), 6
    result, weights, tied = run_toy(tmp_path, 2, *args, "--meta", "--save-checkpoint", "--steps", str(steps))
    ref_losses, ref_weights, model = reference_toy(*args, steps=steps)
    assert_same_run(result, weights, ref_losses, ref_weights)
    from lightning_async_pp.checkpoint import read_tensors

    saved = {k.removeprefix("state_dict."): v for k, v in read_tensors(tmp_path / "final.ckpt", "state_dict.").items()}
    assert sorted(saved) == sorted(ref_weights)
    for names in model.tied_names():
        for name in names:
            torch.testing.assert_close(saved[name], ref_weights[name], **TOL)


@pytest.mark.slow
def test_tied_model_on_two_replicas_of_two_stages(tmp_path):
    args, steps, D = ("--schedule", "2bw", "--microbatches", "2", *TIES), 6, 2
    result, weights, tied = run_toy(
        tmp_path,
        4,
        *args,
        "--split-points",
        "3",
        "--pipeline-size",
        "2",
        "--steps",
        str(steps),
        "--total-steps",
        str(steps * D),
    )
    ref_losses, ref_weights, model = reference_replicated(args, steps, D)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), **TOL)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=5e-5, msg=lambda m: f"{name}: {m}")
    assert_copies_equal_after_every_update(tied, model.tied_names(), steps)


def reference_replicated(args, steps, replicas):
    """One device on the global batch (the replicas' shards side by side), D*M micro-batches."""
    from torch.utils.data import DistributedSampler

    from lightning_async_pp import AsyncPipelineStrategy
    from tests.fixtures.helpers import fit, random_batches
    from tests.multiprocess.scripts.toy_run import _parser, model_kwargs

    parsed = _parser().parse_args(["--out", "unused", *args])
    items = random_batches(steps * replicas, batch_size=6, block=8)
    shards = [
        list(DistributedSampler(items, num_replicas=replicas, rank=r, shuffle=True, seed=0)) for r in range(replicas)
    ]
    batches = [
        tuple(torch.cat([items[shards[r][t]][k] for r in range(replicas)]) for k in range(2)) for t in range(steps)
    ]
    torch.set_num_threads(1)
    model = ToyLM(**model_kwargs(parsed))
    strategy = AsyncPipelineStrategy(schedule=parsed.schedule, num_microbatches=replicas * parsed.microbatches)
    losses = fit(model, batches, strategy=strategy)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, model


def test_demo_gpt_with_tied_weights_on_two_stages_equals_one_device(tmp_path):
    from lightning_async_pp import AsyncPipelineStrategy
    from tests.fixtures.helpers import fit, random_batches, tiny_gpt
    from tests.multiprocess.scripts.pipeline_run import make_optimizer
    from tests.multiprocess.test_pipeline_exactness import run_pipeline

    # SGD: the attention key bias has a zero gradient in exact arithmetic, and Adam would turn the rounding
    # noise of the tied gradient's other summation order into lr-sized steps (see test_data_parallel).
    model = tiny_gpt(n_layer=4, tie_weights=True, optimizer=make_optimizer("sgd"))
    assert model.layers[-1].lm_head.weight is model.layers[0].tok.weight
    assert len(list(model.parameters())) == len(list(tiny_gpt(n_layer=4).parameters())) - 1
    result, weights = run_pipeline(tmp_path, 2, "2bw", 2, 6, "sgd", "--tie-weights")
    torch.set_num_threads(1)
    ref_losses = fit(model, random_batches(6), strategy=AsyncPipelineStrategy(schedule="2bw", num_microbatches=2))
    assert_same_run(result, weights, ref_losses, {k: v.detach() for k, v in model.state_dict().items()})
    assert torch.equal(weights["layers.0.tok.weight"], weights["layers.5.lm_head.weight"])


def test_tied_copies_in_differently_named_groups_are_refused(tmp_path):
    """Grouping by name ("no decay for the embedding") puts the head's copy in another group on its stage:
    the copies would drift apart, so the run stops before training and says what to change."""
    from tests.fixtures.helpers import run_script

    args = ("--schedule", "2bw", "--microbatches", "2", "--tie-embedding", "--optimizer", "adamw_by_name")
    command = [
        sys.executable,
        "-m",
        "tests.multiprocess.scripts.toy_run",
        "--devices",
        "2",
        "--out",
        str(tmp_path),
        "--split-points",
        "3",
        "--steps",
        "2",
        *args,
    ]
    code, output = run_script(command, 240)
    assert code != 0
    assert "layers.0.table.weight = layers.4.out.weight" in output, output[-3000:]
    assert "same group in `configure_optimizers`" in output
    # On one device the same model and optimizer train: it is one tensor in the no-decay group.
    losses, _, _ = reference_toy(*args, steps=2)
    assert len(losses) == 2
