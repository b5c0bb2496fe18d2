"""Every refusal listed in ``REFUSALS`` has a row in the message table of docs/troubleshooting.md.

Each entry provokes the refusal through the package's own check (no process is started) and the message it raises
must match the message cell of a row: the cell's code spans are the message's beginning, with ``...`` standing for
any text (a path, the rest of the sentence). A new refusal gets an entry here and a row there.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint import SHARD_KEY, ShardedCheckpointIO
from lightning_async_pp.checkpoint.compat import (
    check_checkpoint_path,
    check_compatible,
    check_named_optimizer_state,
    saved_shapes,
)
from lightning_async_pp.checkpoint.safe import read_index
from lightning_async_pp.cli import unreadable_checkpoint_message
from lightning_async_pp.demos import TextDataModule
from lightning_async_pp.models.data import refuse_custom_code
from lightning_async_pp.models.token_writer import write_token_file
from lightning_async_pp.models.tokens import TokenWindows
from lightning_async_pp.strategy.launch import check_datamodule, check_train_loader
from lightning_async_pp.strategy.optimizer_steps import DELAYED_STEP, STAGE_STEP
from tests.fixtures.helpers import ROOT
from tests.fixtures.token_files import position_file

PAGE = ROOT / "docs" / "troubleshooting.md"


class Unsafe:
    """A class a safe load does not know."""


def _unsafe_file(folder: Path) -> None:
    path = folder / "other.ckpt"
    torch.save({"hyper_parameters": {"thing": Unsafe()}}, path)
    try:
        torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - what Lightning's read of the hyperparameters raises
        raise ValueError(unreadable_checkpoint_message(str(path), error)) from None


def _understated_header(folder: Path) -> None:
    path = folder / "train.bin"
    info = replace(position_file(path, 60_000), vocab_size=257, max_token_id=256)
    TokenWindows(path, info, block_size=8).read(59_999, 1)


def _plain_folder(folder: Path) -> None:
    (folder / "logs").mkdir()
    check_checkpoint_path(folder / "logs")


def _text_file(folder: Path) -> None:
    (folder / "notes.ckpt").write_text("not a checkpoint\n")
    check_checkpoint_path(folder / "notes.ckpt")


def _another_model(folder: Path) -> None:
    saved = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([3]), [])
    index = Metadata(state_dict_metadata={"state_dict.w": saved})
    check_compatible(folder / "epoch=0-step=2.ckpt", {}, saved_shapes(index), "2bw", {"w": (2,), "v": (1,)})


def _crafted_index(folder: Path) -> None:
    class System:  # pickles as a call of os.system, reached through a module DCP's index may name
        def __reduce__(self):
            return (eval, ("exit 0",))

    payload = pickle.dumps(System(), protocol=0)
    payload = payload.replace(b"c__builtin__\neval", b"ctorch.distributed.checkpoint.filesystem\nos.system")
    assert b"os.system" in payload
    (folder / "crafted.ckpt").mkdir()
    (folder / "crafted.ckpt" / ".metadata").write_bytes(payload)
    read_index(folder / "crafted.ckpt")


def _removal_outside(folder: Path) -> None:
    io = ShardedCheckpointIO()
    io.setup(None, [str(folder / "run")])  # ModelCheckpoint's folder
    torch.save({"x": 1}, folder / "kept.ckpt")
    io.save_checkpoint({"x": torch.ones(1)}, folder / "run" / "saved.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.remove_checkpoint(folder / "run" / ".." / "kept.ckpt")


def _needs_weights_only_false(folder: Path) -> None:
    torch.save({"state_dict": {}, "hyper_parameters": {"thing": Unsafe()}}, folder / "model.ckpt")
    ShardedCheckpointIO().load_checkpoint(folder / "model.ckpt")


def _url_of_several_processes(folder: Path) -> None:
    ShardedCheckpointIO().save_checkpoint({SHARD_KEY: True, "shard": {}, "meta": None}, "s3://bucket/step=2.ckpt")


def _tokens_over_their_source(folder: Path) -> None:
    (folder / "corpus.txt").write_text("text")
    write_token_file([folder / "corpus.txt"], folder / "corpus.txt")


def _header_over_another_json(folder: Path) -> None:
    (folder / "corpus.txt").write_text("text")
    (folder / "train.json").write_text("{}")
    write_token_file([folder / "corpus.txt"], folder / "train.bin")


def _causal_lm(model_type: str, **config) -> None:
    from lightning_async_pp.models import CausalLM

    CausalLM(model_type=model_type, config=config or None)


def _custom_code(folder: Path) -> None:
    (folder / "config.json").write_text('{"auto_map": {"AutoConfig": "mine.Config"}}')
    refuse_custom_code(folder / "config.json")


def _objective_left_out() -> None:
    """The proof of an OLMoE cut whose objective leaves the routers' loss out."""
    from transformers import AutoConfig

    from lightning_async_pp.models.hf import split_layers
    from lightning_async_pp.models.hf_moe import Objective
    from lightning_async_pp.models.hf_structure import prove_cut

    config = AutoConfig.for_model("olmoe", **_TINY_MOE, num_experts=4, output_router_logits=True)
    config._attn_implementation = "sdpa"
    prove_cut(config, lambda model: (split_layers(model), Objective(model, None)))


