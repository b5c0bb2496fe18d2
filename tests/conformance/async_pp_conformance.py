"""A pytest plugin that runs Lightning's own tests with ``AsyncPipelineStrategy`` put into their Trainers.

Load it into a run of Lightning's test suite (``-p async_pp_conformance``, this folder on ``PYTHONPATH``) and
choose the form with the environment variable ``ASYNC_PP_CONFORMANCE_FORM``:

- ``none``: nothing is injected; the outcomes of the tests as they are (the baseline).
- ``async_pp``: ``strategy="async_pp"`` in every ``Trainer`` on one CPU device that names no strategy.
- ``microbatches``: ``AsyncPipelineStrategy(num_microbatches=2)`` in the same Trainers, and Lightning's
  ``BoringModel`` given the pipeline contract (``pipeline_layers()`` -> ``[self.layer]``,
  ``pipeline_inputs(batch)`` -> ``batch``, ``pipeline_loss(out, batch)`` -> ``self.loss(out)``). A subclass
  that overrides ``training_step``, ``step`` or ``forward`` trains otherwise than the contract says, so it does
  not get it (a plain module, refused with two micro-batches, outside the selection); a training batch
  with an odd number of samples (Lightning's are of one) is doubled (each of its tensors twice, the same mean
  loss) so that it can be cut in two.

Each test's outcome is written, one JSON object a line, to ``ASYNC_PP_CONFORMANCE_REPORT`` (if set), with

- ``exercised``: an injected strategy's ``setup`` ran in the test (a fit, validate, test or predict under it);
- ``pipeline``: in that setup the module was a pipeline module (the form ``microbatches`` counts only these:
  a plain ``LightningModule`` cannot be cut into micro-batches and is refused by design);
- ``message``: the first line of the failure, to group failures by cause.

A test that runs longer than ``ASYNC_PP_CONFORMANCE_TIMEOUT`` seconds (default 180) is failed by ``SIGALRM``,
so a hang cannot stall the run.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import signal
from typing import Any

import pytest

FORMS = ("none", "async_pp", "microbatches")
_FORM = os.environ.get("ASYNC_PP_CONFORMANCE_FORM", "async_pp")
_REPORT = os.environ.get("ASYNC_PP_CONFORMANCE_REPORT")
_TIMEOUT = int(os.environ.get("ASYNC_PP_CONFORMANCE_TIMEOUT", "180"))
if _FORM not in FORMS:
    raise ValueError(f"ASYNC_PP_CONFORMANCE_FORM={_FORM!r}: choose one of {FORMS}")


class _Record:
    """What the current test did with an injected strategy."""

    def __init__(self) -> None:
        self.injected = 0
        self.exercised = False
        self.pipeline = False


_current = _Record()


def _one_cpu_device(arguments: dict[str, Any]) -> bool:
    """Whether a Trainer with these arguments (strategy not named) runs on one CPU device."""
    import torch

    accelerator, devices = arguments.get("accelerator", "auto"), arguments.get("devices", "auto")
    on_cpu = accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available())
    return on_cpu and devices in ("auto", 1, "1") and arguments.get("num_nodes", 1) == 1


def _make_strategy() -> Any:
    if _FORM == "async_pp":
        return "async_pp"
    from lightning_async_pp import AsyncPipelineStrategy

    return AsyncPipelineStrategy(num_microbatches=2)


def _patch_trainer() -> None:
    from lightning.pytorch import Trainer

    original = Trainer.__init__
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # Lightning's own error for arguments it does not take
            return original(self, *args, **kwargs)
        arguments = bound.arguments
        if arguments.get("strategy", "auto") == "auto" and _one_cpu_device(arguments):
            bound.arguments["strategy"] = _make_strategy()
            _current.injected += 1
            original(*bound.args, **bound.kwargs)
            self.strategy._conformance_injected = True
            return
        original(self, *args, **kwargs)

    Trainer.__init__ = __init__


def _patch_setup() -> None:
    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.runtime.contract import is_pipeline_module

    original = AsyncPipelineStrategy.setup

    @functools.wraps(original)
    def setup(self: Any, trainer: Any) -> None:
        if getattr(self, "_conformance_injected", False):
            _current.exercised = True
            _current.pipeline = _current.pipeline or is_pipeline_module(self.lightning_module)
        return original(self, trainer)

    AsyncPipelineStrategy.setup = setup


def _double_odd_training_batch(self: Any, batch: Any, dataloader_idx: int) -> Any:
    import torch
    from lightning.fabric.utilities.apply_func import apply_to_collection

    trainer = self._trainer
    if trainer is None or not trainer.training:
        return batch
    sizes = []
    apply_to_collection(batch, torch.Tensor, lambda t: sizes.append(t.shape[0] if t.dim() else 0))
    if any(size % 2 for size in sizes):  # every tensor twice: the same mean loss, cut in two equal halves
        return apply_to_collection(batch, torch.Tensor, lambda t: torch.cat([t, t]) if t.dim() else t)
    return batch


def _trains_as_boring_model(cls: type) -> bool:
    """Whether a subclass of ``BoringModel`` computes its training loss as ``BoringModel`` does, the computation
    the contract below describes (a subclass with a ``training_step`` of its own trains otherwise)."""
    from lightning.pytorch.demos.boring_classes import BoringModel

    return all(getattr(cls, name) is getattr(BoringModel, name) for name in ("training_step", "step", "forward"))


def _contract_method(function: Any) -> property:
    def get(self: Any) -> Any:
        if not _trains_as_boring_model(type(self)):
            raise AttributeError(f"{type(self).__name__} trains through a training_step of its own")
        return function.__get__(self)

    return property(get)


def _give_boring_model_the_contract() -> None:
    from lightning.pytorch.demos.boring_classes import BoringModel

    BoringModel.pipeline_layers = _contract_method(lambda self: [self.layer])
    BoringModel.pipeline_inputs = _contract_method(lambda self, batch: batch)
    BoringModel.pipeline_loss = _contract_method(lambda self, out, batch: self.loss(out))
    BoringModel.on_after_batch_transfer = _double_odd_training_batch


def pytest_configure(config: pytest.Config) -> None:
    # Lightning's CI runs its tests with pytest-rerunfailures, whose marker some tests carry; here they run once.
    config.addinivalue_line("markers", "flaky(reruns, reruns_delay): rerun by pytest-rerunfailures (not here)")
    if _FORM == "none":
        return
    import lightning_async_pp  # noqa: F401  (registers "async_pp")

    _patch_trainer()
    _patch_setup()
    if _FORM == "microbatches":
        _give_boring_model_the_contract()


def _alarm(signum: int, frame: Any) -> None:
    raise TimeoutError(f"the test ran longer than {_TIMEOUT} s (ASYNC_PP_CONFORMANCE_TIMEOUT)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    global _current
    _current = _Record()
    item.conformance_outcomes = {}
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(_TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    _write(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    report = outcome.get_result()
    outcomes = getattr(item, "conformance_outcomes", None)
    if outcomes is None:
        return
    if report.failed:
        text = str(call.excinfo.value) if call.excinfo is not None else report.longreprtext
        first = next((line for line in text.strip().splitlines() if line.strip()), "")
        name = call.excinfo.typename if call.excinfo is not None else "Failed"
        outcomes.setdefault("message", f"{name}: {first}"[:300])
    if report.when == "call" or report.failed or report.skipped:
        outcomes.setdefault(report.when, report.outcome)


def _outcome(outcomes: dict[str, str]) -> str:
    if outcomes.get("setup") == "failed" or outcomes.get("teardown") == "failed" and outcomes.get("call") != "failed":
        return "error"
    if outcomes.get("setup") == "skipped" or outcomes.get("call") == "skipped":
        return "skipped"
    return outcomes.get("call", "error")


def _write(item: pytest.Item) -> None:
    if not _REPORT:
        return
    outcomes = item.conformance_outcomes
    record = {
        "nodeid": item.nodeid,
        "form": _FORM,
        "outcome": _outcome(outcomes),
        "injected": _current.injected,
        "exercised": _current.exercised,
        "pipeline": _current.pipeline,
        "message": outcomes.get("message", ""),
    }
    with open(_REPORT, "a") as file:
        file.write(json.dumps(record) + "\n")
