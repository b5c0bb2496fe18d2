"""What the benchmark scripts share: the description of the machine a report was measured on, saving a report,
starting a job's ranks, reading the heap in use, and dynamo's compilation counts."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from pathlib import Path
from typing import Any


def machine_description() -> dict[str, Any]:
    """CPU model, core count, platform and versions, for the ``machine`` field of a benchmark report."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def dynamo_counts() -> dict[str, int]:
    """Dynamo's compiled frames, unique graphs, recompilations and graph breaks so far in this process."""
    from torch._dynamo.utils import counters

    return {
        "frames": int(counters["frames"]["total"]),
        "unique_graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": sum(counters["recompiles"].values()),
        "graph_breaks": sum(counters["graph_break"].values()),
    }


def save_report(report: dict[str, Any], out: str | None) -> None:
    """Write a benchmark report as indented JSON to ``out`` (creating its folder); nothing if ``out`` is None."""
    if out:
        import json
        from pathlib import Path

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))


def save_report_and_table(report: dict[str, Any], table: str, out: str | None, markdown: str | None) -> None:
    """Print ``table``, write ``report`` as JSON to ``out`` and ``table`` to ``markdown`` (default: ``out`` with
    the suffix ``.md``); nothing is written where neither is given."""
    print(table)
    save_report(report, out)
    target = markdown or (str(Path(out).with_suffix(".md")) if out else None)
    if target:
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        Path(target).write_text(table + "\n")


def run_ranks(
    command: list[str], envs: list[dict[str, str]], logs: list[Any], timeout: float, cwd: str | None = None
) -> int | None:
    """Start one process of ``command`` per entry of ``envs`` at once, as torchrun does, and wait for them.

    The processes share one process group (the first one's), killed whole at the end, so a failed or timed-out
    job leaves nothing behind (nor anything its ranks started). ``logs`` are the files their output goes to.

    Returns:
        0 when every process exited with 0, the first non-zero exit status, or ``None`` after ``timeout`` seconds.
    """
    import signal
    import subprocess
    import time

    procs: list[subprocess.Popen] = []
    deadline = time.perf_counter() + timeout
    try:
        for env, log in zip(envs, logs):
            procs.append(
                subprocess.Popen(
                    command,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                    process_group=0 if not procs else procs[0].pid,
                )
            )
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                return failed[0] if failed else 0
            if time.perf_counter() > deadline:
                return None
            time.sleep(0.05)
    finally:
        try:
            os.killpg(procs[0].pid, signal.SIGKILL)  # only what is left: a failed or timed-out job
        except (ProcessLookupError, IndexError):
            pass
        for proc in procs:
            proc.wait()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.cache
def _mallinfo2():
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int | None:
    """Bytes the allocator has handed out and not got back (glibc ``mallinfo2``: ``uordblks``, small blocks, plus
    ``hblkhd``, mmapped large blocks); CPU tensors are allocated through it. ``None`` where glibc is not the
    allocator."""
    function = _mallinfo2()
    if function is None:
        return None
    info = function()
    return info.uordblks + info.hblkhd
