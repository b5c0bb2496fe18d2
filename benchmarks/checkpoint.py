"""Checkpoint save and load: gather-to-rank-0 (one file) against torch.distributed.checkpoint (one shard per stage).

For each model size and pipeline depth P, one job of P processes trains two steps of the demo GPT with
``DelayCorrected(AdamW)`` and gradient clipping, then every rank measures, one method after the other:

* ``gather``: what the strategy did before sharded checkpoints: every stage pickles its weights, ``w[t-1]`` and
  optimizer state to rank 0 (``gather_object``), which writes one ``torch.save`` file; loading, every rank reads
  the whole file;
* ``dcp``: ``trainer.save_checkpoint`` through :class:`~lightning_async_pp.checkpoint.ShardedCheckpointIO`, each
  stage writing its own shard; loading, each stage reads its own tensors;
* ``dcp_async``: the same with ``async_save=True``: the time the caller is held (the tensors are staged, then
  written in the background) and the time until the checkpoint is complete.

Per rank: wall seconds and the peak of the heap above its level before the operation (glibc ``mallinfo2``,
sampled every 0.5 ms by a thread; CPU tensors are allocated there), next to ``share_mb``, the bytes of the
rank's own stage state (weights, ``w[t-1]``, optimizer state). Rank 0 is the last stage.

Usage::

    python benchmarks/checkpoint.py --out benchmarks/results/checkpoint/checkpoint.json  # sizes 1x 4x 16x, P 2 and 4
    python benchmarks/checkpoint.py --sizes 1 --stages 4 --out /tmp/checkpoint.json   # one cell
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import heap_in_use, machine_description

from lightning_async_pp.strategy.checkpointing import base_checkpoint_io

ROOT = Path(__file__).resolve().parents[1]
DEMO = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
"""The demo GPT's size (examples/configs/quickstart.yaml); ``size`` k multiplies its width by sqrt(k)."""
WIDTH = {1: 128, 4: 256, 16: 512}


class HeapPeak:
    """Highest heap in use (``mallinfo2``: ``uordblks + hblkhd``) while the ``with`` block runs, above its start."""

    def __init__(self) -> None:
        self.peak_mb: float | None = None

    def __enter__(self) -> HeapPeak:
        self._start = heap_in_use()
        if self._start is None:
            return self
        self._peak = self._start
        self._running = True

        def sample() -> None:
            while self._running:
                self._peak = max(self._peak, heap_in_use())
                time.sleep(0.0005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._start is None:
            return
        self._running = False
        self._thread.join()
        self._peak = max(self._peak, heap_in_use())
        self.peak_mb = (self._peak - self._start) / 2**20


def _bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(v) for v in obj)
    return 0


def gather_save(strategy: Any, checkpoint: dict[str, Any], path: Path) -> None:
    """The former save: every stage's state pickled to rank 0 (``gather_object``), one ``torch.save`` file."""
    import torch.distributed as dist

    optimizer = strategy.optimizers[0]
    state = {
        "stage": strategy.stage,
        "previous": strategy.pipeline_stage.previous_weights(strategy.lightning_module),
        "optimizer": optimizer.state_dict(),
        "state_dict": checkpoint["state_dict"],
    }
    gathered = [None] * dist.get_world_size() if strategy.is_global_zero else None
    dist.gather_object(state, gathered, dst=0)
    if strategy.is_global_zero:
        checkpoint = dict(checkpoint)
        checkpoint["state_dict"] = {k: v for s in gathered for k, v in s["state_dict"].items()}
        checkpoint["async_pp"] = {"stages": [{k: v for k, v in s.items() if k != "state_dict"} for s in gathered]}
        checkpoint.pop("optimizer_states", None)
        torch.save(checkpoint, path)
        del gathered, checkpoint
    dist.barrier()


