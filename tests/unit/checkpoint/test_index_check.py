"""A crafted checkpoint folder is read only as this strategy writes one, through ``consolidate`` (the entry point
that reads a whole checkpoint in one process): no file outside it is opened, no process-wide state changes, and
memory and time stay bounded by the files' sizes; real checkpoints still consolidate."""

from __future__ import annotations

import copyreg
import os
import pickle
import shutil
import sys
import time
import tracemalloc
from collections import OrderedDict

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, MetadataIndex

from lightning_async_pp.checkpoint import safe
from lightning_async_pp.checkpoint.safe import read_index
from lightning_async_pp.cli import main
from tests.unit.checkpoint.test_io import _single_device_checkpoint

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)  # records only while a test below collects


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint this strategy wrote (tiny GPT, Muon, 3 steps) and another run's, to point at."""
    path, _ = _single_device_checkpoint(tmp_path_factory.mktemp("real"))
    other, _ = _single_device_checkpoint(tmp_path_factory.mktemp("other"), steps=2)
    return path, other


@pytest.fixture
def crafted(written, tmp_path):
    folder = tmp_path / "crafted.ckpt"
    shutil.copytree(written[0], folder, symlinks=True)
    return folder


def _index(folder):
    return pickle.loads((folder / ".metadata").read_bytes())  # the test's own, trusted copy


def _write(folder, data: bytes) -> None:
    (folder / ".metadata").write_bytes(data)


def _consolidate(folder, tmp_path, match=r"Refused to read the checkpoint .*crafted\.ckpt"):
    """``consolidate`` refuses the folder, opening nothing outside it and writing nothing."""
    global _OPENED
    out = tmp_path / "out.ckpt"
    _OPENED = []
    try:
        with pytest.raises(RuntimeError, match=match) as error:
            main(["consolidate", str(folder), str(out)])
    finally:
        opened, _OPENED = _OPENED, None
    outside = [p for p in opened if not os.path.abspath(p).startswith(str(folder)) and "site-packages" not in p]
    assert not outside, outside
    assert not out.exists()
    assert len(str(error.value)) < 2000  # types named, never a crafted value's repr
    return str(error.value)


def test_a_real_checkpoint_consolidates_to_its_own_tensors(written, tmp_path):
    path, _ = written
    meta = main(["consolidate", str(path), str(tmp_path / "out.ckpt")])
    saved = torch.load(tmp_path / "out.ckpt", weights_only=True)
    reference = safe.read_index(path)
    assert meta == 0 and {f"state_dict.{k}" for k in saved["state_dict"]} == {
        k for k in reference.state_dict_metadata if k.startswith("state_dict.")
    }


# --- 1. files outside the folder -----------------------------------------------------------------------------


def _storage_to(index, name):
    return {k: _StorageInfo(name, v.offset, v.length) for k, v in index.storage_data.items()}


class _OrderedDictWithState(dict):
    """Pickles as an ``OrderedDict`` given the attributes ``values`` and ``items``, which the checks would iterate
    instead of its entries."""

    def __reduce__(self):
        return OrderedDict, (), {"values": (), "items": ()}, None, iter(dict.items(self))


def test_an_ordered_dict_given_attributes_is_refused(crafted, written, tmp_path):
    """BUILD on an OrderedDict could hide its real entries (pointing at another run's shard) from the checks."""
    index = _index(crafted)
    index.storage_data = _OrderedDictWithState(_storage_to(index, str(written[1] / "__0_0.distcp")))
    _write(crafted, pickle.dumps(index))
    assert "sets attributes of a OrderedDict" in _consolidate(crafted, tmp_path)


@pytest.mark.parametrize("name", ["/dev/zero", "../other.ckpt/__0_0.distcp", "a/b", "..", "C:x"])
def test_a_shard_named_by_a_path_is_refused(crafted, tmp_path, name):
    index = _index(crafted)
    index.storage_data = _storage_to(index, name)
    _write(crafted, pickle.dumps(index))
    _consolidate(crafted, tmp_path, match="not a plain file name in the checkpoint")


