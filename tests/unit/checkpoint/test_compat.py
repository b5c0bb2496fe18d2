"""What `check_checkpoint_path` lets through: both torch.save formats, sharded directories and Lightning's names."""

from __future__ import annotations

import pytest
import torch

from lightning_async_pp.checkpoint.compat import check_checkpoint_path


def test_torch_save_files_sharded_directories_and_lightnings_names_pass(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "zip.ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "sharded.ckpt").mkdir()
    (tmp_path / "sharded.ckpt" / ".metadata").write_bytes(b"")  # the index: its content is the loader's to check
    for name in ("zip.ckpt", "legacy.ckpt", "sharded.ckpt"):
        check_checkpoint_path(tmp_path / name)
    for name in ("last", "best", "hpc", "registry", "registry:model:v1", "s3://bucket/model.ckpt"):
        check_checkpoint_path(name)  # Lightning resolves these in every process


def test_a_missing_path_and_a_directory_without_an_index_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.ckpt' does not exist"):
        check_checkpoint_path(tmp_path / "missing.ckpt")
    (tmp_path / "logs").mkdir()
    with pytest.raises(ValueError, match=r"logs' is a directory without `\.metadata`.*meta\.pt"):
        check_checkpoint_path(tmp_path / "logs")


@pytest.mark.parametrize("content", [b"", b"hello\n", b'{"json": 1}'])
def test_other_files_are_refused_with_what_a_checkpoint_looks_like(tmp_path, content):
    path = tmp_path / "model.ckpt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.ckpt.*not a checkpoint.*\.metadata.*consolidate"):
        check_checkpoint_path(path)


def test_a_zip_that_torch_did_not_write_is_refused(tmp_path):
    import zipfile

    path = tmp_path / "archive.zip"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")
    with pytest.raises(ValueError, match="not a checkpoint"):
        check_checkpoint_path(path)
