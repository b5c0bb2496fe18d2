"""Command line: a ``LightningCLI`` that knows the ``async_pp`` strategy.

    python -m lightning_async_pp fit --config examples/configs/quickstart.yaml
    async-pp fit --config examples/configs/quickstart.yaml --trainer.max_steps 50
    python -m lightning_async_pp consolidate lightning_logs/version_0/checkpoints/last.ckpt model.ckpt

Both forms behave alike: a ``class_path`` may name a module in the current folder, and the exit status is 0
after success and non-zero after an error. ``consolidate`` writes a sharded checkpoint as one file (and a
Hugging Face model, trained through ``lightning_async_pp.models.CausalLM``, also as a ``save_pretrained`` folder).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from typing import NoReturn

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_async_pp  # noqa: F401  (registers strategy="async_pp")

_CLASS_PATH_NOT_IMPORTABLE = re.compile(
    r'Parser key "(?P<key>[^"]+)".*?Problem with given class_path \'(?P<path>[^\']+)\':\s*'
    r"(?P<reason>(No module named|cannot import name|module '[^']+' has no attribute)[^\n]*)",
    re.S,
)


def class_path_hint(message: str) -> str | None:
    """One line that says what to do when a ``class_path`` in ``message`` (a parser error) cannot be imported.

    Returns ``None`` when the error is of another kind; its full text then says more than one line could.
    """
    match = _CLASS_PATH_NOT_IMPORTABLE.search(message)
    if match is None:
        return None
    key, path, reason = match.group("key"), match.group("path"), match.group("reason").strip()
    module = path.rpartition(".")[0] or path
    missing = re.match(r"No module named '([^']+)'", reason)
    if missing is not None:
        top = missing.group(1).split(".")[0]
        advice = (
            f"run the command in the folder that holds {top}.py (or the package folder {top}/), add that folder"
            " to PYTHONPATH, or install the package that provides it"
        )
    else:
        advice = f"check the class name: {module} was imported but does not define it"
    return f"{key}: cannot import class_path '{path}' ({reason}); {advice}."


class _Parser(LightningArgumentParser):
    """Says in one line what to do when a ``class_path`` cannot be imported, instead of the whole usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        hint = class_path_hint(message) if self.exit_on_error else None
        if hint is None:
            super().error(message, ex)
        sys.stderr.write(f"error: {hint}\n")
        sys.exit(2)


class AsyncPipelineCLI(LightningCLI):
    """``LightningCLI`` whose model and data are given by ``class_path`` in the config."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("parser_class", _Parser)
        super().__init__(*args, **kwargs)

    def after_fit(self) -> None:
        logger = self.trainer.logger
        if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:
            print(
                f"\nTensorBoard logs: {logger.log_dir}\nView them with: tensorboard --logdir {logger.save_dir}",
                flush=True,
            )


def _current_folder_importable() -> None:
    # `python -m` puts the current folder first on sys.path; a console script puts its own folder (the
    # environment's bin/) there instead. Both must find a model in a file next to where they are run.
    cwd = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)


def main(args: Sequence[str] | None = None) -> int:
    """Run the command line (``async-pp`` and ``python -m lightning_async_pp``).

    Args:
        args: The arguments, ``None`` for ``sys.argv[1:]``. ``consolidate CHECKPOINT_DIR OUT`` writes a sharded
            checkpoint as one file (:func:`lightning_async_pp.checkpoint.consolidate`).

    Returns:
        0 after success. Errors raise: argument errors as ``SystemExit(2)``, failures of the run as their
        exception, so the process exits with a non-zero status either way.
    """
    argv = list(args) if args is not None else sys.argv[1:]
    if argv[:1] == ["consolidate"]:  # not a LightningCLI subcommand
        from lightning_async_pp.checkpoint import consolidate_main

        consolidate_main(argv[1:])
        return 0
    _current_folder_importable()
    AsyncPipelineCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=list(args) if args is not None else None,
    )
    return 0
