"""``plan``'s measurements on the meta device against closed forms, and the command end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from lightning_async_pp import PipelineModule
from lightning_async_pp.cli import main
from lightning_async_pp.demos import GPT
from lightning_async_pp.meta import MetaLayers
from lightning_async_pp.strategy.model_figures import measure_model, optimizer_state_bytes
from tests.fixtures.helpers import ROOT

QUICKSTART = str(ROOT / "examples" / "configs" / "quickstart.yaml")

IN, HIDDEN, OUT, B = 8, 16, 4, 3


class Toy(PipelineModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, OUT)])

    def pipeline_layers(self):
        return list(self.layers)

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return nn.functional.mse_loss(output, batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())


def toy_figures(dtype, optimizer=None):
    with MetaLayers():
        model = Toy()
    if optimizer is not None:
        model.configure_optimizers = lambda: optimizer(model.named_parameters())
    assert next(model.parameters()).is_meta
    batch = (torch.randn(B, IN), torch.randn(B, OUT))
    return measure_model(model, batch, dtype, optimizer_state_bytes(model, 10))


def test_linear_layers_measured_as_their_closed_forms():
    figures = toy_figures(None)
    first, second = figures.layers
    assert {n: p.numel for n, p in first.parameters.items()} == {
        "layers.0.weight": IN * HIDDEN,
        "layers.0.bias": HIDDEN,
    }
    # AdamW: exp_avg and exp_avg_sq of each parameter's size, plus its float32 step counter.
    assert all(p.optimizer_bytes == 2 * 4 * p.numel + 4 for p in first.parameters.values())
    # A Linear keeps its input for the weight's gradient, nothing else of its own.
    assert (first.input_bytes, first.input_saved, first.saved_bytes) == (4 * B * IN, True, 0)
    assert (first.output_bytes, first.output_saved) == (4 * B * HIDDEN, False)
    assert (second.input_bytes, second.input_saved, second.saved_bytes) == (4 * B * HIDDEN, True, 0)
    assert figures.loss_saved_bytes == 4 * B * OUT  # mse_loss keeps the target beside the output
    # Matmul FLOPs: forward and the weight's gradient; the input's gradient too past the model's input.
    assert (first.flops, second.flops) == (2 * 2 * B * IN * HIDDEN, 3 * 2 * B * HIDDEN * OUT)
    assert all(p.cast_bytes == 0 for layer in figures.layers for p in layer.parameters.values())


def test_optimizer_state_is_what_each_optimizer_creates():
    from lightning_async_pp.optim import DelayCorrected, Muon

    corrected = toy_figures(None, lambda params: DelayCorrected(torch.optim.AdamW(params)))
    for p in corrected.layers[0].parameters.values():
        assert (p.optimizer_bytes, p.correction_bytes) == (2 * 4 * p.numel + 4, 4 * p.numel)
    muon = toy_figures(None, lambda params: DelayCorrected(Muon(params, lr=0.02)))
    weight, bias = muon.layers[0].parameters["layers.0.weight"], muon.layers[0].parameters["layers.0.bias"]
    assert (weight.optimizer_bytes, weight.correction_bytes) == (4 * IN * HIDDEN, 4 * IN * HIDDEN)  # momentum
    assert (bias.optimizer_bytes, bias.correction_bytes) == (2 * 4 * HIDDEN + 4, 4 * HIDDEN)  # AdamW's part


def test_autocast_copies_of_the_weights_are_told_apart():
    figures = toy_figures(torch.bfloat16)
    first = figures.layers[0]
    assert first.parameters["layers.0.weight"].cast_bytes == 2 * IN * HIDDEN
    assert first.parameters["layers.0.bias"].cast_bytes == 0  # not needed for backward
    # The bfloat16 copy of the input is what the Linear keeps now, not the float32 input.
    assert (first.input_saved, first.saved_bytes) == (False, 2 * B * IN)


@pytest.fixture(scope="module")
def quickstart_plan():
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "--config", QUICKSTART, "--json", "--device", "a100-80gb"]) == 0
    return json.loads(out.getvalue())


def test_plan_command_on_the_quickstart_config(quickstart_plan):
    report = quickstart_plan
    with MetaLayers():
        gpt = GPT(n_layer=4, n_embd=128, n_head=4, block_size=128)
    assert report["model"]["parameters"] == sum(p.numel() for p in gpt.parameters())
    assert report["device"]["peak_flops"] == 312e12
    expected = {"stages": 2, "replicas": 1, "num_microbatches": 4, "batch_size": 16, "devices": 2}
    assert {k: report["setting"][k] for k in expected} == expected
    for kind, versions in (("2bw", 2), ("1f1b", 1)):
        stages = report["schedules"][kind]["stages"]
        assert [s["in_flight"] for s in stages] == [2, 1]
        assert sum(s["parameters"] for s in stages) == report["model"]["parameters"]
        assert all(s["weights"] == versions * 4 * s["parameters"] for s in stages)
        assert all(s["low_precision_copies"] == 0 for s in stages)  # 32-true: no autocast
        assert report["schedules"][kind]["fits"] is True
    assert report["schedules"]["2bw"]["bubble"] < report["schedules"]["1f1b"]["bubble"]
    assert {(row["P"], row["M"]) for row in report["grid"]} == {(1, 1), (1, 2), (1, 4), (2, 2), (2, 4), (2, 8)}


def test_plan_refuses_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["plan", "--config", QUICKSTART, "--device", "tpu-v9"])
    assert exit.value.code == 2
    assert "--device-memory GIB and --peak-flops" in capsys.readouterr().err


def test_plan_refuses_microbatches_decided_at_the_first_batch(capsys):
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "plan",
                "--config",
                QUICKSTART,
                "--trainer.strategy.init_args.num_microbatches",
                "auto",
            ]
        )
    assert exit.value.code == 2
    assert "--trainer.strategy.init_args.num_microbatches N" in capsys.readouterr().err


def test_plan_refuses_processes_that_do_not_hold_whole_pipelines(capsys):
    with pytest.raises(SystemExit) as exit:
        main(
            [
                "plan",
                "--config",
                QUICKSTART,
                "--trainer.devices",
                "3",
                "--trainer.strategy.init_args.pipeline_parallel_size",
                "2",
            ]
        )
    assert exit.value.code == 2
    assert "cannot hold whole pipelines of pipeline_parallel_size=2" in capsys.readouterr().err
