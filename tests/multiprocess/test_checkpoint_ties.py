"""Tied weights resume at another pipeline shape: every copy of a tied parameter gets its training state back.

The model is the toy LM of ``toy_run.py`` (not the demo GPT) with two ties: the embedding table is the head's
output matrix, and the first block's ``up`` matrix is the last block's. Each stage that uses a tied parameter
holds a copy with its own optimizer state (``DelayCorrected(Muon)``: momentum, the correction's previous
update) and its own previous weight version ``w[t-1]``. Cut as ``[Embed, Block1, Block2, Block3 | Head]``
(``split_points=[4]``), the block tie lies within stage 0 while the embedding tie spans both stages; resumed
at ``P=3`` (``[Embed, Block1 | Block2, Block3 | Head]``) the block tie spans two stages, resumed at ``P=1``
both ties lie within one. A run saved on one device and resumed on two stages splits both.

Each case compares the resumed steps' ``train/loss`` and final weights with the uninterrupted run that wrote
the checkpoint mid-epoch (and went on), and checks that the tied copies stay bitwise equal after every update.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiprocess.scripts.toy_run import run_toy

pytestmark = pytest.mark.multiprocess

STEPS, STOP = 10, 5
COMMON = (
    "--tie-embedding",
    "--tie-blocks",
    "--optimizer",
    "corrected_muon",
    "--clip",
    "0.5",
    "--microbatches",
    "3",
    "--steps",
    str(STEPS),
    "--schedule",
    "2bw",
    "--muon-ns-float32",
)
SHAPES = {
    "P1": (1, ()),
    "P2": (2, ("--split-points", "4")),
    "P2-split": (2, ("--split-points", "3")),
    "P3": (3, ("--split-points", "2,4")),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Runs of all STEPS that save a checkpoint after STOP and go on, per save shape: (result, weights, dir)."""
    cache: dict[str, tuple] = {}

    def get(shape: str):
        if shape not in cache:
            devices, split = SHAPES[shape]
            out = tmp_path_factory.mktemp(f"uninterrupted-{shape}")
            result, weights, _ = run_toy(out, devices, *COMMON, *split, "--checkpoint-at", str(STOP))
            cache[shape] = (result, weights, out)
        return cache[shape]

    return get


def assert_tied_copies_equal(tied_records, tied_names):
    """After each update a rank applied, every rank's copy of each tied parameter holds the same bits."""
    copies: dict[tuple[int, int], list[torch.Tensor]] = {}
    for records in tied_records:
        for step, values in records:
            for index, names in enumerate(tied_names):
                copies.setdefault((index, step), []).extend(values[n] for n in names if n in values)
    assert copies
    for (index, step), held in copies.items():
        for other in held[1:]:
            assert torch.equal(held[0], other), f"copies of {tied_names[index]} differ after update {step}"


