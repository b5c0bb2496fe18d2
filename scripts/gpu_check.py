"""Exactness and a short throughput run on every GPU of this machine (NCCL).

    python scripts/gpu_check.py [--steps 20] [--out gpu_check.json]

For P in {2, 4, ..., number of GPUs}: trains the test GPT as a P-stage pipeline ("2bw" and "1f1b") and
the single-device reference on GPU 0, and prints the largest relative loss and weight differences, the
bubble fraction of each stage and tokens/s. GPU kernels are not bitwise deterministic, so expect
differences around 1e-6..1e-4 rather than the CPU's 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import fit, random_batches, tiny_gpt  # noqa: E402
from pipeline_run import make_optimizer  # noqa: E402

from lightning_async_pp import AsyncPipelineStrategy  # noqa: E402

SIZE = {"width": 256, "seq": 128, "batch": 64, "layers": 8}


def pipeline(devices: int, schedule: str, microbatches: int, steps: int, out: Path) -> tuple[dict, dict]:
    command = [
        sys.executable, str(ROOT / "tests" / "pipeline_run.py"), "--accelerator", "gpu", "--devices", str(devices),
        "--schedule", schedule, "--microbatches", str(microbatches), "--steps", str(steps), "--optimizer", "adamw",
        "--width", str(SIZE["width"]), "--seq", str(SIZE["seq"]), "--batch-size", str(SIZE["batch"]),
        "--layers", str(SIZE["layers"]), "--out", str(out),
    ]
    subprocess.run(command, check=True, timeout=900)
    weights = {}
    for rank in range(devices):
        weights.update(torch.load(out / f"weights_rank{rank}.pt"))
    return json.loads((out / "losses.json").read_text()), weights


def reference(schedule: str, microbatches: int, steps: int) -> tuple[list[float], dict]:
    model = tiny_gpt(n_layer=SIZE["layers"], n_embd=SIZE["width"], block_size=SIZE["seq"], optimizer=make_optimizer("adamw"))
    batches = random_batches(steps, batch_size=SIZE["batch"], block=SIZE["seq"])
    losses = fit(model, batches, strategy=AsyncPipelineStrategy(schedule=schedule, num_microbatches=microbatches),
                 accelerator="gpu")
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 2:
        sys.exit(f"Found {gpus} GPU(s); a pipeline check needs at least 2.")
    rows = []
    stage_counts = [p for p in (2, 4, 8) if p <= gpus]
    for stages in stage_counts:
        microbatches = 2 * stages
        for schedule in ("2bw", "1f1b"):
            with tempfile.TemporaryDirectory() as tmp:
                result, weights = pipeline(stages, schedule, microbatches, args.steps, Path(tmp))
            ref_losses, ref_weights = reference(schedule, microbatches, args.steps)
            loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(result["losses"], ref_losses))
            weight_diff = max(((weights[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item() for k, v in ref_weights.items())
            seconds = statistics.median(result["step_seconds"][len(result["step_seconds"]) // 4 :])
            bubbles = {s: round(statistics.median(b[len(b) // 4 :]), 3) for s, b in result["stage_bubbles"].items()}
            rows.append({
                "stages": stages, "schedule": schedule, "microbatches": microbatches,
                "max_rel_loss_diff": loss_diff, "max_rel_weight_diff": weight_diff,
                "tokens_per_sec": SIZE["batch"] * SIZE["seq"] / seconds, "bubble_fraction": bubbles,
            })
    print(f"{'P':>3} {'schedule':>8} {'M':>3} {'loss diff':>10} {'weight diff':>11} {'tokens/s':>10}  bubble per stage")
    for r in rows:
        print(f"{r['stages']:>3} {r['schedule']:>8} {r['microbatches']:>3} {r['max_rel_loss_diff']:>10.2e} "
              f"{r['max_rel_weight_diff']:>11.2e} {r['tokens_per_sec']:>10.0f}  {r['bubble_fraction']}")
    Path(args.out).write_text(json.dumps({"gpus": gpus, "device": torch.cuda.get_device_name(0), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
