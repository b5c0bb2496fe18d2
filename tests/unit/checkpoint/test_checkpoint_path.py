"""What `check_checkpoint_path` lets through: both torch.save formats, directories and missing paths."""

from __future__ import annotations

import pytest
import torch

from lightning_async_pp.checkpoint.compat import check_checkpoint_path


def test_torch_save_files_directories_and_missing_paths_pass(tmp_path):
    torch.save({"state_dict": {"w": torch.ones(2)}}, tmp_path / "zip.ckpt")
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "sharded.ckpt").mkdir()
    for name in ("zip.ckpt", "legacy.ckpt", "sharded.ckpt", "missing.ckpt"):
        check_checkpoint_path(tmp_path / name)


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