def save_timed(strategy: Any, dump: dict[str, Any], method: str, path: Path, record: dict[str, Any]) -> None:
    """Save ``dump`` to ``path`` by ``method``, recording the seconds and the heap peak."""
    import torch.distributed as dist

    dist.barrier()
    begin = time.perf_counter()
    with HeapPeak() as heap:
        if method == "gather":
            gather_save(strategy, dump, path)
        else:
            io = base_checkpoint_io(strategy.checkpoint_io)
            io.async_save = method == "dcp_async"
            strategy.save_checkpoint(dict(dump), path)
            if method == "dcp_async":
                record["dcp_async_blocking_s"] = io.last_save_blocking_seconds
                io.wait()
                dist.barrier()
            io.async_save = False
    record[f"{method}_save_s"] = time.perf_counter() - begin
    record[f"{method}_save_peak_mb"] = heap.peak_mb


def load_timed(trainer: Any, module: Any, method: str, path: Path, record: dict[str, Any]) -> None:
    """Read this rank's stage back from ``path``, recording the seconds, the heap peak and the size on disk."""
    import torch.distributed as dist

    from lightning_async_pp import checkpoint as sharded

    strategy = trainer.strategy
    dist.barrier()
    begin = time.perf_counter()
    with HeapPeak() as heap:
        if method == "gather":
            # The gathered file holds every stage: each rank reads all of it to keep its own.
            loaded = torch.load(path, weights_only=True)
            assert len(loaded["async_pp"]["stages"]) > strategy.stage, "the gathered file lacks this stage"
            del loaded
        else:
            index = sharded.read_index(path)
            sharded.load_stage(
                path,
                index,
                state_dict=module.state_dict(),
                module=module,
                optimizer=strategy.optimizers[0],
                previous=strategy.pipeline_stage.previous_weights(module),
                stage=strategy.stage,
                process_group=strategy.process_groups.checkpoint,
            )
    dist.barrier()
    record[f"{method}_load_s"] = time.perf_counter() - begin
    record[f"{method}_load_peak_mb"] = heap.peak_mb
    if path.exists() and trainer.global_rank == 0:
        size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.iterdir())
        record[f"{method}_bytes_mb"] = size / 2**20


def measure(trainer: Any, module: Any, methods: list[str], out: Path) -> dict[str, Any]:
    """This rank's record: its stage's share, then each method's save and load."""
    from lightning_async_pp import checkpoint as sharded

    strategy = trainer.strategy
    share = _bytes(
        sharded.stage_shard(
            module.state_dict(),
            strategy.optimizers[0],
            module,
            strategy.pipeline_stage.previous_weights(module),
            strategy.stage,
        )
    )
    record = {"rank": trainer.global_rank, "stage": strategy.stage, "share_mb": share / 2**20}
    dump = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    for method in methods:
        path = out / f"{method}.ckpt"
        save_timed(strategy, dump, method, path, record)
        if method != "dcp_async":
            load_timed(trainer, module, method, path, record)
    return record


def worker(args: argparse.Namespace) -> None:
    """One rank of the job (Lightning's launcher starts the others by re-running this command)."""
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.demos import GPT
    from lightning_async_pp.demos.data import random_token_batches
    from lightning_async_pp.optim import DelayCorrected

    torch.set_num_threads(1)
    out = Path(args.out_dir)
    records: list[dict[str, Any]] = []

    class Measure(Callback):
        def on_train_end(self, trainer: Trainer, module: Any) -> None:
            records.append(measure(trainer, module, args.methods, out))

    width = WIDTH[args.size]
    model = GPT(
        **{**DEMO, "n_embd": width, "block_size": 32},
        lr_schedule="constant",
        optimizer=lambda p: DelayCorrected(torch.optim.AdamW(p, lr=1e-3)),
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=args.stages,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=1.0,
        callbacks=[Measure()],
        strategy=AsyncPipelineStrategy(
            num_microbatches=args.stages, timeout=__import__("datetime").timedelta(minutes=5)
        ),
    )
    # Each item is already a batch; batch_size=None hands it through unchanged.
    batches = random_token_batches(2, batch_size=args.stages, block_size=32)
    trainer.fit(model, DataLoader(batches, batch_size=None, shuffle=False))
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(records[0]))


