"""Bad input on the command line is refused before anything is built or started, with a message that says what to
change (and never suggests an unsafe load); the current folder is importable without shadowing installed packages."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_async_pp.cli import AsyncPipelineCLI, importable_path, main
from tests.fixtures.helpers import ROOT

QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"


def fit(*extra: str) -> None:
    main(["fit", "--config", str(QUICKSTART), "--trainer.logger", "false", *extra])


class Unsafe:
    """A class no safe load knows: pickled into a file, it stands for code the file would run."""


@pytest.fixture
def nothing_built(monkeypatch):
    """Building the model, the data or the Trainer fails the test: the refusal must come first."""

    def instantiate_classes(self):
        raise AssertionError("the model, the data or the Trainer was built before the refusal")

    monkeypatch.setattr(AsyncPipelineCLI, "instantiate_classes", instantiate_classes)


@pytest.fixture
def no_launch(monkeypatch):
    """Starting a worker process fails the test (both of the strategy's launchers)."""

    def start(*args, **kwargs):
        raise AssertionError("a worker process was started before the refusal")

    monkeypatch.setattr(_SubprocessScriptLauncher, "_call_children_scripts", start)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", start)


def write_unsafe(path):
    torch.save({"hyper_parameters": {"thing": Unsafe()}}, path)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (None, r"does not exist\. Give the path of a saved checkpoint"),
        (lambda p: p.write_text("not a checkpoint\n"), r"not a checkpoint of this strategy.*\.metadata"),
        (lambda p: p.mkdir(), r"is a directory without `\.metadata`: not a checkpoint of this strategy"),
        (write_unsafe, r"does not read \(Unsupported global: GLOBAL .*Unsafe.*\)\. Resume from a checkpoint"),
    ],
    ids=["missing", "text-file", "plain-directory", "unsafe-file"],
)
def test_a_ckpt_path_that_is_not_a_checkpoint_is_refused_before_anything_is_built(
    tmp_path, capsys, nothing_built, make, match
):
    path = tmp_path / "model.ckpt"
    if make is not None:
        make(path)
    with pytest.raises(SystemExit) as exit_:
        fit("--ckpt_path", str(path))
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    lines = [line for line in error.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and str(path) in lines[0], error
    assert re.search(match, lines[0]), lines[0]
    assert "weights_only=False" not in error and "weights_only` set to `False" not in error


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (
            ["--trainer.strategy.init_args.num_microbatches", "3"],
            "TextDataModule's batch_size=16 cannot be split into num_microbatches=3",
        ),
        (["--data.batch_size", "-4"], "TextDataModule's batch_size=-4 is not a positive number of samples"),
        (["--data.batch_size", "6"], "batch_size=6 cannot be split into num_microbatches=4"),
    ],
    ids=["microbatches", "negative", "batch-size"],
)
def test_a_data_module_batch_size_that_cannot_be_split_is_refused_before_any_worker_starts(no_launch, extra, match):
    with pytest.raises(ValueError, match=match):
        fit("--trainer.enable_checkpointing", "false", *extra)


def test_a_ckpt_path_that_does_not_exist_is_refused_by_the_launcher_too(tmp_path, no_launch):
    """Through the Trainer (no command line): the launcher's check, before any worker starts."""
    from lightning.pytorch import Trainer

    from lightning_async_pp import AsyncPipelineStrategy
    from tests.fixtures.helpers import loader, random_batches, tiny_gpt

    trainer = Trainer(
        strategy=AsyncPipelineStrategy(num_microbatches=4), accelerator="cpu", devices=2, logger=False, max_steps=1
    )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        trainer.fit(tiny_gpt(), loader(random_batches(1)), ckpt_path=str(tmp_path / "missing.ckpt"))


# --- the current folder on sys.path ------------------------------------------------------------------------

SITE = ["/env/bin", "/usr/lib/python311.zip", "/env/lib/python3.11/site-packages"]


def test_the_current_folder_comes_after_the_installed_packages():
    # A console script: its own folder first, the current one not yet there.
    path = importable_path(SITE, "/project", safe_path=False)
    assert path == [*SITE, "/project"]  # a stray /project/torch.py cannot replace the installed torch


def test_the_current_folder_is_not_added_twice_nor_under_safe_path():
    here = os.getcwd()
    for entry in ("", ".", here):  # how `python -c`, a relative entry and `python -m` name it
        assert importable_path([entry, *SITE], here, safe_path=False) == [entry, *SITE]
    assert importable_path(SITE, "/project", safe_path=True) == SITE


@pytest.mark.multiprocess  # a subprocess: only the interpreter's own -P sets sys.flags.safe_path
def test_python_dash_p_keeps_the_current_folder_off_the_path(tmp_path):
    (tmp_path / "strayfile.py").write_text("raise SystemExit('the current folder was imported from')\n")
    (tmp_path / "config.yaml").write_text("model: {class_path: strayfile.Model}\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    command = [sys.executable, "-P", "-m", "lightning_async_pp", "fit", "--config", "config.yaml", "--print_config"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "cannot import class_path 'strayfile.Model' (No module named 'strayfile')" in result.stderr


def test_help_names_the_commands_besides_lightnings(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for command in ("fit", "consolidate CHECKPOINT_DIR OUT", "tokenize SOURCE... --out FILE"):
        assert command in text, command


def test_python_dash_i_carries_its_isolation_to_the_ranks(monkeypatch):
    """Lightning starts the ranks as plain `python -m ...`: the environment must say what -I said (-P and -s), and
    not hand them the PYTHONPATH that -I made this process ignore."""
    from types import SimpleNamespace

    from lightning_async_pp import cli

    monkeypatch.setattr(cli.sys, "flags", SimpleNamespace(safe_path=True, isolated=True))
    monkeypatch.setattr(cli.sys, "path", list(sys.path))
    for name in ("PYTHONSAFEPATH", "PYTHONNOUSERSITE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    cli._current_folder_importable()
    assert os.environ["PYTHONSAFEPATH"] == "1" and os.environ["PYTHONNOUSERSITE"] == "1"
    assert "PYTHONPATH" not in os.environ
