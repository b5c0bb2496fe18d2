"""Compiled blocks in a 2-stage 2BW pipeline against the eager one-device trajectory, and no recompilation.

Each stage runs its blocks with ``functional_call`` on the buffer of the micro-batch's weight version; the
two versions alternate every step, so a compiled block that guarded on its parameters' identity or storage
would compile again at step 1 (the first step on the other buffer). The counts are dynamo's own
(``torch._dynamo.utils.counters``), read on every rank after each step.

Tolerance: ``aot_eager`` runs the traced graph with the same ATen kernels as eager, so the compiled pipeline is
held to the tolerance of the eager pipeline tests (rtol 1e-5, atol 1e-6: the pipeline already sums micro-batch
gradients across processes in float32). Inductor generates its own fused kernels, which reorder float sums;
its smoke test (in ``tests/benchmarks/test_bench_compile.py``) allows 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_async_pp import AsyncPipelineStrategy
from lightning_async_pp.checkpoint.safe import read_index
from tests.fixtures.helpers import fit, run_script
from tests.multiprocess.scripts.compile_run import batches, build

pytestmark = pytest.mark.multiprocess
RUNNER = "tests.multiprocess.scripts.compile_run"
DEVICES, MICROBATCHES, STEPS = 2, 2, 6


def run_compiled(out: Path, model: str, where: str, *extra: str) -> tuple[list[dict], dict[str, torch.Tensor]]:
    command = [sys.executable, "-m", RUNNER, "--model", model, "--where", where, "--devices", str(DEVICES)]
    command += ["--microbatches", str(MICROBATCHES), "--steps", str(STEPS), "--out", str(out), *extra]
    returncode, output = run_script(command, timeout=300)
    assert returncode == 0, output[-6000:]
    records = [json.loads((out / f"compile_rank{rank}.json").read_text()) for rank in range(DEVICES)]
    weights: dict[str, torch.Tensor] = {}
    for rank in range(DEVICES):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return records, weights


def eager_reference(model: str, recompute: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model, eager, on one device: micro-batches in one process, gradients on ``w[t-1]``."""
    torch.set_num_threads(1)
    args = argparse.Namespace(model=model, where="option", backend="none")
    module = build(args)
    strategy = AsyncPipelineStrategy(schedule="2bw", num_microbatches=MICROBATCHES, activation_checkpointing=recompute)
    losses = fit(module, batches(model, STEPS), strategy=strategy)
    return losses, {k: v.detach() for k, v in module.state_dict().items()}


CASES = [
    pytest.param("gpt", "option", False, id="gpt-option"),
    # The GPT's recomputation runs inside its compiled blocks; the Llama's compiled layers inside recomputation.
    pytest.param("gpt", "configure_model", True, id="gpt-configure_model-recompute"),
    pytest.param("llama", "option", True, id="llama-option-recompute"),
]


@pytest.mark.parametrize(("model", "where", "recompute"), CASES)
def test_compiled_pipeline_matches_eager_and_never_recompiles(tmp_path, model, where, recompute):
    extra = ["--recompute"] if recompute else []
    if where == "option" and not recompute:
        extra.append("--save-checkpoint")
    records, weights = run_compiled(tmp_path, model, where, *extra)
    ref_losses, ref_weights = eager_reference(model, recompute)

    for rank, record in enumerate(records):
        assert record["compiled"] == 2, f"rank {rank}: {record['compiled']} compiled blocks, expected 2 per stage"
        assert record["frames"][0] >= 1, f"rank {rank}: nothing was compiled in the first step"
        # After step 0 (version -1's buffer) nothing compiles again, on either weight version.
        assert record["frames"] == [record["frames"][0]] * STEPS, f"rank {rank} recompiled: {record['frames']}"
        assert record["graphs"] == [record["graphs"][0]] * STEPS, f"rank {rank}: new graphs {record['graphs']}"
    losses = next(r["losses"] for r in records if "losses" in r)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert sorted(weights) == sorted(ref_weights)
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    if (tmp_path / "final.ckpt").exists():
        saved = read_index(tmp_path / "final.ckpt").state_dict_metadata
        names = {key.removeprefix("state_dict.") for key in saved if key.startswith("state_dict.")}
        assert names == set(ref_weights), "a compiled model's checkpoint names its weights as the eager model does"
