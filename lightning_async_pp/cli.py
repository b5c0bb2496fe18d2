"""Command line: a ``LightningCLI`` that knows the ``async_pp`` strategy.

    python -m lightning_async_pp fit --config examples/configs/quickstart.yaml
    async-pp fit --config examples/configs/quickstart.yaml --trainer.max_steps 50
    python -m lightning_async_pp consolidate lightning_logs/version_0/checkpoints/last.ckpt model.ckpt
    python -m lightning_async_pp tokenize corpus/ --out data/train.bin --tokenizer my-tokenizer/
    python -m lightning_async_pp plan --config examples/configs/quickstart.yaml --device h100

Both forms behave alike: a ``class_path`` may name a module in the current folder (not under ``python -P``; the
folder comes after the installed packages, so a file there cannot replace one), and the exit status is 0 after
success and non-zero after an error. A ``--ckpt_path`` that is not a checkpoint is refused before anything is
built. ``consolidate`` writes a sharded checkpoint as one file (and a Hugging Face model, trained through
``lightning_async_pp.models.CausalLM``, also as a ``save_pretrained`` folder); ``tokenize`` writes a token file for
``lightning_async_pp.models.TokenFileDataModule`` from local text; ``plan`` prints what each stage of a ``fit``
configuration would hold and how fast the schedules would run, without starting anything (:func:`plan_main`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_async_pp import AsyncPipelineStrategy  # registers strategy="async_pp" too
from lightning_async_pp.checkpoint import TRANSFORMERS_KEY, ShardedCheckpointIO, consolidate
from lightning_async_pp.checkpoint.compat import check_checkpoint_path
from lightning_async_pp.checkpoint.hparams import CheckpointHyperparametersError, check_hyperparameters
from lightning_async_pp.meta import MetaLayers
from lightning_async_pp.strategy.topology import check_process_count

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


def refuse(message: str) -> NoReturn:
    """End the command with ``error: <message>`` on stderr and status 2, as an argument error does."""
    sys.stderr.write(f"error: {message}\n")
    sys.exit(2)


def unreadable_checkpoint_message(path: str, error: Exception) -> str:
    """What to say when Lightning cannot read the hyperparameters of the checkpoint file ``path`` safely.

    Torch's own message suggests loading with ``weights_only=False``, which runs whatever the file holds; this one
    names what the safe load refused and what to give instead.
    """
    text = str(error)
    _, found, rest = text.partition("WeightsUnpickler error:")
    if found:  # the object the safe load refused: the first sentence after the marker, without torch's advice
        reason = next((line.strip() for line in rest.splitlines() if line.strip()), "").split(". ")[0].rstrip(".")
        what = f"holds objects that a safe load (torch.load with weights_only=True) does not read ({reason})"
    else:
        what = f"could not be read ({type(error).__name__}: {text.strip().splitlines()[0] if text.strip() else ''})"
    return (
        f"ckpt_path={path!r} {what}. Resume from a checkpoint this strategy wrote (a directory holding "
        "`.metadata`), or from a file written by `python -m lightning_async_pp consolidate`; both hold only "
        "tensors and plain values."
    )


DESCRIPTION = (
    "Asynchronous pipeline-parallel training (lightning_async_pp) through LightningCLI: fit, validate, test and "
    "predict below take a model, data and trainer config. Three more commands: 'consolidate CHECKPOINT_DIR OUT' "
    "writes a sharded checkpoint as one file, 'tokenize SOURCE... --out FILE' writes a token file, and 'plan "
    "--config CONFIG' prints the memory per stage and the predicted speed of a fit configuration without running "
    "it; add --help after any of them for its options."
)


class AsyncPipelineCLI(LightningCLI):
    """``LightningCLI`` whose model and data are given by ``class_path`` in the config.

    A ``ckpt_path`` that is not a checkpoint is refused before anything is built (Lightning reads a checkpoint
    file's hyperparameters right after parsing, before the trainer and the strategy's own checks exist).
    """

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("parser_class", _Parser)
        super().__init__(*args, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        path = self._ckpt_path()
        if path is not None:
            try:
                check_checkpoint_path(path)
            except (OSError, ValueError) as error:
                refuse(str(error))

    def _parse_ckpt_path(self) -> None:
        """Lightning's merge of a checkpoint file's hyperparameters into the configuration, limited to arguments
        of the configured model class (:func:`~lightning_async_pp.checkpoint.hparams.check_hyperparameters`)."""
        path = self._ckpt_path()
        if not path or not Path(path).is_file():
            return
        try:
            checkpoint = torch.load(path, weights_only=True, map_location="cpu")
        except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
            refuse(unreadable_checkpoint_message(str(path), error))
        hparams = checkpoint.get("hyper_parameters", {}) if isinstance(checkpoint, dict) else {}
        if not isinstance(hparams, dict):
            refuse(
                f"ckpt_path={path!r} holds hyperparameters that are not a dict. Resume from a checkpoint this "
                "strategy wrote."
            )
        hparams = {k: v for k, v in hparams.items() if k != "_instantiator"}
        if not hparams:
            return
        subcommand = self.config.subcommand
        model = self.config[subcommand]["model"]
        cls, names, configured = _configured_model(model)
        try:
            hparams = check_hyperparameters(hparams, cls, names, configured, str(path))
        except CheckpointHyperparametersError as error:
            refuse(str(error))
        if hparams:
            update = {"class_path": model["class_path"], "init_args": hparams}
            self.config = self.parser.parse_object({subcommand: {"model": update}}, self.config)

    def _ckpt_path(self) -> str | None:
        subcommand = self.config.get("subcommand")
        return self.config[subcommand].get("ckpt_path") if subcommand else None

    def after_fit(self) -> None:
        logger = self.trainer.logger
        if isinstance(logger, TensorBoardLogger) and self.trainer.is_global_zero:
            print(
                f"\nTensorBoard logs: {logger.log_dir}\nView them with: tensorboard --logdir {logger.save_dir}",
                flush=True,
            )


def _configured_model(model: Any) -> tuple[type, set[str], dict[str, Any]]:
    """The configured model class (``model``: the parsed ``--model``), the names that stand for it, and its
    configured arguments as plain values."""
    class_path = model["class_path"]
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)  # the configuration's own class, imported when parsed
    init_args = model.get("init_args")
    configured = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    return cls, {class_path, f"{cls.__module__}.{cls.__qualname__}"}, configured


def importable_path(path: Sequence[str], cwd: str, safe_path: bool) -> list[str]:
    """``sys.path`` with the current folder ``cwd`` on it, so that a ``class_path`` may name a file there.

    ``python -m`` already puts the folder first; a console script puts its own folder (the environment's ``bin/``)
    there instead, and then the folder is appended, after the installed packages, so that a stray file named like
    one of them (``torch.py``, ``safetensors.py``) does not replace it. Under ``python -P`` (``safe_path``) the
    folder is not added at all.
    """
    path = list(path)
    if safe_path or any(os.path.abspath(entry or os.curdir) == cwd for entry in path):
        return path
    return [*path, cwd]


def _current_folder_importable() -> None:
    sys.path[:] = importable_path(sys.path, os.getcwd(), bool(sys.flags.safe_path))
    if sys.flags.safe_path:
        # Lightning starts the other ranks as `python -m ...` without this interpreter's flags: the environment
        # carries -P to them.
        os.environ["PYTHONSAFEPATH"] = "1"
    if sys.flags.isolated:
        # -I is -E -P -s: the ranks get -s through the environment, and no PYTHONPATH, which this process ignored.
        os.environ["PYTHONNOUSERSITE"] = "1"
        os.environ.pop("PYTHONPATH", None)


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
        if args.pretrained_dir is None and os.path.lexists(pretrained_dir):
            parser.error(
                f"{pretrained_dir} exists: consolidate writes its save_pretrained folder there by default and does "
                "not replace a folder nobody named. Move it, or name it with --pretrained-dir to write into it."
            )
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


class _PlanCLI(AsyncPipelineCLI):
    """Parses and instantiates ``fit``'s configuration with the model's layers on the meta device, no trainer."""

    def instantiate_classes(self) -> None:
        with MetaLayers():
            self.config_init = self.parser.instantiate_classes(self.config)
            self.model = self.config_init["model"]
            self.model.configure_model()
        self.datamodule = self.config_init["data"]


def _job_devices(trainer: Any, pipeline_parallel_size: int | None) -> int:
    """The job's processes, ``devices x num_nodes``, refused unless they hold whole pipelines."""
    devices, nodes = trainer["devices"], trainer["num_nodes"] or 1
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if not isinstance(devices, int) or devices < 1:
        refuse(f"plan needs the number of devices per node: give --trainer.devices N (got {devices!r}).")
    try:
        check_process_count(devices, nodes, pipeline_parallel_size or devices * nodes)
    except MisconfigurationException as error:
        refuse(str(error))
    return devices * nodes


def _plan_parser(devices: Iterable[str]) -> argparse.ArgumentParser:
    """The options of ``plan`` itself; ``devices`` are the names ``--device`` takes."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_async_pp plan",
        description="Memory per pipeline stage and predicted speed of a fit configuration (same --config and "
        "overrides as fit), read on the meta device: nothing is allocated or launched.",
        epilog="Every other option is fit's: --config FILE, --trainer.devices N, --trainer.num_nodes N, "
        "--trainer.strategy.init_args.*, --model.*, --data.* (see 'fit --help').",
    )
    parser.add_argument("--device", default="h100", help=f"one of {', '.join(devices)} (default h100)")
    parser.add_argument("--device-memory", type=float, help="GiB of one device (overrides --device's)")
    parser.add_argument("--peak-flops", type=float, help="peak FLOP/s of one device, e.g. 989e12")
    parser.add_argument("--efficiency", type=float, default=0.4, help="fraction of the peak reached (default 0.4)")
    parser.add_argument(
        "--overhead-ms", type=float, default=0.0, help="host ms per forward and per backward of a micro-batch (0)"
    )
    parser.add_argument("--reserved", type=float, default=2.0, help="GiB of a device kept for CUDA and NCCL (2)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def plan_main(argv: list[str]) -> None:
    """``python -m lightning_async_pp plan --config CONFIG [fit's overrides] [--device NAME] [--json] ...``.

    Args:
        argv: The arguments after ``plan``: this command's own options, the rest as for ``fit``.
    """
    from lightning_async_pp.strategy import planning

    parser = _plan_parser(planning.DEVICES)
    own, rest = parser.parse_known_args(argv)
    if not 0 < own.efficiency <= 1 or own.reserved < 0 or own.overhead_ms < 0:
        parser.error("--efficiency must be in (0, 1], --reserved and --overhead-ms at least 0.")
    try:
        device = planning.device_figures(own.device, own.device_memory, own.peak_flops)
    except ValueError as error:
        parser.error(str(error))
    _current_folder_importable()
    with warnings.catch_warnings():  # the arguments after `plan` are fit's, given as `args` on purpose
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        cli = _PlanCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            run=False,
            args=rest,
        )
    trainer, strategy = cli.config_init["trainer"], cli.config_init["trainer"]["strategy"]
    if strategy == "async_pp":
        strategy = AsyncPipelineStrategy()
    if not isinstance(strategy, AsyncPipelineStrategy):
        refuse(f"plan needs trainer.strategy async_pp (AsyncPipelineStrategy), got {strategy!r}.")
    try:
        report = planning.plan_from_config(
            cli.model,
            cli.datamodule,
            strategy,
            _job_devices(trainer, strategy.pipeline_parallel_size),
            str(trainer["precision"] or "32-true"),
            trainer["max_steps"],
            device,
            own.efficiency,
            own.reserved * 2**30,
            own.overhead_ms / 1e3,
        )
    except ValueError as error:
        refuse(str(error))
    print(json.dumps(report, indent=1) if own.json else planning.format_report(report))


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
    if argv[:1] == ["plan"]:  # reads fit's config but runs nothing
        plan_main(argv[1:])
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
        parser_kwargs={"description": DESCRIPTION},
        args=list(args) if args is not None else None,
    )
    return 0