def _resumed_inside_a_window(_: Path) -> None:
    from types import SimpleNamespace

    from lightning_async_pp.strategy.optimizer_steps import AccumulationWindow

    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_idx=3))
    module = SimpleNamespace(automatic_optimization=True)
    AccumulationWindow().add(None, SimpleNamespace(accumulate_grad_batches=2, fit_loop=loop, lightning_module=module))


def _closure_needed(why: str) -> None:
    from lightning_async_pp.strategy.optimizer_steps import check_closure_use

    check_closure_use(torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(1))]), why)


def _closure_evaluated_twice(_: Path) -> None:
    from lightning_async_pp.reference import DelayedWeights

    closure = DelayedWeights(torch.nn.Linear(2, 1)).wrap_closure(lambda: None)
    closure()
    closure()


_TINY_MOE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96)

REFUSALS: dict[str, Callable[[Path], None]] = {
    "ckpt_path missing": lambda folder: check_checkpoint_path(folder / "missing.ckpt"),
    "ckpt_path a plain folder": _plain_folder,
    "ckpt_path a text file": _text_file,
    "ckpt_path unsafe to load": _unsafe_file,
    "data module batch size": lambda _: check_datamodule(TextDataModule(batch_size=16), 3, num_stages=2),
    "negative batch size": lambda _: check_datamodule(TextDataModule(batch_size=-4), 4, num_stages=2),
    "loader batch size": lambda _: check_train_loader(
        torch.utils.data.DataLoader(range(64), batch_size=6), 4, num_stages=4, replicas=1
    ),
    "token id above the header": _understated_header,
    "checkpoint of another model": _another_model,
    "crafted checkpoint index": _crafted_index,
    "removal outside the checkpoint folder": _removal_outside,
    "checkpoint that needs weights_only=False": _needs_weights_only_false,
    "optimizer state of another strategy on several stages": lambda folder: check_named_optimizer_state(
        folder / "model.ckpt", {"state_dict": {}, "optimizer_states": [{"state": {}, "param_groups": []}]}
    ),
    "sharded checkpoint to a URL": _url_of_several_processes,
    "checkpoint form": lambda _: AsyncPipelineStrategy(save_distributed_checkpoint="full"),
    "token file named .json": lambda folder: write_token_file("builtin", folder / "train.json"),
    "token file over its source": _tokens_over_their_source,
    "token header over another file": _header_over_another_json,
    "model folder with code of its own": _custom_code,
    "Hugging Face model without the structure": lambda _: _causal_lm("opt"),
    "Hugging Face model whose cut fails its proof": lambda _: _causal_lm("biogpt"),
    "mixture of experts whose objective differs": lambda _: _objective_left_out(),
    "resumed inside an accumulation window": _resumed_inside_a_window,
    "closure optimizer under 2BW": lambda _: _closure_needed(DELAYED_STEP),
    "closure optimizer on several stages": lambda _: _closure_needed(STAGE_STEP),
    "closure evaluated twice in a delayed step": _closure_evaluated_twice,
    "mixture of experts without a sparse layer": lambda _: _causal_lm(
        "qwen2_moe", **_TINY_MOE, mlp_only_layers=[0, 1], output_router_logits=True
    ),
}


def message_patterns() -> list[re.Pattern]:
    """The message cells of the page's tables as patterns: each code span, ``...`` matching any text."""
    patterns = []
    for line in PAGE.read_text().splitlines():
        if not line.startswith("| "):
            continue
        cell = line.split(" | ")[0][2:]
        for double, single in re.findall(r"``\s?(.+?)\s?``|`([^`]+)`", cell):
            span = double or single
            patterns.append(re.compile(re.escape(span).replace(re.escape("..."), ".*"), re.S))
    return patterns


@pytest.mark.parametrize("name", list(REFUSALS))
def test_every_refusal_has_a_row(name, tmp_path):
    with pytest.raises(Exception) as raised:  # noqa: PT011 - any refusal: its message is what is checked
        REFUSALS[name](tmp_path)
    message = str(raised.value)
    assert any(pattern.match(message) for pattern in message_patterns()), (
        f"docs/troubleshooting.md has no row for: {message}"
    )
