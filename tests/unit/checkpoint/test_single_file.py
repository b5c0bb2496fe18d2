"""Lightning's single-file checkpoint on one process: its layout, exact resume, ModelCheckpoint, strict_loading,
weights_only, fsspec URLs and Lightning's order of restoring (several processes: tests/multiprocess)."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint.single_file import read_entries, single_file_checkpoint
from lightning_async_pp.demos import GPT
from tests.fixtures.helpers import BLOCK, VOCAB, LossRecorder, loader, random_batches, tiny_gpt
from tests.multiprocess.scripts.pipeline_run import make_optimizer
from tests.multiprocess.test_checkpoint_ties import assert_tied_head_restored

STEPS = 4
SMALL = dict(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=2, n_embd=8, lr_schedule="constant")


def _trainer(steps: int, *callbacks: Callback, distributed: bool | None = None, **kwargs) -> Trainer:
    strategy = AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=distributed)
    defaults = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    return Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, callbacks=list(callbacks), **defaults | kwargs
    )


def _model() -> GPT:
    torch.manual_seed(0)
    return tiny_gpt(n_layer=2, n_embd=8, optimizer=make_optimizer("corrected_muon"))


def _data():
    return loader(random_batches(STEPS))


@pytest.fixture(scope="module")
def straight():
    """STEPS steps without interruption: (losses, final weights)."""
    recorder = LossRecorder()
    module = _model()
    _trainer(STEPS, recorder).fit(module, _data())
    return recorder.losses, module.state_dict()


def _saved(path, steps: int = STEPS // 2, distributed: bool | None = None) -> GPT:
    module = _model()
    trainer = _trainer(steps, distributed=distributed)
    trainer.fit(module, _data())
    trainer.save_checkpoint(path)
    return module


def _resume(path, **fit) -> tuple[list[float], dict]:
    recorder = LossRecorder()
    module = _model()
    _trainer(STEPS, recorder).fit(module, _data(), ckpt_path=str(path), **fit)
    return recorder.losses, module.state_dict()


def _assert_continues(straight, resumed) -> None:
    (losses, weights), (resumed_losses, resumed_weights) = straight, resumed
    assert resumed_losses == losses[STEPS // 2 :]
    for name, value in weights.items():
        assert torch.equal(resumed_weights[name], value), name


def test_one_process_writes_lightnings_single_file(tmp_path):
    path = tmp_path / "model.ckpt"
    module = _saved(path)
    assert os.path.isfile(path)
    checkpoint = torch.load(path)  # torch's default, weights_only=True
    assert checkpoint["global_step"] == STEPS // 2
    assert {"state_dict", "optimizer_states", "lr_schedulers", "loops", "hyper_parameters"} <= set(checkpoint)
    (optimizer_state,) = checkpoint["optimizer_states"]
    positions = [i for group in optimizer_state["param_groups"] for i in group["params"]]
    assert positions == list(range(len(list(module.parameters()))))  # Lightning's: optimizer.state_dict()
    record = checkpoint["async_pp"]
    trainable = [n for n, p in module.named_parameters()]
    assert sorted(record["previous"]) == sorted(trainable)  # 2BW's w[t-1]
    assert sum(record["optimizer_names"], []) and set(sum(record["optimizer_names"], [])) == set(trainable)
    assert set(record["rng"]) == {0}
    loaded = GPT.load_from_checkpoint(path, optimizer=None)
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert any(not torch.equal(record["previous"][n], p) for n, p in module.named_parameters())


def test_resume_from_the_file_continues_the_exact_trajectory(tmp_path, straight):
    _saved(tmp_path / "model.ckpt")
    _assert_continues(straight, _resume(tmp_path / "model.ckpt"))


def test_a_file_gathered_from_shards_continues_the_exact_trajectory(tmp_path, straight):
    """What rank 0 writes on several processes (``save_distributed_checkpoint=False``), read on one, by name."""
    module = _saved(tmp_path / "shards", distributed=True)
    meta = torch.load(tmp_path / "shards" / "meta.pt", weights_only=True)
    gathered = single_file_checkpoint(meta, read_entries(tmp_path / "shards"), list(module.state_dict()))
    assert gathered["async_pp"]["gathered"] is True
    torch.save(gathered, tmp_path / "gathered.ckpt")
    _assert_continues(straight, _resume(tmp_path / "gathered.ckpt"))


def test_model_checkpoint_keeps_files(tmp_path):
    """monitor + save_top_k=2 + save_last: files, the best two kept, `best_model_path` loads, "last" resumes."""
    checkpoints = ModelCheckpoint(
        dirpath=tmp_path, monitor="train/loss", save_top_k=2, save_last=True, every_n_train_steps=1
    )
    trainer = _trainer(STEPS // 2, checkpoints, enable_checkpointing=True)
    trainer.fit(_model(), _data())
    kept = sorted(os.path.basename(p) for p in checkpoints.best_k_models)
    assert len(kept) == 2 and sorted(os.listdir(tmp_path)) == sorted([*kept, "last.ckpt"])
    assert all(os.path.isfile(tmp_path / name) for name in os.listdir(tmp_path))
    best = GPT.load_from_checkpoint(checkpoints.best_model_path, optimizer=None)
    assert torch.equal(
        best.state_dict()["layers.0.tok.weight"],
        torch.load(checkpoints.best_model_path)["state_dict"]["layers.0.tok.weight"],
    )
    resumed = _trainer(STEPS)
    resumed.fit(_model(), _data(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert resumed.global_step == STEPS


def _with_new_head(strict: bool) -> GPT:
    module = _model()
    module.new_head = nn.Linear(4, 4)  # not in the checkpoint
    module.strict_loading = strict
    return module


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_strict_loading_false_loads_what_matches(tmp_path, distributed):
    saved = _saved(tmp_path / "model.ckpt", distributed=distributed)
    refused = ValueError if distributed else RuntimeError  # the file is Lightning's own load_state_dict
    with pytest.raises(refused, match="strict_loading = False|Missing key"):
        _trainer(STEPS).validate(
            _with_new_head(True), loader(random_batches(1)), ckpt_path=str(tmp_path / "model.ckpt")
        )
    module = _with_new_head(False)
    head = module.new_head.weight.clone()
    _trainer(STEPS).validate(module, loader(random_batches(1)), ckpt_path=str(tmp_path / "model.ckpt"))
    assert torch.equal(module.new_head.weight, head)
    for name, value in saved.state_dict().items():
        assert torch.equal(module.state_dict()[name], value), name


def test_fine_tuning_a_new_head_resumes_with_strict_loading_false(tmp_path, straight):
    """Resuming `fit` with a module the checkpoint lacks (unused here): the rest of the training state comes back by
    name, and the other weights continue the uninterrupted run exactly."""
    _saved(tmp_path / "model.ckpt", distributed=True)
    module = _with_new_head(False)
    trainer = _trainer(STEPS)
    trainer.fit(module, _data(), ckpt_path=str(tmp_path / "model.ckpt"))
    assert trainer.global_step == STEPS
    for name, value in straight[1].items():
        assert torch.equal(module.state_dict()[name], value), name


class Opaque:
    """A class ``torch.load(weights_only=True)`` refuses."""

    def __init__(self, value: int = 0) -> None:
        self.value = value


class OpaqueState(Callback):
    def __init__(self) -> None:
        self.restored: Opaque | None = None

    def state_dict(self):
        return {"opaque": Opaque(7)}

    def load_state_dict(self, state_dict) -> None:
        self.restored = state_dict["opaque"]


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_weights_only_false_is_honoured(tmp_path, distributed):
    module = _model()
    trainer = _trainer(2, OpaqueState(), distributed=distributed)
    trainer.fit(module, _data())
    trainer.save_checkpoint(tmp_path / "model.ckpt")
    with pytest.raises(RuntimeError, match=r"weights_only=True.*Opaque.*pass weights_only=False.*ckpt_path=\.\.\."):
        _trainer(3, OpaqueState()).fit(_model(), _data(), ckpt_path=str(tmp_path / "model.ckpt"))
    callback = OpaqueState()
    trainer = _trainer(3, callback)
    trainer.fit(_model(), _data(), ckpt_path=str(tmp_path / "model.ckpt"), weights_only=False)
    assert trainer.global_step == 3 and callback.restored.value == 7


def test_single_file_to_an_fsspec_url(tmp_path):
    url = "memory://checkpoints/model.ckpt"
    _saved(url, steps=1)
    resumed = _trainer(2)
    resumed.fit(_model(), _data(), ckpt_path=url)
    assert resumed.global_step == 2


class Order(Callback):
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def load_state_dict(self, state_dict) -> None:
        self.events.append("callback state restored")

    def state_dict(self):
        return {"saved": True}

    def on_fit_start(self, trainer, pl_module) -> None:
        self.events.append("on_fit_start")


class OrderedGPT(GPT):
    def __init__(self, events: list[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.events = events

    def on_load_checkpoint(self, checkpoint) -> None:
        self.events.append("on_load_checkpoint")

    def configure_optimizers(self):
        self.events.append("configure_optimizers")
        return super().configure_optimizers()


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_restoring_runs_in_lightnings_order(tmp_path, distributed):
    """`on_load_checkpoint` before `configure_optimizers`, callback state before `on_fit_start`: the order of
    Lightning's own single-device strategy (on a checkpoint it wrote)."""

    def trainer(strategy, steps: int, seen: list[str]) -> Trainer:
        return Trainer(
            accelerator="cpu",
            devices=1,
            strategy=strategy,
            max_steps=steps,
            callbacks=[Order(seen)],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )

    def events(strategy, path) -> list[str]:
        seen: list[str] = []
        trainer(strategy, 2, seen).fit(OrderedGPT(seen, **SMALL), loader(random_batches(2)), ckpt_path=str(path))
        return seen

    for name, strategy in [
        ("ours.ckpt", AsyncPipelineStrategy(num_microbatches=1, save_distributed_checkpoint=distributed)),
        ("lightning.ckpt", "auto"),
    ]:
        saving = trainer(strategy, 1, [])
        saving.fit(OrderedGPT([], **SMALL), loader(random_batches(1)))
        saving.save_checkpoint(tmp_path / name)
    ours = events(AsyncPipelineStrategy(num_microbatches=1), tmp_path / "ours.ckpt")
    assert ours == events("auto", tmp_path / "lightning.ckpt")
    assert ours == ["on_load_checkpoint", "callback state restored", "configure_optimizers", "on_fit_start"]


