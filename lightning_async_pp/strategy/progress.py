"""The progress bar's epoch when training is limited by ``max_steps`` only.

With ``max_steps`` set and ``max_epochs`` unset (how the quick start and most pipeline runs are configured),
Lightning sets ``max_epochs=-1``: no epoch limit. Lightning 2.6's ``RichProgressBar`` (the default bar when
``rich`` is installed) then reads ``Epoch 2/-2``: it appends ``max_epochs - 1`` whenever ``max_epochs`` is not
``None``; plain Lightning prints the same without this strategy (fixed upstream in Lightning's pull request
21924). ``TQDMProgressBar`` prints ``Epoch 2``; :func:`show_epoch_without_total` makes the rich bar do the same.
"""

from __future__ import annotations

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import RichProgressBar

__all__ = ["EpochDescription", "show_epoch_without_total"]


class EpochDescription:
    """A ``RichProgressBar``'s training description: ``Epoch N`` without a total when ``max_epochs`` is -1, else
    the bar's own. An object, not a closure, so that a trainer with the bar can be pickled."""

    def __init__(self, bar: RichProgressBar) -> None:
        self.bar = bar

    def __call__(self, current_epoch: int) -> str:
        max_epochs = self.bar.trainer.max_epochs
        if max_epochs is None or max_epochs >= 0:
            return type(self.bar)._get_train_description(self.bar, current_epoch)
        text = f"Epoch {current_epoch}"
        # Padded to the validation bar's description, as Lightning pads it, so the bar does not flicker.
        return f"{text:{len(self.bar.validation_description)}}"


def show_epoch_without_total(trainer: Trainer) -> None:
    """Make the trainer's ``RichProgressBar`` (if it has one) show ``Epoch N`` without a total when
    ``max_epochs`` is -1; with a finite ``max_epochs`` it shows ``Epoch N/max_epochs-1`` as before."""
    bar = trainer.progress_bar_callback
    if not isinstance(bar, RichProgressBar) or isinstance(vars(bar).get("_get_train_description"), EpochDescription):
        return
    bar._get_train_description = EpochDescription(bar)
