"""The command line runs the quickstart config and TensorBoard receives every step."""

import os
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.fixtures.helpers import ROOT, run_group

QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"


def run_cli(tmp_path, *extra, timeout=240, launcher=(sys.executable,)):
    command = [
        *launcher,
        "-m",
        "lightning_async_pp",
        "fit",
        "--config",
        str(QUICKSTART),
        "--trainer.max_steps",
        "6",
        "--trainer.val_check_interval",
        "3",
        "--trainer.limit_val_batches",
        "2",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.enable_checkpointing",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.logger.init_args.version",
        "0",
        *extra,
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    result = run_group(command, timeout, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def scalars(log_dir):
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}


@pytest.mark.multiprocess
def test_quickstart_logs_every_step(tmp_path):
    result = run_cli(tmp_path)
    log_dir = tmp_path / "quickstart" / "version_0"
    assert "tensorboard --logdir" in result.stdout
    logged = scalars(log_dir)
    train_steps = [event.step for event in logged["train/loss"]]
    assert train_steps == list(range(6))
    for tag in ("train/lr", "train/tokens_per_sec"):
        assert len(logged[tag]) == 6, tag
    assert all(event.value > 0 for event in logged["train/tokens_per_sec"])
    assert len(logged["val/loss"]) == 2
    assert len(logged["val/perplexity"]) == 2
    # Perplexity is exp(mean token loss).
    for loss, ppl in zip(logged["val/loss"], logged["val/perplexity"]):
        assert abs(ppl.value - 2.718281828**loss.value) / ppl.value < 1e-3


@pytest.mark.multiprocess
def test_two_stages_log_the_same_loss_curve_as_one_device(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    run_cli(one, "--trainer.devices", "1")
    run_cli(two, "--trainer.devices", "2")
    curve_one = [e.value for e in scalars(one / "quickstart" / "version_0")["train/loss"]]
    logged_two = scalars(two / "quickstart" / "version_0")
    curve_two = [e.value for e in logged_two["train/loss"]]
    assert len(curve_one) == len(curve_two) == 6
    for a, b in zip(curve_one, curve_two):
        assert abs(a - b) <= 1e-5 * abs(a), (curve_one, curve_two)
    assert "pipeline/bubble_fraction" in logged_two
    # Validation ran through both stages and logged on rank 0.
    assert len(logged_two["val/loss"]) == 2


def test_optimizer_overlays_build_the_named_optimizers():
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_async_pp.cli import AsyncPipelineCLI
    from lightning_async_pp.optim import DelayCorrected, Muon

    # The quick start itself (no overlay) shows the method: Muon with the delay correction.
    expected = {
        "": ("DelayCorrected", "Muon"),
        "adamw.yaml": ("AdamW", None),
        "muon.yaml": ("Muon", None),
        "adamw_corrected.yaml": ("DelayCorrected", "AdamW"),
        "muon_corrected.yaml": ("DelayCorrected", "Muon"),
    }
    for overlay, (outer, inner) in expected.items():
        overlays = ["--config", str(QUICKSTART.parent / overlay)] if overlay else []
        cli = AsyncPipelineCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=["--config", str(QUICKSTART), *overlays, "--trainer.devices", "1", "--trainer.logger", "false"],
        )
        optimizer = cli.model.optimizer_factory(cli.model.named_parameters())
        assert type(optimizer).__name__ == outer, overlay
        if inner is not None:
            assert isinstance(optimizer, DelayCorrected) and type(optimizer.base_optimizer).__name__ == inner
        if "muon" in overlay or not overlay:
            muon = optimizer.base_optimizer if isinstance(optimizer, DelayCorrected) else optimizer
            assert isinstance(muon, Muon)


@pytest.mark.multiprocess
def test_corrected_muon_config_trains(tmp_path):
    overlay = QUICKSTART.parent / "muon_corrected.yaml"
    run_cli(tmp_path, "--config", str(overlay), "--trainer.devices", "1")
    losses = [e.value for e in scalars(tmp_path / "quickstart" / "version_0")["train/loss"]]
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_torchrun_drives_the_cli(tmp_path):
    """torchrun starts the processes itself (Lightning's TorchElasticEnvironment); same loss curve as one device."""
    one, two = tmp_path / "one", tmp_path / "torchrun"
    one.mkdir()
    two.mkdir()
    run_cli(one, "--trainer.devices", "1")
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2")
    run_cli(two, "--trainer.devices", "2", launcher=torchrun)
    curve_one = [e.value for e in scalars(one / "quickstart" / "version_0")["train/loss"]]
    curve_two = [e.value for e in scalars(two / "quickstart" / "version_0")["train/loss"]]
    assert len(curve_two) == 6
    for a, b in zip(curve_one, curve_two):
        assert abs(a - b) <= 1e-5 * abs(a), (curve_one, curve_two)


# --- the installed console script (`async-pp`) -------------------------------------------------------------

# What `pip install` put next to this interpreter: the entry point a user runs, not the module.
CONSOLE_SCRIPT = Path(sys.executable).parent / "async-pp"

# A user's model file: the test suite's small conv classifier, defined in a module of the current folder.
TINY_MODEL = """
import sys

import lightning as L
import torch

from tests.fixtures.helpers import ConvClassifier, conv_batches, loader


class Tiny(ConvClassifier):
    def __init__(self, channels: int = 8):
        super().__init__(channels=channels, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


class TinyData(L.LightningDataModule):
    def train_dataloader(self):
        return loader(conv_batches(8))
"""

TINY_CONFIG = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 1
  strategy: {class_path: lightning_async_pp.AsyncPipelineStrategy, init_args: {num_microbatches: 2}}
  max_steps: 2
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  logger: {class_path: lightning.pytorch.loggers.TensorBoardLogger, init_args: {save_dir: runs}}
model: {class_path: tinymodel.Tiny}
data: {class_path: tinymodel.TinyData}
"""


def tiny_project(folder: Path) -> Path:
    """A user's folder: a model file and a config that names it by ``class_path``."""
    (folder / "tinymodel.py").write_text(TINY_MODEL)
    (folder / "config.yaml").write_text(TINY_CONFIG)
    return folder


def run_command(command, cwd, timeout=240):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return run_group(command, timeout, cwd=cwd, env=env)


def console_script() -> Path:
    assert CONSOLE_SCRIPT.exists(), f"{CONSOLE_SCRIPT} is missing: install the package (`pip install -e .`)"
    return CONSOLE_SCRIPT


@pytest.mark.multiprocess
def test_console_script_exits_zero_after_success_and_prints_the_logs_once(tmp_path):
    result = run_command([console_script(), "fit", "--config", "config.yaml"], tiny_project(tmp_path))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "object at 0x" not in output
    assert output.count("TensorBoard logs:") == 1, output[-3000:]
    assert output.count("tensorboard --logdir") == 1


@pytest.mark.multiprocess
def test_console_script_exits_non_zero_when_the_run_fails(tmp_path):
    # A batch of 8 does not split into 3 micro-batches: the run raises inside `fit`.
    result = run_command(
        [console_script(), "fit", "--config", "config.yaml", "--trainer.strategy.init_args.num_microbatches", "3"],
        tiny_project(tmp_path),
    )
    assert result.returncode != 0
    assert "num_microbatches" in result.stderr


@pytest.mark.parametrize("entry", ["console script", "module"])
@pytest.mark.multiprocess
def test_both_entry_points_import_a_model_from_the_current_folder(tmp_path, entry):
    launcher = [console_script()] if entry == "console script" else [sys.executable, "-m", "lightning_async_pp"]
    # Two stages: the second process, started by Lightning's launcher, must find the model file too.
    result = run_command(
        [*launcher, "fit", "--config", "config.yaml", "--trainer.devices", "2"], tiny_project(tmp_path)
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    output = result.stdout + result.stderr
    assert "pipeline stage 1/2" in output
    assert output.count("TensorBoard logs:") == 1, output[-3000:]  # rank 0 only, once


@pytest.mark.parametrize(
    "class_path, expected",
    [("nosuchfile.Tiny", "the folder that holds nosuchfile.py"), ("tinymodel.Tinyy", "does not define it")],
)
@pytest.mark.multiprocess
def test_an_unimportable_class_path_is_one_line_that_says_what_to_do(tmp_path, class_path, expected):
    tiny_project(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(TINY_CONFIG.replace("tinymodel.Tiny}", f"{class_path}}}"))
    result = run_command([console_script(), "fit", "--config", "config.yaml"], tmp_path)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip() and "Tip:" not in line]
    assert len(errors) == 1, result.stderr
    assert f"cannot import class_path '{class_path}'" in errors[0] and expected in errors[0], errors[0]


@pytest.mark.multiprocess
def test_a_checkpoint_of_another_model_is_refused_and_every_rank_exits_with_status_1(tmp_path):
    tiny_project(tmp_path)
    config = tmp_path / "config.yaml"
    config.write_text(TINY_CONFIG.replace("enable_checkpointing: false", "enable_checkpointing: true"))
    saved = run_command([sys.executable, "-m", "lightning_async_pp", "fit", "--config", "config.yaml"], tmp_path)
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-3000:]
    (checkpoint,) = (tmp_path / "runs").rglob("*.ckpt")
    command = [sys.executable, "-m", "lightning_async_pp", "fit", "--config", "config.yaml", "--trainer.devices", "2"]
    result = run_command([*command, "--model.init_args.channels", "16", "--ckpt_path", checkpoint], tmp_path)
    output = result.stdout + result.stderr
    # Not 137: Lightning's watch over the children used to SIGKILL the job while its ranks were ending cleanly.
    assert result.returncode == 1, output[-3000:]
    # Refused while Lightning restores the checkpoint, before the stages are placed: every rank says so itself.
    refusal = f"this rank failed: ValueError: The checkpoint {checkpoint} holds another model"
    assert output.count(refusal) == 2, output[-3000:]
