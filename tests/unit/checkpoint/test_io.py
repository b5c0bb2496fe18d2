"""Sharded checkpoints on one device (``save_distributed_checkpoint=True``) and on stages: format, safety,
Lightning's checkpoint features. The single-file form: tests/unit/checkpoint/test_single_file.py."""

from __future__ import annotations

import signal
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint import read_index
from tests.fixtures.helpers import fit, loader, random_batches, run_group, run_script, tiny_gpt
from tests.multiprocess.scripts.pipeline_run import make_optimizer
from tests.multiprocess.test_pipeline_exactness import TIMEOUT, run_pipeline


def _keys(path) -> set[str]:
    return set(read_index(path).state_dict_metadata)


def _single_device_checkpoint(tmp_path, *, weights_only=False, optimizer="corrected_muon", steps=3, **model):
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=True),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = tiny_gpt(n_layer=4, optimizer=make_optimizer(optimizer), **model)
    trainer.fit(module, loader(random_batches(steps)))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path, weights_only=weights_only)
    return path, module


def test_checkpoint_is_a_directory_of_named_shards(tmp_path):
    path, module = _single_device_checkpoint(tmp_path)
    keys = _keys(path)
    params = [n for n, _ in module.named_parameters()]
    assert {f"state_dict.{n}" for n in module.state_dict()} <= keys
    assert {f"previous.{n}" for n in params} <= keys  # 2BW's w[t-1]
    # DelayCorrected(Muon): Muon momentum, AdamW moments and the correction's previous update, by name.
    assert "optimizer.state.layers.1.attn.qkv.weight.momentum_buffer" in keys
    assert "optimizer.state.layers.0.tok.weight.exp_avg" in keys
    assert {f"optimizer.state.{n}.previous_update" for n in params} <= keys
    assert "rng.stage0" in keys
    meta = torch.load(path / "meta.pt", weights_only=True)
    assert "state_dict" not in meta and "optimizer_states" not in meta
    assert meta["async_pp"]["schedule"] == "2bw" and meta["async_pp"]["version"] == 3
    assert meta["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 3


def test_weights_only_checkpoint_holds_no_optimizer_state(tmp_path):
    path, module = _single_device_checkpoint(tmp_path, weights_only=True)
    keys = _keys(path)
    assert keys == {f"state_dict.{n}" for n in module.state_dict()}
    assert "lr_schedulers" not in torch.load(path / "meta.pt", weights_only=True)


def test_other_schedule_is_refused(tmp_path):
    path, _ = _single_device_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"schedule='2bw' run; this run uses schedule='1f1b'.*schedule='2bw'"):
        fit(
            tiny_gpt(n_layer=4),
            random_batches(4),
            strategy=AsyncPipelineStrategy(schedule="1f1b", num_microbatches=2),
            ckpt_path=str(path),
        )


def test_other_model_is_refused(tmp_path):
    path, _ = _single_device_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"another model.*missing from the checkpoint: \['layers.5.*other shapes"):
        fit(
            tiny_gpt(n_layer=5, n_embd=48),
            random_batches(4),
            strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(path),
        )


def test_damaged_shard_is_named(tmp_path):
    path, _ = _single_device_checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(RuntimeError, match=r"shard .*__0_0\.distcp is truncated"):
        fit(
            tiny_gpt(n_layer=4),
            random_batches(4),
            strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(path),
        )


def test_corrupt_shard_content_is_named(tmp_path):
    path, _ = _single_device_checkpoint(tmp_path)
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[:4096] = bytes(4096)  # same size, the first records overwritten
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"__0_0\.distcp.*damaged"):
        fit(
            tiny_gpt(n_layer=4, optimizer=make_optimizer("corrected_muon")),
            random_batches(4),
            strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(path),
        )


