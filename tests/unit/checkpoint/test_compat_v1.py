"""A checkpoint written by an earlier release (format version 1, one stage, 2BW) loads and continues training.

The checkpoint is ``tests/fixtures/checkpoints/v1_p1_2bw.tar.gz``; ``write_v1_p1_2bw.py`` next to it says which
commit wrote it and builds the same model, data and trainer.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import torch
from lightning.pytorch import Callback

from lightning_async_pp.checkpoint import FORMAT_VERSION, read_index, read_tensors
from tests.fixtures.checkpoints.write_v1_p1_2bw import STEPS, batches, model, trainer

ARCHIVE = Path(__file__).resolve().parents[2] / "fixtures" / "checkpoints" / "v1_p1_2bw.tar.gz"


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _saved(tmp_path: Path) -> Path:
    with tarfile.open(ARCHIVE) as archive:
        archive.extractall(tmp_path, filter="data")
    return tmp_path / "v1_p1_2bw"


def _layout(path: Path) -> tuple[list[str], dict[str, tuple], dict]:
    index = read_index(path).state_dict_metadata
    shapes = {key: tuple(getattr(md, "size", ())) for key, md in index.items()}
    info = torch.load(path / "meta.pt", weights_only=True)["async_pp"]
    return sorted(f.name for f in path.iterdir()), shapes, info


def test_a_version_1_checkpoint_has_the_format_written_today(tmp_path):
    saved = _saved(tmp_path / "old")
    torch.manual_seed(0)
    fitted = trainer(STEPS)
    fitted.strategy.save_distributed_checkpoint = True  # the form of version 1 (one process now writes a file)
    fitted.fit(model(), batches(2 * STEPS))
    fitted.save_checkpoint(tmp_path / "new")
    old_files, old_shapes, old_info = _layout(saved)
    new_files, new_shapes, new_info = _layout(tmp_path / "new")
    assert old_info["format"] == new_info["format"] == FORMAT_VERSION == 1
    assert old_files == new_files == [".metadata", "__0_0.distcp", "meta.pt"]
    assert old_shapes == new_shapes
    assert old_info == new_info


def test_a_version_1_checkpoint_restores_its_weights_and_optimizer(tmp_path):
    saved = _saved(tmp_path)
    restored, module = trainer(STEPS), model()
    restored.fit(module, batches(2 * STEPS), ckpt_path=str(saved))
    assert restored.global_step == STEPS
    weights = read_tensors(saved, "state_dict.")
    assert sorted(weights) == sorted(f"state_dict.{name}" for name in module.state_dict())
    for name, value in module.state_dict().items():
        assert torch.equal(value, weights[f"state_dict.{name}"]), name
    moments = read_tensors(saved, "optimizer.state.")
    optimizer = restored.strategy.optimizers[0]
    for name, param in module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][key], moments[f"optimizer.state.{name}.{key}"]), (name, key)


def test_a_version_1_checkpoint_continues_training(tmp_path):
    saved = _saved(tmp_path)
    straight = _Losses()
    torch.manual_seed(0)
    trainer(2 * STEPS, callbacks=[straight]).fit(model(), batches(2 * STEPS))
    resumed = _Losses()
    continued = trainer(2 * STEPS, callbacks=[resumed])
    continued.fit(model(), batches(2 * STEPS), ckpt_path=str(saved))
    assert continued.global_step == 2 * STEPS and len(resumed.losses) == STEPS
    difference = max(abs(a - b) for a, b in zip(resumed.losses, straight.losses[STEPS:]))
    print(f"resumed from version 1 vs straight through: max loss difference {difference:.3g}")
    # Equal on the CPU that wrote the checkpoint; another CPU's float32 rounding may differ a little.
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(straight.losses[STEPS:]), rtol=1e-4, atol=1e-5
    )
