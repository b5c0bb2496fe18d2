"""The training loader and the step on one device as Lightning has them: loaders of unknown length, a
``training_step`` of its own (``dataloader_iter``, batches of Python objects), Lightning's loader checks, and a
fitted Trainer that pickles; each training run compared with a delayed SGD written out here."""

from __future__ import annotations

import copy
import pickle
import warnings
from functools import partial
from operator import attrgetter

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.loops.progress import _BatchProgress
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, TensorDataset

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.strategy.lifecycle import ResumableLoader
from tests.fixtures.helpers import quiet_trainer

LR, STEPS = 0.1, 4


def batches(count: int = STEPS, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(size, 3, generator=generator), torch.randn(size, 1, generator=generator)) for _ in range(count)
    ]


class Regression(LightningModule):
    """A linear regression with its own ``training_step`` (no pipeline contract), trained by SGD."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        with torch.no_grad():
            self.layer.weight.copy_(torch.tensor([[0.5, -0.25, 1.0]]))
            self.layer.bias.fill_(0.1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


class PipelineRegression(Regression):
    """The same regression, pipeline-ready: the strategy computes its loss."""

    def pipeline_layers(self):
        return [self.layer]

    def pipeline_inputs(self, batch):
        return batch[0]

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])


def delayed_sgd(data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """PipeDream-2BW on one device, by hand: each step's gradient taken at the weights before the last update."""
    reference = Regression()
    current = [p.detach().clone() for p in reference.parameters()]
    previous = [p.clone() for p in current]
    for x, y in data:
        weight, bias = (p.clone().requires_grad_() for p in previous)
        loss = F.mse_loss(x @ weight.T + bias, y)
        grads = torch.autograd.grad(loss, [weight, bias])
        previous = [p.clone() for p in current]
        current = [p - LR * g for p, g in zip(current, grads)]
    return torch.cat([p.reshape(-1) for p in current])


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def trainer(**kwargs) -> Trainer:
    return quiet_trainer(**{"strategy": AsyncPipelineStrategy(), "max_steps": STEPS, **kwargs})


class Stream(IterableDataset):
    """An iterable dataset without ``__len__``."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


class LengthRaises(DataLoader):
    """A loader whose ``__len__`` raises, as a streaming loader of unknown length may."""

    def __len__(self) -> int:
        raise NotImplementedError


@pytest.mark.parametrize(
    "make_loader",
    [
        lambda data: DataLoader(Stream(data), batch_size=None),
        lambda data: LengthRaises(data, batch_size=None),
    ],
    ids=["iterable-without-len", "len-raises"],
)
def test_a_loader_of_unknown_length_trains_as_the_delayed_reference(make_loader):
    data, model = batches(), Regression()
    trainer().fit(model, make_loader(data))
    torch.testing.assert_close(weights(model), delayed_sgd(data), rtol=0, atol=1e-6)


def test_a_resumed_loader_of_unknown_length_skips_the_completed_batches():
    items = [torch.tensor([i]) for i in range(6)]
    for loader in (DataLoader(Stream(items), batch_size=None), LengthRaises(items, batch_size=None)):
        assert [int(b) for b in ResumableLoader(loader, lambda: 2)] == [2, 3, 4, 5]


class IteratorStep(Regression):
    """``training_step(self, dataloader_iter)``: the step takes its batch itself."""

    def training_step(self, dataloader_iter):
        (x, y), _, _ = next(dataloader_iter)
        return F.mse_loss(self.layer(x), y)


class Pair:
    """A batch that is a Python object of the user's, not a tensor or a container of tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y


class ObjectStep(Regression):
    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.layer(batch.x), batch.y)


@pytest.mark.parametrize(
    ("model_class", "collate"),
    [(IteratorStep, None), (ObjectStep, lambda batch: Pair(*batch))],
    ids=["dataloader_iter", "python-object"],
)
def test_auto_microbatches_leave_a_plain_modules_batch_alone_on_one_device(model_class, collate):
    data, model = batches(), model_class()
    loader = DataLoader(data, batch_size=None, collate_fn=collate) if collate else DataLoader(data, batch_size=None)
    strategy = AsyncPipelineStrategy()  # num_microbatches="auto"
    trainer(strategy=strategy).fit(model, loader)
    assert strategy.num_microbatches == 1
    torch.testing.assert_close(weights(model), delayed_sgd(data), rtol=0, atol=1e-6)