@pytest.mark.parametrize("resume", ["path", "hpc"])
def test_crafted_index_is_not_unpickled_on_resume(tmp_path, resume):
    """A checkpoint folder whose index calls os.system through a dotted name, given as ``ckpt_path`` or planted
    where SLURM's auto-resume looks (``hpc_ckpt_1.ckpt`` in the root folder, ``ckpt_path="hpc"``)."""
    from tests.unit.checkpoint.test_safe import _crafted

    path = tmp_path / "hpc_ckpt_1.ckpt"
    path.mkdir()
    torch.save({}, path / "meta.pt")
    (path / ".metadata").write_bytes(_crafted(tmp_path / "pwned")["dotted-filesystem-os"])
    refused = r"Refused to read the checkpoint .*hpc_ckpt_1\.ckpt.*refers to .*os\.system"
    with pytest.raises(RuntimeError, match=refused):
        fit(
            tiny_gpt(n_layer=4),
            random_batches(4),
            strategy=AsyncPipelineStrategy(num_microbatches=2),
            ckpt_path=str(path) if resume == "path" else "hpc",
            default_root_dir=tmp_path,
        )
    assert not (tmp_path / "pwned").exists()


def test_failed_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A save that fails midway leaves the previous checkpoint at its name, untouched."""
    path, module = _single_device_checkpoint(tmp_path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    from torch.distributed.checkpoint import FileSystemWriter

    def failing_write(self, plan, planner):
        raise OSError("disk full")

    monkeypatch.setattr(FileSystemWriter, "write_data", failing_write)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=True),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(tiny_gpt(n_layer=4), loader(random_batches(1)))
    with pytest.raises(Exception, match="disk full"):
        trainer.save_checkpoint(path)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import torch
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint import FileSystemWriter
    from tests.fixtures.helpers import loader, random_batches, tiny_gpt
    from lightning_async_pp import AsyncPipelineStrategy

    torch.set_num_threads(1)
    kill_at = int(sys.argv[2])
    write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        future = write(self, plan, planner)
        if trainer.global_step >= kill_at:  # the shard is on disk, the checkpoint not yet complete
            os.kill(os.getpid(), signal.SIGKILL)
        return future

    FileSystemWriter.write_data = write_then_die
    checkpoints = ModelCheckpoint(dirpath=sys.argv[1], every_n_train_steps=2, save_last=True, save_top_k=-1)
    strategy = AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=True)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6,
                      logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[checkpoints])
    trainer.fit(tiny_gpt(n_layer=4), loader(random_batches(6)))
""")


