"""A crafted checkpoint index runs no code: only the classes DCP's index holds are unpickled."""

from __future__ import annotations

import pickle
import random
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata

from lightning_async_pp.checkpoint import read_index
from lightning_async_pp.checkpoint.safe import _INDEX_CLASSES
from lightning_async_pp.cli import main


def _text(s: str) -> bytes:
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _global(module: str, name: str) -> bytes:
    return _text(module) + _text(name) + pickle.STACK_GLOBAL


def _call(function: bytes, *args: str) -> bytes:
    return function + pickle.MARK + b"".join(_text(a) for a in args) + pickle.TUPLE + pickle.REDUCE


def _pickle(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


def _representative_state() -> dict:
    """What our checkpoints hold: tensors of several dtypes and layouts, and plain values in nested dicts."""
    return {
        "state_dict.w": torch.randn(3, 4),
        "state_dict.h": torch.zeros(2, dtype=torch.bfloat16),
        "state_dict.c": torch.ones(1, 2, 3, 4).to(memory_format=torch.channels_last),
        "optimizer.state.w.step": torch.tensor(3.0),
        "optimizer.param_groups.w": {"lr": 1e-3, "betas": (0.9, 0.95), "name": "adamw", "nesterov": True},
        "rng.stage0": {"torch": torch.get_rng_state(), "python": random.getstate(), "bytes": b"\x00\x01"},
    }


def _write_checkpoint(path, flatten: bool = False) -> None:
    dcp.save(
        _representative_state(),
        storage_writer=FileSystemWriter(path),
        planner=DefaultSavePlanner(flatten_state_dict=flatten, flatten_sharded_tensors=False),
        no_dist=True,
    )


class _Recorder(pickle.Unpickler):
    def __init__(self, file, seen: set) -> None:
        super().__init__(file)
        self.seen = seen

    def find_class(self, module: str, name: str):
        self.seen.add((module, name))
        return super().find_class(module, name)


def test_index_classes_are_the_classes_dcp_pickles(tmp_path):
    """The allow-list holds classes defined under their names, and covers what a real index pickles."""
    for (module, name), cls in _INDEX_CLASSES.items():
        assert isinstance(cls, type) and cls.__module__ == module and cls.__qualname__ == name
    seen: set = set()
    for flatten in (False, True):
        _write_checkpoint(tmp_path / str(flatten), flatten)
        with open(tmp_path / str(flatten) / ".metadata", "rb") as f:
            _Recorder(f, seen).load()
    dtypes = {("torch", str(d).removeprefix("torch.")) for d in (torch.float32, torch.bfloat16, torch.uint8)}
    layout = {("torch.serialization", "_get_layout")}
    paths = {("pathlib", "PosixPath")}
    assert seen - dtypes - layout - paths <= set(_INDEX_CLASSES)
    assert seen & set(_INDEX_CLASSES) >= {("torch.distributed.checkpoint.metadata", "Metadata")}


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_real_index_reads_as_pickle_reads_it(tmp_path, protocol):
    _write_checkpoint(tmp_path)
    index = tmp_path / ".metadata"
    expected = pickle.loads(index.read_bytes())
    index.write_bytes(pickle.dumps(expected, protocol=protocol))
    got = read_index(tmp_path)
    assert isinstance(got, Metadata)
    assert got.state_dict_metadata == expected.state_dict_metadata
    assert got.storage_data == expected.storage_data and got.planner_data == expected.planner_data
    assert str(got.storage_meta.checkpoint_id) == str(expected.storage_meta.checkpoint_id)


def _crafted(marker) -> dict[str, bytes]:
    command = f"touch {marker}"
    return {
        # pickle resolves dotted names inside an allowed module: os.system through DCP's own imports
        "dotted-filesystem-os": _pickle(
            _call(_global("torch.distributed.checkpoint.filesystem", "os.system"), command)
        ),
        "dotted-metadata-class": _pickle(
            _call(_global("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"))
        ),
        "dotted-torch-size": _pickle(_call(_global("torch", "Size.__class__.__subclasses__"))),
        "os": _pickle(_call(_global("os", "system"), command)),
        "posix": _pickle(_call(_global("posix", "system"), command)),
        "builtins-eval": _pickle(_call(_global("builtins", "eval"), f"__import__('os').system('{command}')")),
        "subprocess": _pickle(_call(_global("subprocess", "getoutput"), command)),
        "torch-not-a-dtype": _pickle(_call(_global("torch", "load"), str(marker))),
        "other-dcp-name": _pickle(_call(_global("torch.distributed.checkpoint.filesystem", "FileSystemReader"), "/")),
        # an allowed class given new class attributes: BUILD on the class itself, not an instance of it
        "build-on-a-class": _pickle(
            _global("torch.distributed.checkpoint.metadata", "Metadata")
            + pickle.NONE
            + pickle.EMPTY_DICT
            + _text("crafted")
            + pickle.NEWTRUE
            + pickle.SETITEM
            + pickle.TUPLE2
            + pickle.BUILD
        ),
        "not-an-index": _pickle(_call(_global("collections", "OrderedDict"))),
        "shard-outside": pickle.dumps(_metadata_with_shard("../../etc/passwd")),
    }


def _metadata_with_shard(name: str) -> Metadata:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return Metadata({}, storage_data={MetadataIndex("x"): _StorageInfo(name, 0, 1)})


@pytest.mark.parametrize(
    "case",
    [
        "dotted-filesystem-os",
        "dotted-metadata-class",
        "dotted-torch-size",
        "os",
        "posix",
        "builtins-eval",
        "subprocess",
        "torch-not-a-dtype",
        "other-dcp-name",
        "build-on-a-class",
        "not-an-index",
        "shard-outside",
    ],
)
def test_crafted_index_is_refused_and_runs_nothing(tmp_path, case):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "crafted.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(_crafted(marker)[case])
    with pytest.raises(RuntimeError, match=r"Refused to read the checkpoint .*crafted\.ckpt.*Nothing from it was run"):
        read_index(folder)
    assert not marker.exists()
    assert not hasattr(Metadata, "crafted")


def test_refusal_names_what_the_index_refers_to(tmp_path):
    (tmp_path / ".metadata").write_bytes(_crafted(tmp_path / "MARKER")["dotted-filesystem-os"])
    with pytest.raises(RuntimeError) as error:
        read_index(tmp_path)
    assert "refers to torch.distributed.checkpoint.filesystem.os.system, which is not one of the classes" in str(
        error.value
    )


def test_crafted_index_is_refused_by_consolidate(tmp_path):
    """``python -m lightning_async_pp consolidate`` of a crafted folder: refused before anything runs."""
    marker = tmp_path / "MARKER"
    folder = tmp_path / "crafted.ckpt"
    folder.mkdir()
    torch.save({"global_step": 1}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(_crafted(marker)["dotted-filesystem-os"])
    with pytest.raises(RuntimeError, match="Refused to read the checkpoint"):
        main(["consolidate", str(folder), str(tmp_path / "out.ckpt")])
    assert not marker.exists() and not (tmp_path / "out.ckpt").exists()