CASES = [
    # (saved at, resumed at, bitwise?)
    pytest.param("P2", "P2", True, id="P2-to-P2"),
    pytest.param("P2", "P3", False, id="P2-to-P3"),  # the block tie: one stage at save, two after
    pytest.param("P2", "P1", False, id="P2-to-P1"),  # the embedding tie: two stages at save, one after
    pytest.param("P1", "P2-split", False, id="P1-to-P2"),  # both ties: one device at save, two stages after
]


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "resumed", "exact"), CASES)
def test_tied_model_resumes_at_another_pipeline_shape(tmp_path, uninterrupted, saved, resumed, exact):
    from tests.multiprocess.scripts.toy_run import ToyLM

    straight, straight_weights, first = uninterrupted(saved)
    assert straight["steps"] == list(range(STEPS))
    devices, split = SHAPES[resumed]
    result, weights, tied = run_toy(tmp_path, devices, *COMMON, *split, "--ckpt-path", str(first / f"at-{STOP}.ckpt"))
    assert result["steps"] == list(range(STOP, STEPS))
    tied_names = ToyLM(tie_embedding=True, tie_blocks=True).tied_names()
    if devices > 1:
        assert_tied_copies_equal(tied, tied_names)
    assert sorted(weights) == sorted(straight_weights)
    loss = max(abs(a - b) for a, b in zip(result["losses"], straight["losses"][STOP:]))
    weight = max((weights[k] - v).abs().max().item() for k, v in straight_weights.items())
    print(f"{saved} -> {resumed}: max |loss - uninterrupted| {loss:.2e}, max |weight - uninterrupted| {weight:.2e}")
    if exact:
        assert result["losses"] == straight["losses"][STOP:]
        for name, value in straight_weights.items():
            assert torch.equal(weights[name], value), name
        return
    # Another P may add the clipping norm's per-stage parts in another order: rounding (measured, with Muon in
    # float32: losses within 9.5e-7, two float32 steps at this loss, weights within 2.4e-7). A copy that resumes
    # without its optimizer state or w[t-1] moves the losses by ~1e-2 within these 5 steps (measured: 1.6e-2 for
    # P2 -> P3) and its copies apart.
    torch.testing.assert_close(
        torch.tensor(result["losses"]), torch.tensor(straight["losses"][STOP:]), rtol=1e-6, atol=1e-6
    )
    for name, value in straight_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_a_tied_copy_reads_the_state_saved_under_the_first_name(tmp_path):
    """Saved on one device (one tensor, named ``layers.0.table.weight``), read by a stage that holds only the head:
    the head's copy gets the optimizer state and ``w[t-1]`` of the embedding's name (in one process, no launch)."""
    from lightning_async_pp import checkpoint as sharded
    from lightning_async_pp.strategy.placement import keep_only_layers
    from tests.multiprocess.scripts.toy_run import ToyLM

    whole = ToyLM(tie_embedding=True)
    aliases = sharded.parameter_aliases(whole)
    assert aliases == {"layers.4.out.weight": "layers.0.table.weight"}
    optimizer = torch.optim.AdamW(whole.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    for p in whole.parameters():
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
    previous = {n: p.detach() - 1 for n, p in whole.named_parameters()}
    shard = sharded.stage_shard(whole.state_dict(), optimizer, whole, previous, 0, aliases)
    meta = {sharded.CHECKPOINT_KEY: {"schedule": "2bw", "has_training_state": True}}
    path = tmp_path / "step.ckpt"
    sharded.ShardedCheckpointIO().save_checkpoint({sharded.SHARD_KEY: True, "shard": shard, "meta": meta}, path)

    stage = ToyLM(tie_embedding=True)
    keep_only_layers(stage, list(stage.pipeline_layers()), range(3, 5), [0, 0, 0, 1, 1])
    assert "layers.0.table.weight" not in dict(stage.named_parameters())
    stage_optimizer = torch.optim.AdamW(stage.parameters(), lr=0.1)
    stage_previous = {n: torch.zeros_like(p) for n, p in stage.named_parameters()}
    sharded.load_stage(
        path,
        sharded.read_index(path),
        state_dict=stage.state_dict(),
        module=stage,
        optimizer=stage_optimizer,
        previous=stage_previous,
        stage=1,
        aliases=aliases,
    )
    assert_tied_head_restored(whole, stage, optimizer, stage_optimizer, previous, stage_previous)


def assert_tied_head_restored(whole, stage, optimizer, stage_optimizer, previous: dict, stage_previous: dict) -> None:
    """The last stage's tied head (``layers.4.out``) holds the whole model's table (``layers.0.table``): its weight,
    its ``w[t-1]`` and its optimizer state, bit for bit."""
    table, head = whole.get_parameter("layers.0.table.weight"), stage.get_parameter("layers.4.out.weight")
    assert torch.equal(head, table)
    assert torch.equal(stage_previous["layers.4.out.weight"], previous["layers.0.table.weight"])
    assert sorted(stage_optimizer.state[head]) == sorted(optimizer.state[table])
    for key, value in optimizer.state[table].items():
        assert torch.equal(stage_optimizer.state[head][key], value), key