def test_save_killed_midway_is_never_last(tmp_path):
    """A process killed while writing `last.ckpt` leaves the previous `last.ckpt` complete, and `ckpt_path="last"`
    resumes from it."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SAVE)
    directory = tmp_path / "checkpoints"
    result = run_group([sys.executable, script, directory, "4"], TIMEOUT)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    names = sorted(p.name for p in directory.iterdir())
    # step 4's save was killed after its shard was written: no `step=4` checkpoint, `last` is still step 2's.
    assert "epoch=0-step=2.ckpt" in names and not any("step=4" in n and not n.startswith(".") for n in names)
    assert torch.load(directory / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 2
    assert any(n.startswith(".") and n.endswith(".partial") for n in names)

    checkpoints = ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_last=True, save_top_k=-1)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AsyncPipelineStrategy(num_microbatches=2, save_distributed_checkpoint=True),
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoints],
    )
    starts = []
    from lightning.pytorch import Callback

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer, *args):
            starts.append(trainer.global_step)

    trainer.callbacks.append(FirstStep())
    trainer.fit(tiny_gpt(n_layer=4), loader(random_batches(6)), ckpt_path="last")
    assert starts[0] == 2
    names = sorted(p.name for p in directory.iterdir())
    assert not any(n.endswith(".partial") for n in names)  # the next save to that name cleaned up
    assert torch.load(directory / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 6


@pytest.mark.slow
@pytest.mark.multiprocess
def test_consolidated_checkpoint_gives_the_same_validation_loss(tmp_path):
    """2 stages save; `python -m lightning_async_pp consolidate` writes one file; one device validates it."""
    result, weights = run_pipeline(tmp_path / "run", 2, "2bw", 2, 4, "corrected_muon", "--save-checkpoint")
    out = tmp_path / "model.ckpt"
    command = [
        sys.executable,
        "-m",
        "lightning_async_pp",
        "consolidate",
        str(tmp_path / "run" / "final.ckpt"),
        str(out),
    ]
    done = run_group(command, TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    consolidated = torch.load(out, weights_only=True)
    assert "optimizer_states" not in consolidated and consolidated["global_step"] == 4
    assert sorted(consolidated["state_dict"]) == sorted(weights)
    for name, value in weights.items():  # what each stage held at the end of training
        assert torch.equal(consolidated["state_dict"][name], value), name

    def validation_loss(**load):
        model = tiny_gpt(n_layer=4)
        trainer = Trainer(
            accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False
        )
        if "state_dict" in load:
            model.load_state_dict(load["state_dict"])
            return trainer.validate(model, loader(random_batches(3, seed=7)), verbose=False)[0]["val/loss"]
        return trainer.validate(model, loader(random_batches(3, seed=7)), verbose=False, **load)[0]["val/loss"]

    from_file = validation_loss(ckpt_path=str(out))
    from_stages = validation_loss(state_dict=weights)
    untrained = validation_loss(state_dict=tiny_gpt(n_layer=4).state_dict())
    assert from_file == from_stages and abs(from_file - untrained) > 1e-3


def _checkpoint_run(out, *extra, devices=2):
    command = [
        sys.executable,
        "-m",
        "tests.multiprocess.scripts.checkpoint_run",
        "--devices",
        str(devices),
        "--out",
        str(out),
        *extra,
    ]
    returncode, output = run_script(command, TIMEOUT)
    assert returncode == 0, output[-6000:]
    import json

    weights = {}
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return json.loads((out / "result.json").read_text()), weights


@pytest.mark.parametrize(
    "io",
    [
        pytest.param((), id="sync"),
        pytest.param(("--async-io",), id="lightning-AsyncCheckpointIO", marks=pytest.mark.slow),
        pytest.param(("--dcp-async",), id="dcp-async_save", marks=pytest.mark.slow),
    ],
)
@pytest.mark.multiprocess
def test_model_checkpoint_keeps_the_top_two_on_two_stages(tmp_path, io):
    """monitor + save_top_k=2 + save_last on 2 stages: the two best remain, complete; `last` is the final state."""
    from lightning_async_pp.checkpoint import read_tensors

    result, weights = _checkpoint_run(tmp_path, *io)
    # scores at steps 2, 4, 6, 8, 10: 3.0, 1.0, 2.0, 0.5, 4.0 -> the two lowest are steps 8 and 4
    assert result["best_k_models"] == {"step=8.ckpt": 0.5, "step=4.ckpt": 1.0}
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    for name in ("step=4.ckpt", "step=8.ckpt"):
        meta = torch.load(directory / name / "meta.pt", weights_only=True)
        assert meta["global_step"] == int(name[5]) and meta["async_pp"]["num_stages"] == 2
        assert sorted(p.name for p in (directory / name).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # The last validation ran at step 8 (fit stops at max_steps=10 before the next): `last` is step 8's state.
    assert torch.load(directory / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 8
    last, best = read_tensors(directory / "last.ckpt"), read_tensors(directory / "step=8.ckpt")
    assert {f"state_dict.{n}" for n in weights} | {f"previous.{n}" for n in weights} <= set(last)
    assert sorted(last) == sorted(best) and all(torch.equal(last[k], best[k]) for k in best)
    assert any(not torch.equal(last[f"state_dict.{n}"], weights[n]) for n in weights)  # 2 more steps trained


@pytest.mark.multiprocess
def test_model_checkpoint_keeps_the_top_two_files_of_two_stages(tmp_path):
    """save_distributed_checkpoint=False on 2 stages: the same top two and `last`, each one file that loads on one
    device with `load_from_checkpoint` and holds what the stages held."""
    from lightning_async_pp.demos import GPT

    result, weights = _checkpoint_run(tmp_path, "--single-file")
    assert result["best_k_models"] == {"step=8.ckpt": 0.5, "step=4.ckpt": 1.0}
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["last.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert all((directory / name).is_file() for name in ("last.ckpt", "step=4.ckpt", "step=8.ckpt"))
    best = GPT.load_from_checkpoint(directory / result["best_model_path"])
    last = torch.load(directory / "last.ckpt")
    assert last["global_step"] == 8 and sorted(last["async_pp"]["rng"]) == [0, 1]
    for name, value in best.state_dict().items():
        assert torch.equal(value, last["state_dict"][name]), name  # step 8 is both the best and the last
    assert any(not torch.equal(last["state_dict"][n], weights[n]) for n in weights)  # 2 more steps trained
