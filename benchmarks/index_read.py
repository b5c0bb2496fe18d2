"""Cost of reading a checkpoint's index (DCP's ``.metadata``) through the checks of
:mod:`lightning_async_pp.checkpoint.safe`, for an index of ``--entries`` tensors.

The index is written by ``torch.distributed.checkpoint`` itself (``dcp.save`` of ``--entries`` small tensors into
one shard), then read ``--rounds`` times with :func:`~lightning_async_pp.checkpoint.read_index` (the unpickler
with its allow-list, the rebuilt index and the shard checks); the report gives the median and best times and,
for scale, the time of Python's C unpickler (``pickle.loads``, which checks nothing) on the same bytes. CPU
times are reported too: on a shared machine they vary less than wall-clock times. To compare with another
version of the package, run the script with that version first on ``PYTHONPATH``.

    python benchmarks/index_read.py --out benchmarks/results/index_read/index_read.json
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from bench_common import machine_description, save_report
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from lightning_async_pp.checkpoint import read_index


def write_index(path: Path, entries: int) -> None:
    """A checkpoint of ``entries`` tensors (one per key, as this strategy saves them), in one shard."""
    state = {f"state_dict.layers.{i}.weight": torch.zeros(2, 2) for i in range(entries)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(
            state,
            storage_writer=FileSystemWriter(path),
            planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
            no_dist=True,
        )


def timed(function, *args) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one call (the CPU time of this process is what other load disturbs least)."""
    wall, cpu = time.perf_counter(), time.process_time()
    function(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "index.ckpt"
        write_index(path, args.entries)
        data = (path / ".metadata").read_bytes()
        read_index(path)  # warm up
        safe = [timed(read_index, path) for _ in range(args.rounds)]
        plain = [timed(pickle.loads, data) for _ in range(args.rounds)]
        entries = len(read_index(path).state_dict_metadata)
    report = {
        "benchmark": "index_read",
        "machine": machine_description(),
        "entries": entries,
        "index_bytes": len(data),
        "rounds": args.rounds,
        "read_index_median_s": statistics.median(w for w, _ in safe),
        "read_index_min_s": min(w for w, _ in safe),
        "read_index_cpu_median_s": statistics.median(c for _, c in safe),
        "read_index_cpu_min_s": min(c for _, c in safe),
        "pickle_loads_median_s": statistics.median(w for w, _ in plain),
    }
    print(
        f"{entries} entries ({len(data):,} bytes): read_index {report['read_index_median_s'] * 1e3:.1f} ms "
        f"(best {report['read_index_min_s'] * 1e3:.1f}; CPU {report['read_index_cpu_median_s'] * 1e3:.1f}, best "
        f"{report['read_index_cpu_min_s'] * 1e3:.1f}), pickle.loads {report['pickle_loads_median_s'] * 1e3:.1f} ms"
    )
    save_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
