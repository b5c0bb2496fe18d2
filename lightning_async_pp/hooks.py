"""Lightning's optimizer-step hooks for a pipeline stage, whose updates the stage runtime applies itself."""

from __future__ import annotations

from collections.abc import Callable

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch.optim import Optimizer


def before_optimizer_step(trainer: Trainer, optimizer: Optimizer) -> Callable[[], None]:
    """What a stage runs when the gradient of a step is complete, as Lightning does before an optimizer step:
    the callbacks' and the module's ``on_before_optimizer_step``. They see this stage's parameters only."""

    def run() -> None:
        call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)

    return run


def check_gradient_clipping_hook(module: LightningModule) -> None:
    """Refuse an overridden ``configure_gradient_clipping``: each stage holds part of the gradient, so code that
    clips ``self.parameters()`` would clip every stage by its own norm, not by the norm of the whole model."""
    if type(module).configure_gradient_clipping is not LightningModule.configure_gradient_clipping:
        raise MisconfigurationException(
            f"{type(module).__name__} overrides `configure_gradient_clipping`, which a multi-stage pipeline cannot "
            "run: each stage holds only its own gradients, so it would clip every stage by a different norm. Remove "
            "the override and set `Trainer(gradient_clip_val=...)`: AsyncPipelineStrategy clips by the global norm "
            "across all stages. (On one device the override runs as usual.)"
        )
