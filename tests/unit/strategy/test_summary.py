"""The pipeline's model summary (one table of every stage) and the progress bar's epoch without a total."""

from __future__ import annotations

import logging
import re

import pytest
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.runtime.ties import find_ties
from lightning_async_pp.strategy.placement import partition_layers
from lightning_async_pp.strategy.summary import pipeline_table, pipeline_totals, stage_counts
from tests.fixtures.helpers import fit, random_batches, tiny_gpt


def split(model, num_stages):
    layers = list(model.pipeline_layers())
    partition = partition_layers(layers, num_stages)
    stages = [stage_counts(s, r, [layers[i] for i in r]) for s, r in enumerate(partition)]
    return stages, find_ties(layers, partition), partition


@pytest.mark.parametrize("tie_weights", [False, True])
@pytest.mark.parametrize("num_stages", [1, 2, 3])
def test_totals_equal_the_unsplit_model(tie_weights, num_stages):
    model = tiny_gpt(n_layer=4, tie_weights=tie_weights)
    model.layers[2].ln1.requires_grad_(False)  # some frozen parameters: trainable differs from total
    stages, ties, partition = split(model, num_stages)
    totals = pipeline_totals(stages, ties)
    params = list(model.parameters())  # the unsplit model: a tied weight is one parameter
    assert totals.total == sum(p.numel() for p in params)
    assert totals.trainable == sum(p.numel() for p in params if p.requires_grad) < totals.total
    assert totals.bytes == sum(p.numel() * p.element_size() for p in params)
    assert [s.layers for s in stages] == partition
    embedding = model.layers[0].tok.weight.numel()
    crosses = tie_weights and num_stages > 1  # one stage holds the embedding and the head: one tensor there
    assert totals.tied == (embedding if crosses else 0)
    # Each stage counts its own layers' parameters, its copy of a tied weight included.
    for s, r in zip(stages, partition, strict=True):
        own = {id(p): p for i in r for p in model.layers[i].parameters()}.values()
        assert s.total == sum(p.numel() for p in own)


def test_table_shows_stages_ranks_and_totals():
    model = tiny_gpt(n_layer=4, tie_weights=True)
    stages, ties, _ = split(model, 2)
    text = pipeline_table(stages, [[2, 3], [0, 1]], ties, "Pipeline of 2 stages x 2 replicas")
    expected = sum(p.numel() for p in model.parameters())
    assert f"Total params ({expected:,})" in text
    rows = [line for line in text.splitlines() if re.match(r"^[01] +\|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["2, 3", "0, 1"]
    assert [r.split("|")[2].strip() for r in rows] == ["0-2", "3-5"]
    assert [r.split("|")[3].strip() for r in rows] == ["Embedding, 2 x Block", "2 x Block, Head"]
    assert f"{model.layers[0].tok.weight.numel():,} on stages 0, 1" in text


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


class EpochDescriptions(Callback):
    """The train bar's description at the end of each epoch, as the bar shows it."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        bar = trainer.progress_bar_callback
        if isinstance(bar, RichProgressBar):
            self.seen.append(bar.progress.tasks[bar.train_progress_bar_id].description.strip())
        else:
            self.seen.append(bar.train_progress_bar.desc.strip().removesuffix(":"))  # tqdm adds ": "


def fit_one_device(bar, capsys, max_steps=-1, **kwargs):
    """Fit the tiny GPT on 2 batches an epoch under the strategy on one device, with Lightning's default model
    summary; returns what was logged and printed, the epoch descriptions, and the model."""
    handler, descriptions = LogCapture(), EpochDescriptions()
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    model = tiny_gpt()
    kwargs = {"enable_progress_bar": True, "enable_model_summary": True, "callbacks": [bar, descriptions], **kwargs}
    try:
        fit(model, random_batches(2), AsyncPipelineStrategy(num_microbatches=2), max_steps=max_steps, **kwargs)
    finally:
        logger.removeHandler(handler)
    return "\n".join(handler.messages) + capsys.readouterr().out, descriptions.seen, model


def test_one_device_prints_the_pipeline_table_instead_of_lightnings(capsys):
    output, _, model = fit_one_device(RichProgressBar(), capsys, max_steps=2)
    expected = sum(p.numel() for p in model.parameters())
    assert output.count("Pipeline of 1 stage,") == 1
    assert output.count("Trainable params") == 1  # Lightning's summary prints this line too
    assert f"Total params ({expected:,})" in output
    assert "Total FLOPs" not in output


def test_no_summary_when_disabled(capsys):
    output, _, _ = fit_one_device(RichProgressBar(), capsys, max_steps=2, enable_model_summary=False)
    assert "Pipeline of" not in output and "Trainable params" not in output


def test_epoch_without_total_when_max_epochs_unset(capsys):
    """With ``max_steps`` only, the rich bar shows ``Epoch N`` as the TQDM bar does, not ``Epoch N/-2``; with
    ``max_epochs`` it keeps the total."""
    _, rich, _ = fit_one_device(RichProgressBar(), capsys, max_steps=6, enable_model_summary=False)
    _, tqdm, _ = fit_one_device(TQDMProgressBar(), capsys, max_steps=6, enable_model_summary=False)
    assert rich == tqdm == ["Epoch 0", "Epoch 1", "Epoch 2"]
    _, bounded, _ = fit_one_device(RichProgressBar(), capsys, max_epochs=2, enable_model_summary=False)
    assert bounded == ["Epoch 0/1", "Epoch 1/1"]


def test_user_guide_example_is_the_table_of_its_model():
    """The summary printed in user-guide.md is what `pipeline_table` gives for the model the text names."""
    from lightning_async_pp.demos import GPT
    from tests.fixtures.helpers import ROOT

    text = (ROOT / "docs" / "user-guide.md").read_text().split("### The model summary", 1)[1]
    named = "A 4-block demo GPT (`n_embd=32`, `block_size=16`, `tie_weights=True`) on 2 stages x 2 replicas"
    assert named in " ".join(text.split())
    shown = text.split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n")
    stages, ties, _ = split(GPT(n_layer=4, n_embd=32, block_size=16, tie_weights=True), 2)
    title = "Pipeline of 2 stages x 2 replicas, schedule '2bw':"
    assert pipeline_table(stages, [[2, 3], [0, 1]], ties, title=title) == shown
