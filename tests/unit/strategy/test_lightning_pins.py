"""The Lightning internals the strategy relies on, pinned: a Lightning upgrade that moves one fails here, in CI,
not in a user's run. Also checks that the installed Lightning and Python are inside the bounds pyproject.toml
declares, so the bounds are the ones the suite ran with."""

from __future__ import annotations

import inspect
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_installed_versions_are_inside_the_declared_bounds():
    requirements = {Requirement(r).name: Requirement(r) for r in PYPROJECT["dependencies"]}
    lightning = requirements["lightning"]
    assert any(s.operator == "<" for s in lightning.specifier), (
        "lightning needs an upper bound: the strategy uses private APIs"
    )
    assert version("lightning") in lightning.specifier
    assert version("torch").split("+")[0] in requirements["torch"].specifier
    python = ".".join(map(str, sys.version_info[:3]))
    assert python in SpecifierSet(PYPROJECT["requires-python"])
    # The benchmarks start ranks with subprocess.Popen(process_group=...), new in Python 3.11.
    assert "3.10.99" not in SpecifierSet(PYPROJECT["requires-python"])


def test_fabric_distributed_helpers():
    from lightning.fabric.utilities import distributed

    assert _parameters(distributed._distributed_is_initialized) == []
    assert _parameters(distributed._get_default_process_group_backend_for_device) == ["device"]
    assert _parameters(distributed._sync_ddp_if_available) == ["result", "group", "reduce_op"]
    assert _parameters(distributed._all_gather_ddp_if_available) == ["tensor", "group", "sync_grads"]


def test_launchers():
    from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

    assert _parameters(_SubprocessScriptLauncher.__init__) == [
        "self",
        "cluster_environment",
        "num_processes",
        "num_nodes",
    ]
    assert _parameters(_MultiProcessingLauncher.__init__)[:3] == ["self", "strategy", "start_method"]
    assert _parameters(_MultiProcessingLauncher._collect_rank_zero_results) == ["self", "trainer", "results"]
    for launcher in (_SubprocessScriptLauncher, _MultiProcessingLauncher):
        assert _parameters(launcher.launch)[:2] == ["self", "function"]


def test_sigterm_broadcast_is_a_replaceable_method_called_every_step():
    # The strategy replaces `_broadcast_sigterm_tensor` on the epoch loop by a non-blocking version; if Lightning
    # stopped calling it through the instance, the per-step barrier would silently come back.
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    assert _parameters(_TrainingEpochLoop._broadcast_sigterm_tensor) == ["self"]
    assert "self._broadcast_sigterm_tensor()" in inspect.getsource(_TrainingEpochLoop.advance)


def test_sigterm_notifier_is_a_method_in_a_list_of_handlers():
    # lightning_async_pp.strategy.signals swaps the connector's notifier (which would broadcast inside the handler and
    # set the flag every rank checks after its step) for one that only records the signal, in the handler
    # list Lightning installs, and sets `received_sigterm` on the connector where every rank stops.
    from lightning.pytorch import Trainer
    from lightning.pytorch.trainer.connectors.signal_connector import _HandlersCompose, _SignalConnector

    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "sigterm_handlers: list[_HANDLER] = [self._sigterm_notifier_fn]" in source
    assert "_HandlersCompose(sigterm_handlers)" in source
    assert _HandlersCompose([print]).signal_handlers == [print]
    assert "self.received_sigterm = True" in inspect.getsource(_SignalConnector._sigterm_notifier_fn)
    assert "self._signal_connector.received_sigterm" in inspect.getsource(Trainer.received_sigterm.fget)


def test_slurm_requeue_handler_is_a_method_in_a_list_of_handlers():
    # lightning_async_pp.strategy.signals swaps Lightning's SLURM requeue handler (which saves a checkpoint from
    # inside the signal handler) for one that only records the signal, in the list Lightning installs for the
    # environment's requeue signal; a job started again resumes from `hpc_ckpt_{n}.ckpt` when `ckpt_path` is None.
    import signal

    from lightning.fabric.plugins.environments import SLURMEnvironment
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

    source = inspect.getsource(_SignalConnector.register_signal_handlers)
    assert "sigusr_handlers.append(self._slurm_sigusr_handler_fn)" in source
    assert "environment.requeue_signal" in source and "_HandlersCompose(sigusr_handlers)" in source
    assert '["scontrol", "requeue", job_id]' in inspect.getsource(_SignalConnector._slurm_sigusr_handler_fn)
    environment = SLURMEnvironment()
    assert environment.auto_requeue is True and environment.requeue_signal == signal.SIGUSR1
    resume = inspect.getsource(_CheckpointConnector._parse_ckpt_path)
    assert "ckpt_path is None and SLURMEnvironment.detect() and self._hpc_resume_path is not None" in resume
    assert 'f"hpc_ckpt_{max_version}.ckpt"' in inspect.getsource(_CheckpointConnector._hpc_resume_path.fget)


