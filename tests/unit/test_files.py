"""Write-then-rename: a unique temporary file, flushed to disk before the rename, its folder after."""

from __future__ import annotations

import os

import pytest

from lightning_async_pp import files
from lightning_async_pp.files import atomic_path, atomic_write_text


def test_two_writers_of_one_path_write_separate_files(tmp_path):
    target = tmp_path / "out.json"
    with atomic_path(target) as first, atomic_path(target) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_text("first")
        second.write_text("second")
    assert target.read_text() == "first"  # the outer block ends last: its file is renamed last
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_file_is_flushed_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def recording_replace(source, target):
        events.append(("replace", os.stat(source).st_ino))
        replace(source, target)

    monkeypatch.setattr(files.os, "fsync", recording_fsync)
    monkeypatch.setattr(files.os, "replace", recording_replace)
    atomic_write_text(tmp_path / "a.txt", "text")
    written, folder = (tmp_path / "a.txt").stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", written), ("replace", written), ("fsync", folder)]


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_text("previous")
    with pytest.raises(RuntimeError, match="midway"), atomic_path(target) as temporary:
        temporary.write_text("partial")
        raise RuntimeError("midway")
    assert target.read_text() == "previous" and [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_the_file_gets_the_permissions_of_any_new_file(tmp_path):
    (tmp_path / "plain").write_text("x")
    atomic_write_text(tmp_path / "atomic", "x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_atomic_file_writes_through_the_file_it_created(tmp_path):
    """The temporary name replaced by a link meanwhile: the content still goes into the file created, and the
    link's target is untouched (a write by name would follow the link)."""
    from lightning_async_pp.files import atomic_file

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    target = tmp_path / "out.bin"
    with atomic_file(target) as file:
        temporary = next(p for p in tmp_path.iterdir() if p.name.endswith(".partial"))
        moved = tmp_path / "moved"
        os.rename(temporary, moved)
        os.symlink(victim, temporary)
        file.write(b"content")
        file.flush()
        os.unlink(temporary)
        os.rename(moved, temporary)
    assert target.read_bytes() == b"content" and victim.read_text() == "untouched"
