"""Training loaders with worker processes under the strategy on one device, as under Lightning's own."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from tests.unit.strategy.test_lifecycle import Regression, batches, delayed_sgd, trainer, weights

pytestmark = pytest.mark.multiprocess


def test_a_second_fit_with_persistent_workers_goes_on_as_one_run():
    """``persistent_workers=True``: Lightning resets the loader between the fits; the second fit starts the
    workers anew and trains the next epoch, the two fits together equal to the delayed reference of both epochs."""
    data, model = batches(2), Regression()
    loader = DataLoader(data, batch_size=None, num_workers=1, persistent_workers=True)
    run = trainer(max_epochs=1, max_steps=-1)
    run.fit(model, loader)
    run.fit_loop.max_epochs = 2
    run.fit(model, loader)
    assert run.global_step == 4
    torch.testing.assert_close(weights(model), delayed_sgd(data + data), rtol=0, atol=1e-6)