@pytest.mark.parametrize("link", ["shard", "metadata", "meta", "fifo", "device"])
def test_links_fifos_and_devices_in_a_checkpoint_are_never_opened(crafted, written, tmp_path, link):
    target = {"shard": "__0_0.distcp", "metadata": ".metadata", "meta": "meta.pt"}.get(link, "__0_0.distcp")
    (crafted / target).unlink()
    if link == "fifo":
        os.mkfifo(crafted / target)  # would block an open for reading forever
    elif link == "device":
        os.symlink("/dev/zero", crafted / target)
    else:
        os.symlink(written[1] / target, crafted / target)
    started = time.monotonic()
    _consolidate(crafted, tmp_path, match=r"(symbolic link|not a regular file)")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: _StorageInfo(s.relative_path, s.offset, s.length, ["zstd"]), "storage transforms"),
        (lambda s: _StorageInfo(s.relative_path, -1, s.length), "not a non-negative integer"),
        (lambda s: _StorageInfo(s.relative_path, s.offset, True), "not a non-negative integer"),
        (lambda s: _StorageInfo(s.relative_path, s.offset + 10**12, s.length), "is truncated"),
        (lambda s: _StorageInfo(s.relative_path, 0, s.length), "overlapping storage regions"),
    ],
    ids=["transforms", "negative-offset", "bool-length", "past-the-end", "overlapping"],
)
def test_storage_entries_are_checked_exactly(crafted, tmp_path, change, match):
    index = _index(crafted)
    index.storage_data = {k: change(v) for k, v in index.storage_data.items()}
    _write(crafted, pickle.dumps(index))
    _consolidate(crafted, tmp_path, match=match)


# --- 3. process-wide state ---------------------------------------------------------------------------------


def _prefixed(prefix: bytes, index) -> bytes:
    """A pickle that first runs ``prefix`` (its result popped), then builds ``index``."""
    body = pickle.dumps(index, protocol=2)
    return body[:2] + prefix + pickle.POP + body[2:]


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


ENUM = _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")


@pytest.mark.parametrize(
    "prefix",
    [
        ENUM + pickle.BININT1 + b"\x00" + pickle.TUPLE1 + pickle.REDUCE,  # the member every index shares
        _global("builtins", "set") + pickle.EMPTY_TUPLE + pickle.REDUCE,
        _global("torch", "Size") + pickle.EMPTY_TUPLE + pickle.REDUCE,
    ],
    ids=["enum-member", "set", "size"],
)
def test_no_singleton_set_or_size_receives_state(crafted, tmp_path, prefix):
    state = pickle.EMPTY_DICT + pickle.SHORT_BINSTRING + b"\x06_value" + pickle.BININT1 + b"\x07" + pickle.SETITEM
    _write(crafted, _prefixed(prefix + state + pickle.BUILD, _index(crafted)))
    _consolidate(crafted, tmp_path, match="sets attributes of")
    assert _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 0
    assert "_value" not in vars(_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT)


# --- 4. memory and time ------------------------------------------------------------------------------------


def _doubled(levels: int, container: bytes) -> bytes:
    """``x0 = (); x{i+1} = (x_i, x_i)``: a few bytes per level, 2**levels leaves when walked or hashed."""
    out = pickle.EMPTY_TUPLE + pickle.BINPUT + b"\x00"
    for i in range(levels):
        out += pickle.BINGET + bytes([i]) + pickle.BINGET + bytes([i]) + container + pickle.BINPUT + bytes([i + 1])
    return out


@pytest.mark.parametrize(
    "prefix",
    [
        # a tuple key: hashed on every use, 2**60 leaves
        pickle.EMPTY_DICT + _doubled(60, pickle.TUPLE2) + pickle.NONE + pickle.SETITEM,
        # a refused object whose repr would be 2**40 items long
        _doubled(40, pickle.TUPLE2) + pickle.EMPTY_DICT + pickle.BUILD,
        # a frozenset of such tuples, and a layout looked up by one
        pickle.MARK + _doubled(60, pickle.TUPLE2) + pickle.FROZENSET,
        _global("torch.serialization", "_get_layout") + _doubled(60, pickle.TUPLE2) + pickle.TUPLE1 + pickle.REDUCE,
    ],
    ids=["tuple-key", "repr", "frozenset", "layout-lookup"],
)
def test_a_few_bytes_cost_little_memory_and_time(crafted, tmp_path, prefix):
    data = _prefixed(prefix, _index(crafted))
    _write(crafted, data)
    tracemalloc.start()
    started = time.monotonic()
    try:
        _consolidate(crafted, tmp_path, match="Refused")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 5 and peak < 64 * 2**20


def test_an_index_larger_than_any_written_is_not_read(crafted, tmp_path):
    with open(crafted / ".metadata", "r+b") as f:
        f.truncate(safe.MAX_INDEX_BYTES + 1)  # sparse: nothing written
    _consolidate(crafted, tmp_path, match="larger than 256 MiB")


