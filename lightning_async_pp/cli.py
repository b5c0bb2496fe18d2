"""Command line: a ``LightningCLI`` that knows the ``async_pp`` strategy.

    python -m lightning_async_pp fit --config examples/configs/quickstart.yaml
    async-pp fit --config examples/configs/quickstart.yaml --trainer.max_steps 50
    python -m lightning_async_pp consolidate lightning_logs/version_0/checkpoints/last.ckpt model.ckpt
    python -m lightning_async_pp tokenize corpus/ --out data/train.bin --tokenizer my-tokenizer/

Both forms behave alike: a ``class_path`` may name a module in the current folder, and the exit status is 0
after success and non-zero after an error. ``consolidate`` writes a sharded checkpoint as one file (and a
Hugging Face model, trained through ``lightning_async_pp.models.CausalLM``, also as a ``save_pretrained`` folder);
``tokenize`` writes a token file for ``lightning_async_pp.models.TokenFileDataModule`` from local text.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_async_pp  # noqa: F401  (registers strategy="async_pp")
from lightning_async_pp.checkpoint import TRANSFORMERS_KEY, ShardedCheckpointIO, consolidate

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


def default_pretrained_dir(out: str | os.PathLike) -> Path:
    """Where ``consolidate`` writes a ``save_pretrained`` folder by default: ``model.ckpt`` -> ``model-hf``."""
    out = Path(out)
    return out.with_name(f"{out.stem}-hf")


def consolidate_main(argv: list[str]) -> None:
    """``python -m lightning_async_pp consolidate CHECKPOINT_DIR OUT [--pretrained-dir DIR]``.

    Args:
        argv: The arguments after ``consolidate``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_async_pp consolidate",
        description="Write a sharded async_pp checkpoint directory as one Lightning checkpoint file (weights and "
        "metadata, no optimizer state), loadable with torch.load(weights_only=True) on one device. A checkpoint of "
        "lightning_async_pp.models.CausalLM is also written as a transformers save_pretrained folder.",
    )
    parser.add_argument("checkpoint_dir", help="checkpoint directory written by AsyncPipelineStrategy")
    parser.add_argument("out", help="the single-file checkpoint to write")
    parser.add_argument(
        "--pretrained-dir",
        default=None,
        help="for a CausalLM checkpoint: the save_pretrained folder to write (default: OUT without its suffix, "
        "plus '-hf': model.ckpt -> model-hf)",
    )
    args = parser.parse_args(argv)
    meta = ShardedCheckpointIO().load_checkpoint(args.checkpoint_dir)
    pretrained_dir = None
    if TRANSFORMERS_KEY in meta:
        pretrained_dir = args.pretrained_dir or default_pretrained_dir(args.out)
    elif args.pretrained_dir is not None:
        parser.error(
            f"{args.checkpoint_dir} was not saved by lightning_async_pp.models.CausalLM: --pretrained-dir "
            "only applies to Hugging Face models."
        )
    meta = consolidate(args.checkpoint_dir, args.out)
    if pretrained_dir is not None:
        from lightning_async_pp.models.hf import save_pretrained  # needs the optional transformers

        save_pretrained(meta, pretrained_dir)
    count = sum(t.numel() for t in meta["state_dict"].values())
    print(
        f"Wrote {args.out}: {len(meta['state_dict'])} tensors, {count:,} values, global step {meta.get('global_step')}"
    )
    if pretrained_dir is not None:
        print(f"Wrote {pretrained_dir}: transformers save_pretrained folder (AutoModelForCausalLM.from_pretrained)")


def main(args: Sequence[str] | None = None) -> int:
    """Run the command line (``async-pp`` and ``python -m lightning_async_pp``).

    Args:
        args: The arguments, ``None`` for ``sys.argv[1:]``. ``consolidate CHECKPOINT_DIR OUT`` writes a sharded
            checkpoint as one file (:func:`consolidate_main`); ``tokenize SOURCE... --out FILE`` writes a token
            file (:func:`lightning_async_pp.models.token_writer.main`).

    Returns:
        0 after success. Errors raise: argument errors as ``SystemExit(2)``, failures of the run as their
        exception, so the process exits with a non-zero status either way.
    """
    argv = list(args) if args is not None else sys.argv[1:]
    if argv[:1] == ["consolidate"]:  # not a LightningCLI subcommand
        consolidate_main(argv[1:])
        return 0
    if argv[:1] == ["tokenize"]:  # not a LightningCLI subcommand either
        from lightning_async_pp.models.token_writer import main as tokenize_main

        tokenize_main(argv[1:])
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
