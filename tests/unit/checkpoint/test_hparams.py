"""A ``--ckpt_path`` file's hyperparameters fill in arguments of the configured model class only: they never
choose a class, import a module or set a callable (``fit``/``validate --ckpt_path``, before anything is built)."""

from __future__ import annotations

import sys

import pytest
import torch

from lightning_async_pp.cli import AsyncPipelineCLI
from tests.unit.test_cli import fit


class _Built(Exception):
    """Raised instead of building the model: the configuration was parsed (and the checkpoint's merged)."""


@pytest.fixture
def parsed(monkeypatch):
    """The parsed ``model`` configuration of the next ``fit``, which then stops before building anything."""
    seen = {}

    def instantiate_classes(self):
        seen["model"] = self.config[self.config.subcommand]["model"]
        raise _Built

    monkeypatch.setattr(AsyncPipelineCLI, "instantiate_classes", instantiate_classes)
    return seen


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """An importable module that leaves a marker when imported (code a crafted checkpoint would run)."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "planted_module.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Model:\n    pass\ndef optimizer(*a, **k):\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    sys.modules.pop("planted_module", None)


def _checkpoint(path, hparams) -> str:
    torch.save({"state_dict": {}, "hyper_parameters": hparams}, path)
    return str(path)


GPT = "lightning_async_pp.demos.GPT"


@pytest.mark.parametrize(
    ("hparams", "match"),
    [
        ({"_class_path": "planted_module.Model", "n_layer": 2}, r"saved by the model class planted_module\.Model"),
        ({"class_path": "planted_module.Model"}, r"saved by the model class planted_module\.Model"),
        ({"_class_path": GPT, "optimizer": {"class_path": "planted_module.optimizer"}}, r"argument 'optimizer'"),
        ({"_class_path": GPT, "optimizer": "planted_module.optimizer"}, r"argument 'optimizer'"),
        ({"_class_path": GPT, "not_an_argument": 1}, r"'not_an_argument', which GPT does not take"),
    ],
    ids=["other-class", "class_path", "nested-class", "callable-by-name", "unknown-argument"],
)
def test_checkpoint_hyperparameters_cannot_choose_a_class(tmp_path, capsys, parsed, planted, hparams, match):
    path = _checkpoint(tmp_path / "crafted.ckpt", hparams)
    with pytest.raises(SystemExit) as exit_:
        fit("--ckpt_path", path)
    assert exit_.value.code == 2
    assert "model" not in parsed  # refused before anything was built
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and path in error[0], error
    assert pytest.importorskip("re").search(match, error[0]), error[0]
    assert not planted.exists() and "planted_module" not in sys.modules


def test_checkpoint_hyperparameters_fill_in_arguments_of_the_configured_class(tmp_path, parsed):
    """What Lightning's command line does with a checkpoint of the configured class is kept: its plain arguments
    replace the configuration's; an argument equal to the configuration's passes even if it names a class."""
    with pytest.raises(_Built):
        fit("--trainer.devices", "1")
    optimizer = parsed["model"]["init_args"]["optimizer"].as_dict()
    path = _checkpoint(tmp_path / "model.ckpt", {"_class_path": GPT, "n_layer": 3, "optimizer": optimizer})
    with pytest.raises(_Built):
        fit("--trainer.devices", "1", "--ckpt_path", path)
    assert parsed["model"]["class_path"] == GPT
    assert parsed["model"]["init_args"]["n_layer"] == 3  # the quickstart configures 4
    assert parsed["model"]["init_args"]["n_embd"] == 128  # the configuration's, where the checkpoint says nothing
    assert parsed["model"]["init_args"]["optimizer"].as_dict() == optimizer
