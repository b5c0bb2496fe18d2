"""Removing a checkpoint deletes only a checkpoint in a ModelCheckpoint's folder, whatever path it is given."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint import ShardedCheckpointIO
from lightning_async_pp.checkpoint.layout import SHARD_KEY
from tests.fixtures.helpers import loader, random_batches, tiny_gpt


def _save(io: ShardedCheckpointIO, path) -> None:
    io.save_checkpoint({SHARD_KEY: True, "shard": {"w": torch.ones(2)}, "meta": {"global_step": 1}}, path)


def _tree(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.fixture
def layout(tmp_path):
    """``run/checkpoints`` (ModelCheckpoint's folder for ``io``) and, outside it, a checkpoint of another run and a
    data folder."""
    io = ShardedCheckpointIO()
    checkpoints = tmp_path / "run" / "checkpoints"
    io.setup(None, [str(checkpoints)])
    _save(io, checkpoints / "a.ckpt")
    outside = tmp_path / "outside"
    _save(ShardedCheckpointIO(), outside / "victim.ckpt")
    (outside / "data").mkdir()
    (outside / "data" / "keep.txt").write_text("keep")
    return io, checkpoints, outside


def test_removes_checkpoints_it_saved_beside(layout):
    io, checkpoints, _ = layout
    _save(io, checkpoints / "b.ckpt")
    torch.save({"x": 1}, checkpoints / "c.ckpt")  # a single-file checkpoint
    io.remove_checkpoint(checkpoints / "a.ckpt")
    io.remove_checkpoint(str(checkpoints / "c.ckpt"))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["b.ckpt"]


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("dotdot-checkpoint", "outside the ModelCheckpoint folders of this run"),
        ("dotdot-folder", "outside the ModelCheckpoint folders of this run"),
        ("dotdot-data", "outside the ModelCheckpoint folders of this run"),
        ("absolute", "outside the ModelCheckpoint folders of this run"),
        ("link-to-folder", "outside the ModelCheckpoint folders of this run"),
        ("folder-not-checkpoint", "is not a checkpoint"),
        ("file-not-checkpoint", "is not a torch.save file"),
        ("link-in-other-folder", "which is no ModelCheckpoint's folder"),
    ],
)
def test_refuses_what_is_not_its_checkpoint(layout, tmp_path, case, reason):
    io, checkpoints, outside = layout
    (checkpoints / "notes").mkdir()
    (checkpoints / "notes" / "n.txt").write_text("n")
    (checkpoints / "notes.txt").write_text("n")
    (outside / "link.ckpt").symlink_to(checkpoints / "a.ckpt")
    (checkpoints / "parent").symlink_to(checkpoints.parent)  # a link whose target's parent is not a saved folder
    path = {
        "dotdot-checkpoint": checkpoints / ".." / ".." / "outside" / "victim.ckpt",
        "dotdot-folder": checkpoints / ".." / "..",  # `<dirpath>/../..` passes Lightning's lexical check
        "dotdot-data": checkpoints / ".." / ".." / "outside" / "data",
        "absolute": outside / "victim.ckpt",
        "link-to-folder": checkpoints / "parent" / "checkpoints" / ".." / ".." / "outside",
        "folder-not-checkpoint": checkpoints / "notes",
        "file-not-checkpoint": checkpoints / "notes.txt",
        "link-in-other-folder": checkpoints / ".." / ".." / "outside" / "link.ckpt",
    }[case]
    before = _tree(tmp_path)
    with pytest.warns(UserWarning, match=f"Did not remove {re.escape(str(path))}: .*{reason}"):
        io.remove_checkpoint(path)
    assert _tree(tmp_path) == before


def test_link_in_its_folder_is_removed_not_its_target(layout):
    """``save_last="link"`` leaves links; removing one deletes the link, never what it points to."""
    io, checkpoints, outside = layout
    (checkpoints / "last.ckpt").symlink_to(outside / "victim.ckpt")
    (checkpoints / "data.ckpt").symlink_to(outside / "data")
    before = _tree(outside)
    io.remove_checkpoint(checkpoints / "last.ckpt")
    io.remove_checkpoint(checkpoints / "data.ckpt")
    assert sorted(p.name for p in checkpoints.iterdir()) == ["a.ckpt"]
    assert _tree(outside) == before


def _trainer(checkpoints, steps: int, distributed: bool, *callbacks: Callback) -> Trainer:
    return Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=distributed),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=1), *callbacks],
    )


def _resume_naming(checkpoints, distributed: bool, path) -> Path:
    """A checkpoint of a 2-step run whose ModelCheckpoint state names ``path`` as its best (next to be removed)."""
    _trainer(checkpoints, 2, distributed).fit(tiny_gpt(), loader(random_batches(2)))
    resume = checkpoints / "epoch=0-step=2.ckpt"
    meta_file = resume / "meta.pt" if distributed else resume
    meta = torch.load(meta_file, weights_only=True)
    (key,) = [k for k in meta["callbacks"] if k.startswith("ModelCheckpoint")]
    meta["callbacks"][key]["best_model_path"] = str(path)
    torch.save(meta, meta_file)
    return resume


class _SaveACopy(Callback):
    """What a user may add: a copy of the run's first state kept in a folder of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_start(self, trainer: Trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_a_checkpoint_saved_by_save_checkpoint_elsewhere_is_never_removed(tmp_path, distributed):
    """The run saved ``kept/copy.ckpt`` itself (``trainer.save_checkpoint``), but only ModelCheckpoint's folder is
    one old checkpoints are removed from: a resumed state that names the copy leaves it in place."""
    checkpoints, copy = tmp_path / "checkpoints", tmp_path / "kept" / "copy.ckpt"
    resume = _resume_naming(checkpoints, distributed, checkpoints / ".." / "kept" / "copy.ckpt")

    trainer = _trainer(checkpoints, 3, distributed, _SaveACopy(copy))
    with pytest.warns(UserWarning, match="Did not remove .*copy.ckpt: it is .*outside the ModelCheckpoint"):
        trainer.fit(tiny_gpt(), loader(random_batches(3)), ckpt_path=str(resume))
    assert (copy / "meta.pt").is_file() if distributed else copy.is_file()
    # The first run's top-k removal of step 1 went through (step 2, resumed from, is no longer tracked).
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=1-step=3.ckpt"]


@pytest.mark.parametrize("distributed", [True, False], ids=["directory", "file"])
def test_crafted_checkpoint_cannot_make_a_resume_delete_outside(tmp_path, distributed):
    """A checkpoint whose ModelCheckpoint state names `<dirpath>/../victim.ckpt`, resumed: that folder stays."""
    checkpoints = tmp_path / "checkpoints"
    _trainer(checkpoints, 2, distributed).fit(tiny_gpt(), loader(random_batches(2)))
    resume = checkpoints / "epoch=0-step=2.ckpt"
    victim = tmp_path / "victim.ckpt"
    _save(ShardedCheckpointIO(), victim)  # even a checkpoint of this strategy, outside the folder
    meta_file = resume / "meta.pt" if distributed else resume
    meta = torch.load(meta_file, weights_only=True)
    (key,) = [k for k in meta["callbacks"] if k.startswith("ModelCheckpoint")]
    meta["callbacks"][key]["best_model_path"] = str(checkpoints / ".." / "victim.ckpt")
    torch.save(meta, meta_file)
    before = _tree(victim)

    trainer = _trainer(checkpoints, 3, distributed)
    with pytest.warns(UserWarning, match="Did not remove .*victim.ckpt: it is .*outside the ModelCheckpoint"):
        trainer.fit(tiny_gpt(), loader(random_batches(3)), ckpt_path=str(resume))
    assert _tree(victim) == before
    saved = checkpoints / "epoch=1-step=3.ckpt"
    assert (saved / "meta.pt").is_file() if distributed else saved.is_file()  # the resumed run saved on


def test_a_url_is_removed_only_in_a_model_checkpoint_folder():
    """One process writes single files to fsspec URLs: removal takes one the run saved in ModelCheckpoint's folder,
    and refuses one it saved elsewhere."""
    fsspec = pytest.importorskip("fsspec")
    io = ShardedCheckpointIO()
    io.setup(None, ["memory://removal/checkpoints/"])
    kept, old = "memory://removal/kept/copy.ckpt", "memory://removal/checkpoints/old.ckpt"
    for url in (kept, old):
        io.save_checkpoint({"x": torch.ones(1)}, url)
    io.remove_checkpoint(old)
    with pytest.warns(UserWarning, match="Did not remove memory://removal/kept/copy.ckpt: this run did not save it"):
        io.remove_checkpoint(kept)
    memory = fsspec.filesystem("memory")
    assert memory.exists("/removal/kept/copy.ckpt") and not memory.exists("/removal/checkpoints/old.ckpt")
    memory.rm("/removal", recursive=True)