# --- 5. sizes from the index -------------------------------------------------------------------------------


def _first_tensor(index):
    return next(k for k, v in index.state_dict_metadata.items() if hasattr(v, "chunks") and len(v.size) == 2)


@pytest.mark.parametrize("case", ["huge", "gap", "outside", "overlap"])
def test_chunks_tile_each_tensor_within_its_bytes(crafted, tmp_path, case):
    index = _index(crafted)
    key = _first_tensor(index)
    md = index.state_dict_metadata[key]
    rows, cols = md.size
    chunk = md.chunks[0]
    if case == "huge":  # 3 KB of index, terabytes of tensor
        md.size = chunk.sizes = torch.Size([2**20, 2**20])
        match = "more bytes than its storage region holds"
    elif case == "gap":  # half the tensor never read: stale memory in the output
        chunk.sizes = torch.Size([rows // 2, cols])
        match = "do not tile the tensor exactly"
    elif case == "outside":
        chunk.offsets = torch.Size([1, 0])
        match = "outside the tensor"
        info = index.storage_data.pop(MetadataIndex(key, torch.Size([0, 0])))
        index.storage_data[MetadataIndex(key, torch.Size([1, 0]), 0)] = info
    else:
        md.chunks = [chunk, type(chunk)(chunk.offsets, chunk.sizes)]
        match = "do not tile the tensor exactly"
    _write(crafted, pickle.dumps(index))
    _consolidate(crafted, tmp_path, match=match)


# --- 7. the unpickler ---------------------------------------------------------------------------------------


def test_copyreg_extension_codes_are_refused(crafted, tmp_path):
    copyreg.add_extension("os", "system", 0x7FFF0001 & 0xFFFF)
    try:
        code = (0x7FFF0001 & 0xFFFF).to_bytes(2, "little")
        _write(crafted, _prefixed(pickle.EXT2 + code, _index(crafted)))
        _consolidate(crafted, tmp_path, match="extension registry")
    finally:
        copyreg.remove_extension("os", "system", 0x7FFF0001 & 0xFFFF)


@pytest.mark.parametrize(
    ("prefix", "match"),
    [
        (
            _global("collections", "OrderedDict") + pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.NONE + pickle.APPEND,
            "appends to a OrderedDict",
        ),
        (pickle.EMPTY_LIST + pickle.MARK + pickle.EMPTY_LIST + pickle.ADDITEMS, "adds items to a list"),
        (pickle.EMPTY_SET + pickle.MARK + pickle.EMPTY_LIST + pickle.ADDITEMS, "not a set of plain values"),
    ],
    ids=["append-to-dict", "additems-to-list", "list-in-set"],
)
def test_items_go_only_into_lists_and_sets(crafted, tmp_path, prefix, match):
    _write(crafted, _prefixed(prefix, _index(crafted)))
    _consolidate(crafted, tmp_path, match=match)


def test_a_real_index_reads_as_pickle_reads_it(written):
    index, expected = read_index(written[0]), _index(written[0])
    assert index.state_dict_metadata == expected.state_dict_metadata
    assert index.storage_data == expected.storage_data and type(index.storage_data) is dict


# --- the same checks on resume (fit --ckpt_path) ------------------------------------------------------------


def test_a_resume_from_a_folder_without_its_shard_reads_nothing_of_another_run(crafted, written):
    """The attack on ``fit --ckpt_path``: an index whose entries point at another run's shard, hidden from the
    checks by attributes of its OrderedDict, in a folder that holds no shard at all."""
    from lightning_async_pp import AsyncPipelineStrategy
    from tests.fixtures.helpers import fit, random_batches, tiny_gpt

    global _OPENED
    index = _index(crafted)
    index.storage_data = _OrderedDictWithState(_storage_to(index, str(written[1] / "__0_0.distcp")))
    _write(crafted, pickle.dumps(index))
    (crafted / "__0_0.distcp").unlink()
    model = tiny_gpt(n_layer=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _OPENED = []
    try:
        with pytest.raises(RuntimeError, match="sets attributes of a OrderedDict"):
            fit(model, random_batches(4), strategy=AsyncPipelineStrategy(num_microbatches=2), ckpt_path=str(crafted))
    finally:
        opened, _OPENED = _OPENED, None
    assert not [p for p in opened if str(written[1]) in p]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
