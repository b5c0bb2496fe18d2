"""Stage placement through the strategy: balanced by parameters or time, explicit split points, meta device."""

import time

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.demos import GPT
from lightning_async_pp.schedule.partition import count_parameters
from lightning_async_pp.strategy.placement import measure_layer_times, partition_layers
from tests.fixtures.helpers import tiny_gpt


def strategy_for(devices, **kwargs):
    """A strategy configured for `devices` stages, without starting any process."""
    kwargs.setdefault("num_microbatches", devices)
    trainer = Trainer(strategy=AsyncPipelineStrategy(**kwargs), accelerator="cpu", devices=devices, logger=False)
    return trainer.strategy


def test_balanced_by_parameters_puts_blocks_between_embedding_and_head():
    model = tiny_gpt(n_layer=4)  # layers: embedding, 4 blocks, head
    ranges = strategy_for(2).layer_partition(model)
    assert [list(r) for r in ranges] == [[0, 1, 2], [3, 4, 5]]
    costs = [count_parameters(layer) for layer in model.pipeline_layers()]
    loads = [sum(costs[i] for i in r) for r in ranges]
    # No contiguous split has a smaller largest stage.
    best = min(max(sum(costs[:k]), sum(costs[k:])) for k in range(1, len(costs)))
    assert max(loads) == best


def test_explicit_split_points():
    model = tiny_gpt(n_layer=4)
    ranges = strategy_for(3, split_points=[1, 5]).layer_partition(model)
    assert [list(r) for r in ranges] == [[0], [1, 2, 3, 4], [5]]


@pytest.mark.parametrize("split_points", [[0, 3], [3, 6], [4, 2], [2]])
def test_split_points_out_of_range_or_wrong_count(split_points):
    with pytest.raises(ValueError, match="split point"):
        strategy_for(3, split_points=split_points).layer_partition(tiny_gpt(n_layer=4))


def test_more_stages_than_layers():
    with pytest.raises(ValueError, match="only 3 layers"):
        strategy_for(4).layer_partition(tiny_gpt(n_layer=1))


class Sleepy(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def test_balanced_by_measured_time_isolates_the_slow_layer():
    layers = [Sleepy(0.02), Sleepy(0.0), Sleepy(0.0), Sleepy(0.0)]
    costs = measure_layer_times(layers, torch.randn(2, 8))
    assert costs[0] > 5 * max(costs[1:])
    assert [list(r) for r in partition_layers(layers, 2, costs=costs)] == [[0], [1, 2, 3]]
    # By parameter count the same model splits in the middle.
    assert [list(r) for r in partition_layers(layers, 2)] == [[0, 1], [2, 3]]


def test_strategy_balance_time_needs_example_input():
    model = tiny_gpt(n_layer=2)
    with pytest.raises(Exception, match="example_input_array"):
        strategy_for(2, balance="time").layer_partition(model)
    model.example_input_array = torch.randint(0, 256, (2, 16))
    ranges = strategy_for(2, balance="time").layer_partition(model)
    assert len(ranges) == 2 and ranges[0].start == 0 and ranges[-1].stop == 4


def _rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_20b_parameter_gpt_is_partitioned_on_the_meta_device(capsys):
    before = _rss_mb()
    with torch.device("meta"):
        model = GPT(n_layer=100, n_embd=4096, n_head=32, lr_schedule="constant")
    layers = list(model.pipeline_layers())
    total = count_parameters(model)
    assert 19e9 < total < 21e9
    ranges = partition_layers(layers, 64)
    shares = [sum(count_parameters(layers[i]) for i in r) for r in ranges]
    for stage, (r, share) in enumerate(zip(ranges, shares)):
        print(f"stage {stage:2d}: layers {r.start}-{r.stop - 1}, {share / 1e6:.0f}M parameters")
    assert len(ranges) == 64 and sum(shares) == total
    # Blocks are ~201M parameters each: stages hold one or two.
    assert max(shares) <= 2 * max(count_parameters(layer) for layer in layers)
    assert all(p.is_meta for p in model.parameters())
    assert _rss_mb() - before < 500
    assert "stage 63" in capsys.readouterr().out


def _stage_tensors(root):
    return {id(t) for t in (*root.parameters(), *root.buffers())}


def test_second_reference_to_the_layers_is_replaced_too():
    """An adapter that keeps `self.alias` beside `self.layers` (or a submodule of a layer under another
    name) holds only the stage's own layers after placement."""
    from lightning_async_pp.strategy.placement import RemoteLayer, keep_only_layers
    from tests.multiprocess.scripts.toy_run import ToyLM

    model = ToyLM(alias=True, tie_embedding=True)
    model.head_norm = model.layers[4].norm  # a module inside a layer, reached by a second path
    layers = list(model.pipeline_layers())
    keep_only_layers(model, layers, range(0, 2), owner_of=[0, 0, 1, 1, 1])
    own = {id(t) for layer in layers[:2] for t in (*layer.parameters(), *layer.buffers())}
    assert _stage_tensors(model) == own  # the tied head weight stays through the embedding only
    assert isinstance(model.alias[3], RemoteLayer) and isinstance(model.head_norm, RemoteLayer)
    assert model.alias[0] is layers[0]
    assert sorted(model.state_dict()) == [
        "alias.0.table.weight",
        "alias.1.down.bias",
        "alias.1.down.weight",
        "alias.1.up.bias",
        "alias.1.up.weight",
        "layers.0.table.weight",
        "layers.1.down.bias",
        "layers.1.down.weight",
        "layers.1.up.bias",
        "layers.1.up.weight",
    ]


def test_a_direct_reference_to_another_stages_tensor_is_refused():
    from lightning_async_pp.strategy.placement import keep_only_layers
    from tests.multiprocess.scripts.toy_run import ToyLM

    model = ToyLM()
    model.register_parameter("shortcut", model.layers[3].up.weight)
    with pytest.raises(ValueError, match="`shortcut` of ToyLM is a tensor of pipeline layer 3"):
        keep_only_layers(model, list(model.pipeline_layers()), range(0, 2), owner_of=[0, 0, 1, 1, 1])


@pytest.mark.multiprocess
def test_module_with_a_second_reference_to_its_layers_on_two_stages(tmp_path):
    """Each stage keeps only its own parameters, and the trained model equals the one-device run."""
    from tests.multiprocess.scripts.toy_run import reference_toy, run_toy

    args = ("--schedule", "2bw", "--microbatches", "2", "--split-points", "2", "--alias")
    result, weights, _ = run_toy(tmp_path, 2, *args)
    ref_losses, ref_weights, _ = reference_toy(*args)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # Rank 0 is the last stage (layers 2-4), rank 1 the first (layers 0-1).
    for rank, own in ((0, range(2, 5)), (1, range(0, 2))):
        names = torch.load(tmp_path / f"weights_rank{rank}.pt")
        assert {int(n.split(".")[1]) for n in names} == set(own), names