@pytest.mark.parametrize("model_class", [Regression, PipelineRegression])
def test_a_fitted_trainer_pickles_and_deep_copies(model_class):
    model = model_class()
    fitted = trainer(max_steps=2)
    fitted.fit(model, DataLoader(batches(2), batch_size=None))
    for copied in (pickle.loads(pickle.dumps(fitted)), copy.deepcopy(fitted)):
        torch.testing.assert_close(weights(copied.lightning_module), weights(model), rtol=0, atol=0)


def test_a_resumable_loader_pickles_and_deep_copies_and_writes_through():
    progress = _BatchProgress()  # Lightning's, as the strategy hands it
    progress.current.completed = 1
    wrapped = ResumableLoader(DataLoader(list(range(4))), partial(attrgetter("current.completed"), progress))
    for copied in (pickle.loads(pickle.dumps(wrapped)), copy.deepcopy(wrapped)):
        assert [int(b) for b in copied] == [1, 2, 3]
    # Lightning resets a loader's iterator by writing to it: the write reaches the DataLoader.
    wrapped._iterator = "stale"
    assert wrapped.dataloader._iterator == "stale" and "_iterator" not in vars(wrapped)


def few_workers_warnings(strategy, fits: int, monkeypatch) -> list[str]:
    # Lightning warns about a loader with few workers when the machine has cores to spare; say it has.
    monkeypatch.setattr("lightning.pytorch.trainer.connectors.data_connector.suggested_max_num_workers", lambda n: 4)
    run, model, messages = trainer(strategy=strategy, max_epochs=1, max_steps=-1), Regression(), []
    for epochs in range(1, fits + 1):
        run.fit_loop.max_epochs = epochs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run.fit(model, DataLoader(batches(2), batch_size=None))
        messages += [str(w.message) for w in caught if "does not have many workers" in str(w.message)]
    return messages


def test_lightnings_num_workers_warning_for_the_training_loader(monkeypatch):
    """As with Lightning's default strategy: once per fit, for the fresh and the resumed (wrapped) loader."""
    reference = few_workers_warnings("auto", 2, monkeypatch)
    assert len(reference) == 2 and "'train_dataloader'" in reference[0]
    assert few_workers_warnings(AsyncPipelineStrategy(), 2, monkeypatch) == reference


class Seen(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.batches.append(batch[0].clone())


def shuffled_run(strategy) -> tuple[list[torch.Tensor], DataLoader, Trainer]:
    seed_everything(3)
    data = TensorDataset(*(torch.cat(tensors) for tensors in zip(*batches(2))))
    loader, seen = DataLoader(data, batch_size=2, shuffle=True), Seen()
    run = trainer(strategy=strategy, max_epochs=2, max_steps=-1, callbacks=[seen])
    run.fit(Regression(), loader)
    return seen.batches, loader, run


def test_one_device_keeps_the_users_shuffled_loader():
    """On one device the user's loader and sampler are Lightning's: the same batches as under Lightning's own
    strategy with the same seed, and ``trainer.train_dataloader`` is the loader given."""
    reference, _, _ = shuffled_run("auto")
    seen, loader, run = shuffled_run(AsyncPipelineStrategy())
    assert run.train_dataloader is loader and type(loader.sampler) is RandomSampler
    assert len(seen) == len(reference) == 8
    for batch, expected in zip(seen, reference):
        assert torch.equal(batch, expected)


def test_a_fitted_trainer_with_the_rich_progress_bar_pickles():
    """The strategy's epoch description of a ``RichProgressBar`` (``max_steps`` only) is no closure."""
    bar = RichProgressBar()
    fitted = trainer(max_steps=2, enable_progress_bar=True, callbacks=[bar])
    fitted.fit(Regression(), DataLoader(batches(2), batch_size=None))
    assert fitted.max_epochs == -1 and bar._get_train_description(3).strip() == "Epoch 3"
    copied = pickle.loads(pickle.dumps(fitted))
    assert copied.progress_bar_callback._get_train_description(3).strip() == "Epoch 3"