def run_cell(size: int, stages: int, methods: list[str], scratch: Path, timeout: float) -> dict[str, Any]:
    directory = scratch / f"size{size}_P{stages}"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--size",
        str(size),
        "--stages",
        str(stages),
        "--methods",
        *methods,
        "--out-dir",
        str(directory),
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"size {size} P={stages} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    ranks = [json.loads((directory / f"rank{r}.json").read_text()) for r in range(stages)]
    shutil.rmtree(directory, ignore_errors=True)
    parameters = sum(p.numel() for p in _model(size).parameters())
    return {"size": size, "stages": stages, "parameters": parameters, "ranks": ranks}


def _model(size: int):
    from lightning_async_pp.demos import GPT

    return GPT(**{**DEMO, "n_embd": WIDTH[size], "block_size": 32}, lr_schedule="constant")


def summarize(cell: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's numbers and the slowest rank's times, with the ratios gather / dcp."""
    rank0 = next(r for r in cell["ranks"] if r["rank"] == 0)
    out = {
        "size": cell["size"],
        "P": cell["stages"],
        "parameters": cell["parameters"],
        "rank0_share_mb": rank0["share_mb"],
    }
    for method in ("gather", "dcp", "dcp_async"):
        if f"{method}_save_s" not in rank0:
            continue
        out[f"{method}_save_s"] = max(r[f"{method}_save_s"] for r in cell["ranks"])
        out[f"{method}_rank0_save_peak_mb"] = rank0[f"{method}_save_peak_mb"]
        if f"{method}_load_s" in rank0:
            out[f"{method}_load_s"] = max(r[f"{method}_load_s"] for r in cell["ranks"])
            out[f"{method}_max_load_peak_mb"] = max(r[f"{method}_load_peak_mb"] for r in cell["ranks"])
    if "dcp_async_blocking_s" in rank0:
        out["dcp_async_blocking_s"] = max(r["dcp_async_blocking_s"] for r in cell["ranks"])
    if "gather_save_s" in out and "dcp_save_s" in out:
        out["save_time_ratio_gather_over_dcp"] = out["gather_save_s"] / out["dcp_save_s"]
        out["load_time_ratio_gather_over_dcp"] = out["gather_load_s"] / out["dcp_load_s"]
        out["rank0_save_peak_ratio_gather_over_dcp"] = out["gather_rank0_save_peak_mb"] / max(
            out["dcp_rank0_save_peak_mb"], 1e-6
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| size | P | params | rank-0 share MB | save s gather / dcp / async held | load s gather / dcp "
        "| rank-0 save peak MB gather / dcp | max load peak MB gather / dcp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    for r in rows:
        lines.append(
            f"| {r['size']}x | {r['P']} | {r['parameters'] / 1e6:.1f}M | {r['rank0_share_mb']:.1f} | "
            f"{r.get('gather_save_s', nan):.2f} / {r.get('dcp_save_s', nan):.2f} / "
            f"{r.get('dcp_async_blocking_s', nan):.2f} | "
            f"{r.get('gather_load_s', nan):.2f} / {r.get('dcp_load_s', nan):.2f} | "
            f"{r.get('gather_rank0_save_peak_mb', nan):.1f} / {r.get('dcp_rank0_save_peak_mb', nan):.1f} | "
            f"{r.get('gather_max_load_peak_mb', nan):.1f} / {r.get('dcp_max_load_peak_mb', nan):.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16], choices=sorted(WIDTH))
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=["gather", "dcp", "dcp_async"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--scratch", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        args.stages = args.stages[0]
        worker(args)
        return {}
    import tempfile

    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="checkpoint_bench_"))
    cells = [
        run_cell(size, stages, args.methods, scratch, args.timeout) for size in args.sizes for stages in args.stages
    ]
    rows = [summarize(cell) for cell in cells]
    report = {"machine": machine_description(), "methods": args.methods, "rows": rows, "cells": cells}
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        Path(args.out).with_suffix(".md").write_text(table(rows) + "\n")
    return report


if __name__ == "__main__":
    main()
