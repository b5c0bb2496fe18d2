"""A Hugging Face folder's ``model.safetensors.index.json`` names files in that folder only:
``CausalLM(pretrained=...)`` (what ``fit`` builds) never reads a file the index points to elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from lightning_async_pp.models import CausalLM  # noqa: E402
from tests.unit.models.test_hf import hf_twin, materialized  # noqa: E402

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A sharded ``save_pretrained`` folder, and another model's single file outside it."""
    root = tmp_path_factory.mktemp("hf")
    hf_twin(materialized("llama")).save_pretrained(root / "model", max_shard_size="20KB")
    other = hf_twin(materialized("llama", init_seed=7))
    other.save_pretrained(root / "elsewhere")
    return root / "model", root / "elsewhere" / "model.safetensors"


def test_a_sharded_folder_still_loads(folders):
    folder, _ = folders
    loaded = CausalLM(pretrained=str(folder), lr_schedule="constant")
    loaded.configure_model()
    assert len(set(json.loads((folder / INDEX).read_text())["weight_map"].values())) > 1
    assert loaded.checkpoint.read and set(loaded.checkpoint.read) <= set(loaded.checkpoint.weight_map)


@pytest.mark.parametrize("target", ["absolute", "parent", "subfolder"])
def test_an_index_that_points_outside_its_folder_is_refused(folders, tmp_path, monkeypatch, target):
    folder, outside = folders
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    for file in folder.iterdir():
        (crafted / file.name).write_bytes(file.read_bytes())
    index = json.loads((crafted / INDEX).read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = {
        "absolute": str(outside),
        "parent": f"../{outside.parent.name}/{outside.name}",
        "subfolder": f"sub/{outside.name}",
    }[target]
    (crafted / INDEX).write_text(json.dumps(index))
    opened = []
    real_open = __import__("safetensors").safe_open
    monkeypatch.setattr(
        "lightning_async_pp.models.hf.safe_open", lambda f, *a, **k: opened.append(f) or real_open(f, *a, **k)
    )
    with pytest.raises(ValueError, match=r"not a file name in .*crafted: an index names the safetensors files next"):
        CausalLM(pretrained=str(crafted), lr_schedule="constant").configure_model()
    assert str(outside) not in opened and not any("elsewhere" in f for f in opened)


def test_consolidate_does_not_replace_an_hf_folder_nobody_named(tmp_path, capsys):
    """``consolidate`` of a CausalLM checkpoint writes ``<out>-hf`` by default: never over an existing folder."""
    from lightning_async_pp.checkpoint import TRANSFORMERS_KEY
    from lightning_async_pp.cli import main

    folder = tmp_path / "model.ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"")  # refused before it is read
    torch.save({TRANSFORMERS_KEY: {"config": "{}", "names": {}}}, folder / "meta.pt")
    existing = tmp_path / "out-hf"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep")
    with pytest.raises(SystemExit) as exit_:
        main(["consolidate", str(folder), str(tmp_path / "out.ckpt")])
    assert exit_.value.code == 2 and "out-hf exists" in capsys.readouterr().err
    assert [p.name for p in existing.iterdir()] == ["mine.txt"] and not (tmp_path / "out.ckpt").exists()
