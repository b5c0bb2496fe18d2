"""Resuming a training epoch at the batch where a checkpoint left it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class ResumableLoader:
    """Wraps a training dataloader so that a resumed epoch continues at the next unseen batch.

    Lightning restores how many batches of the current epoch were completed, but restarts a plain
    ``DataLoader`` from its first batch. This wrapper skips the completed ones (reading, not training on
    them) when iteration actually begins, so a resumed run sees the same batches as an uninterrupted one,
    provided the loader itself is deterministic per epoch (for example a sampler seeded by epoch).

    Args:
        dataloader: The training dataloader.
        completed_batches: Returns the number of batches of the current epoch already trained on.
    """

    def __init__(self, dataloader: Any, completed_batches: Callable[[], int]) -> None:
        self.dataloader = dataloader
        self.completed_batches = completed_batches

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        # A generator: this body runs at the first `next()`, after Lightning has restored its progress
        # counters and called `set_epoch` on the sampler.
        iterator = iter(self.dataloader)
        skip = self.completed_batches()
        if hasattr(self.dataloader, "__len__") and len(self.dataloader) > 0:
            skip %= len(self.dataloader)
        for _ in range(skip):
            next(iterator, None)
        yield from iterator

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        # `sampler`, `batch_size`, `dataset`, ...: look like the wrapped loader to Lightning.
        return getattr(self.__dict__["dataloader"], name)

    # Marks the loader as resumable for Lightning: the position lives in Lightning's own loop state.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