def test_hook_callers():
    # A stage calls `on_before_optimizer_step` itself, through the trainer's hook callers (which set the
    # current hook's name, so `self.log` inside the hook works).
    from lightning.pytorch.trainer import call

    assert _parameters(call._call_callback_hooks)[:2] == ["trainer", "hook_name"]
    assert _parameters(call._call_lightning_module_hook)[:2] == ["trainer", "hook_name"]


def test_what_the_metrics_relay_reads_and_writes():
    # lightning_async_pp.strategy.metrics reads the step's training metrics from `trainer._results.metrics(on_step)` and
    # writes relayed values into the dict `trainer.callback_metrics` returns, which must be the live one.
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    from lightning_async_pp.strategy.metrics import CHECKPOINT_STATE

    assert _parameters(_ResultCollection.metrics) == ["self", "on_step"]
    assert set(_ResultCollection.metrics(_ResultCollection(training=True), True)) == {"callback", "log", "pbar"}
    trainer = Trainer(logger=False, enable_progress_bar=False)
    trainer.callback_metrics.update({"relayed": 1})
    assert trainer.callback_metrics["relayed"] == 1 and isinstance(trainer.callbacks, list)
    checkpoint = ModelCheckpoint(monitor="val/loss")
    assert all(hasattr(checkpoint, name) for name in CHECKPOINT_STATE)


def test_checkpoint_io_wrapping():
    # The strategy puts its ShardedCheckpointIO inside a wrapping plugin (AsyncCheckpointIO) and queues removals
    # on AsyncCheckpointIO's executor behind the saves already submitted.
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO

    wrapper = AsyncCheckpointIO()
    assert isinstance(wrapper, _WrappingCheckpointIO)
    assert wrapper._checkpoint_io is None and wrapper._base_checkpoint_io_configured is False
    assert wrapper._executor is None
    wrapper.save_checkpoint  # noqa: B018
    assert "_ensure_setup" in vars(AsyncCheckpointIO)


def test_scheduler_warning_reads_the_optimizer_flag():
    # The strategy marks its optimizer as stepped (`_opt_called`) instead of filtering torch's "lr_scheduler.step()
    # before optimizer.step()" warning for the whole process.
    import torch

    source = inspect.getsource(torch.optim.lr_scheduler.LRScheduler)
    assert '"_opt_called"' in source and "before `optimizer.step()`" in source


def test_the_cli_reads_a_checkpoints_hyperparameters_between_parsing_and_building():
    # lightning_async_pp.cli checks ckpt_path in parse_arguments and words the errors of _parse_ckpt_path.
    from lightning.pytorch.cli import LightningCLI

    source = inspect.getsource(LightningCLI.__init__)
    order = [
        source.index(call)
        for call in ("self.parse_arguments(", "self._parse_ckpt_path()", "self.instantiate_classes()")
    ]
    assert order == sorted(order)
    assert _parameters(LightningCLI._parse_ckpt_path) == ["self"]
    assert "weights_only=True" in inspect.getsource(LightningCLI._parse_ckpt_path)


def test_the_script_launcher_and_its_child_observer():
    # launch.py's _ScriptLauncher repeats Lightning's `launch` with another observer (a _ChildProcessObserver).
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

    source = inspect.getsource(_SubprocessScriptLauncher.launch)
    for line in ("self._call_children_scripts()", "_launch_process_observer(self.procs)", "_set_num_threads_if_needed"):
        assert line in source, line
    assert _parameters(_ChildProcessObserver.__init__) == ["self", "main_pid", "child_processes", "sleep_period"]
    assert _parameters(_ChildProcessObserver._run) == ["self"]
    assert _parameters(_ChildProcessObserver._terminate_all) == ["self"]
    assert "self._child_processes" in inspect.getsource(_ChildProcessObserver.__init__)
