"""How many micro-batches a training batch is cut into: one decision, held in one place.

``num_microbatches`` is either given or ``"auto"``. An ``"auto"`` count is *pending* until the first training
batch shows the batch size (every rank sees the same batch, so every rank decides alike); until then the
launch checks use the least it can become (one per stage) and evaluation cuts nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from lightning_async_pp.strategy.lifecycle import choose_num_microbatches

__all__ = ["MicrobatchCount"]


class MicrobatchCount:
    """The micro-batches per training batch, given or decided by the first training batch (``"auto"``).

    Args:
        requested: A positive count, or ``"auto"``.
    """

    def __init__(self, requested: int | Literal["auto"]) -> None:
        self.pending = requested == "auto"
        self.value: int = 1 if self.pending else int(requested)

    @property
    def known(self) -> int | None:
        """The count once decided; ``None`` while ``"auto"`` waits for the first training batch."""
        return None if self.pending else self.value

    @property
    def evaluated(self) -> int:
        """Up to the micro-batches training uses; 1 while ``"auto"`` has seen no training batch."""
        return 1 if self.pending else self.value

    def at_launch(self, num_stages: int) -> int | None:
        """The count the launch checks know (``None`` if pending); a pending count stands at its least, one per
        stage, until the first batch decides it."""
        if self.pending:
            self.value = num_stages
        return self.known

    def decide(self, batch: Any, num_stages: int, cut: bool, announce: bool) -> int:
        """The count for ``batch``; a pending count is decided here, once (1 where nothing is ``cut``: a module's
        own training step on one device)."""
        if self.pending:
            self.value = choose_num_microbatches(batch, num_stages, announce) if cut else 1
            self.pending = False
        return self.value