def test_a_tied_copy_reads_the_file_under_the_first_name():
    """A file written on one device (the tied weight once, as ``layers.0.table.weight``), read by a stage that holds
    only the head: the head's copy gets the optimizer state and ``w[t-1]`` of the embedding's name."""
    from lightning_async_pp import checkpoint as sharded
    from lightning_async_pp.checkpoint.layout import restore_stage
    from lightning_async_pp.checkpoint.single_file import sharded_entries
    from lightning_async_pp.strategy.placement import keep_only_layers
    from tests.multiprocess.scripts.toy_run import ToyLM

    whole = ToyLM(tie_embedding=True)
    aliases = sharded.parameter_aliases(whole)
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for p in whole.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    previous = {n: p.detach() - 1 for n, p in whole.named_parameters()}
    names = [[n for n, _ in whole.named_parameters()]]
    record = {"schedule": "2bw", "optimizer_names": names, "previous": previous, "rng": {}}
    entries = sharded_entries(
        {"state_dict": whole.state_dict(), "optimizer_states": [optimizer.state_dict()], "async_pp": record}
    )

    stage = ToyLM(tie_embedding=True)
    keep_only_layers(stage, list(stage.pipeline_layers()), range(3, 5), [0, 0, 0, 1, 1])
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=0.1)
    stage_previous = {n: torch.zeros_like(p) for n, p in stage.named_parameters()}
    restore_stage(
        entries,
        state_dict=stage.state_dict(),
        module=stage,
        optimizer=stage_optimizer,
        previous=stage_previous,
        stage=1,
        aliases=aliases,
    )
    assert_tied_head_restored(whole, stage, optimizer, stage_optimizer, previous, stage_previous)
