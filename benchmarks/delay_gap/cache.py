"""The run cache: every run is a process whose result is kept in the work folder under its spec's hash."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .spec import MOE_FIELDS, ROOT, RunSpec, portable_path


class Runner:
    """Runs specs as subprocesses, ``jobs`` at a time, and caches their results by hash.

    Args:
        work_dir: The folder of the cached results, specs and logs (created).
        jobs: How many runs at a time.
        timeout: Seconds a run may take.
        verbose: Print a line per trained run.
        in_process: Train the one-device runs in this process, one at a time (no isolation).
    """

    def __init__(
        self, work_dir: Path, jobs: int, timeout: float, verbose: bool = True, in_process: bool = False
    ) -> None:
        self.work_dir = work_dir
        self.jobs = 1 if in_process else max(1, jobs)
        self.timeout = timeout
        self.verbose = verbose
        self.in_process = in_process
        # Keys of the runs read from the cache and of those trained here: a run trained in one phase (the
        # learning-rate grid) and read back in a later one (the main table) counts as trained, once.
        self.cached: set[str] = set()
        self.trained: set[str] = set()
        work_dir.mkdir(parents=True, exist_ok=True)

    def result_path(self, spec: RunSpec) -> Path:
        return self.work_dir / f"{spec.key()}.json"

    def run_one(self, spec: RunSpec) -> dict[str, Any]:
        """The result of ``spec``: from the cache, or trained now (and cached)."""
        path = self.result_path(spec)
        if path.exists():
            self.cached.add(spec.key())
            return {**json.loads(path.read_text()), "run_id": spec.key()}
        spec_path = self.work_dir / f"{spec.key()}.spec.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        self.trained.add(spec.key())
        if self.in_process and spec.devices == 1:
            from .train import worker_main  # torch and Lightning only where a run trains

            worker_main(str(spec_path), str(path))
            return {**json.loads(path.read_text()), "run_id": spec.key()}
        start = time.perf_counter()
        self._run_worker(spec, spec_path, path)
        result = json.loads(path.read_text())
        if self.verbose:
            final = result["final_val_loss"]
            shown = f"{final:.4f}" if final is not None else "diverged"
            print(f"  [{time.perf_counter() - start:6.1f} s] {spec.label():<60} final val loss {shown}", flush=True)
        return {**result, "run_id": spec.key()}

    def _run_worker(self, spec: RunSpec, spec_path: Path, path: Path) -> None:
        log_path = self.work_dir / f"{spec.key()}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The package and the benchmarks are importable from the repository even when nothing is installed.
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        command = [sys.executable, "-m", __package__, "--worker", str(spec_path), "--result", str(path)]
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=self.timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        if code != 0 or not path.exists():
            tail = log_path.read_text()[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"Run '{spec.label()}' failed ({code}); log {log_path}:\n{tail}")

    def run_all(self, specs: list[RunSpec]) -> list[dict[str, Any]]:
        """The results of ``specs``, in order; each distinct spec runs once."""
        unique = list(dict.fromkeys(specs))
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            results = dict(zip(unique, pool.map(self.run_one, unique)))
        return [results[s] for s in specs]


def reuse_runs(runner: Runner, reports: list[str], corpus: str | None) -> int:
    """Put the runs recorded in earlier ``--out`` reports into ``runner``'s cache, so that a protocol interrupted
    on one machine continues on another.

    A run is taken only if it was trained on the same corpus; its cache key is recomputed with this machine's
    path to it.

    Args:
        runner: The runner whose work folder receives the runs.
        reports: Paths of JSON reports written by ``--out``.
        corpus: This machine's corpus path (``None``: the embedded text).

    Returns:
        How many runs were added.
    """
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    added = 0
    for report in reports:
        for run in json.loads(Path(report).read_text())["runs"]:
            # Runs recorded before the experts' fields existed are dense runs: they take the defaults.
            if run.get("corpus") != portable_path(corpus) or fields - {"corpus", *MOE_FIELDS} - set(run):
                continue
            spec = RunSpec(**{**{k: run[k] for k in fields - {"corpus"} if k in run}, "corpus": corpus})
            path = runner.result_path(spec)
            if not path.exists():
                result = {k: v for k, v in run.items() if k not in ("kind", "run_id")}
                path.write_text(json.dumps(result))
                added += 1
    return added
