"""The action IR: printed actions parse back to the same action, malformed ones are refused, and the
schedule layer stays pure Python."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_async_pp.schedule import SCHEDULES, Action, Op, build_schedule, evaluation_actions, gpipe_schedule

SCHEDULE_DIR = Path(__file__).resolve().parents[3] / "lightning_async_pp" / "schedule"


def grid():
    """(kind, P, M) with M = P, P + 1 and 2P, and for 1f1b also M < P."""
    for P in (1, 2, 3, 4, 8):
        for M in sorted({1, max(1, P // 2), P, P + 1, 2 * P}):
            for kind in SCHEDULES:
                if kind == "2bw" and M < P:
                    continue
                yield kind, P, M


def assert_round_trip(a: Action, kind: str | None) -> None:
    text = str(a)
    parsed = Action.from_str(text, a.num_microbatches or None, kind=kind)
    assert parsed == a, (text, parsed, a)
    assert (parsed.num_microbatches, str(parsed)) == (a.num_microbatches, text)


@pytest.mark.parametrize("with_comm", [True, False], ids=["comm", "compute"])
@pytest.mark.parametrize("kind,P,M", list(grid()))
def test_from_str_inverts_str_over_schedules(kind, P, M, with_comm):
    sched = build_schedule(kind, P, M, num_steps=5, with_comm=with_comm, run_starts=(0, 3))
    actions = [a for stage in sched.stages for a in stage]
    assert actions and all(a.num_microbatches == M for a in actions)
    ops = {a.op for a in actions}
    assert ops == (set(Op) if with_comm and P > 1 else {Op.FORWARD, Op.BACKWARD, Op.UPDATE})
    for a in actions:
        assert_round_trip(a, kind)
        # The same action built without num_microbatches prints, and parses, as <step>.<microbatch>.
        assert_round_trip(dataclasses.replace(a, num_microbatches=0), kind)


@pytest.mark.parametrize("P", [1, 2, 4])
def test_from_str_inverts_str_for_evaluation_and_gpipe(P):
    for stage in range(P):
        for index in range(3):
            for a in evaluation_actions(P, stage, index, num_microbatches=index + 1):
                assert_round_trip(a, None)
    # GPipe uses version t at step t, as 1f1b does.
    for a in (a for stage in gpipe_schedule(P, 2 * P, 3).stages for a in stage):
        assert_round_trip(a, "1f1b")


def test_from_str_examples():
    assert Action.from_str("0F3", 2, kind="2bw") == Action(0, Op.FORWARD, 1, 1, 0)
    assert Action.from_str("1RB2", 4, kind="1f1b") == Action(1, Op.RECV_B, 0, 2, 0)
    assert Action.from_str("12SF13", 4, kind="2bw") == Action(12, Op.SEND_F, 3, 1, 2)
    assert Action.from_str("0U1") == Action(0, Op.UPDATE, 1, -1, 2)
    assert Action.from_str("0F1.3", kind="1f1b") == Action(0, Op.FORWARD, 1, 3, 1)
    assert Action.from_str("2RF-1.0") == Action(2, Op.RECV_F, -1, 0, 0)
    assert Action.from_str("0F1.3", 4, kind="2bw").num_microbatches == 0
    assert Action.from_str("0U1", 4).num_microbatches == 4


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "is not an action"),
        ("F3", "is not an action"),
        ("0X3", "is not an action"),
        ("0F", "is not an action"),
        ("0F3 ", "is not an action"),
        (" 0F3", "is not an action"),
        ("0f3", "is not an action"),
        ("-1F3", "is not an action"),
        ("0F1.", "is not an action"),
        ("0F1.-2", "is not an action"),
        ("0F1.2.3", "is not an action"),
        ("0SFB3", "is not an action"),
        ("0U1.2", "an update names its step only"),
        ("00F3", "is not how the action prints"),
        ("0F03", "is not how the action prints"),
        ("0F-0.1", "is not how the action prints"),
        ("0F1.03", "is not how the action prints"),
    ],
)
def test_from_str_refuses_malformed(text, message):
    with pytest.raises(ValueError, match=message):
        Action.from_str(text, 4, kind="2bw")


def test_from_str_refuses_what_it_cannot_know():
    with pytest.raises(ValueError, match="pass num_microbatches"):
        Action.from_str("0F3", kind="2bw")
    with pytest.raises(ValueError, match="depends on the schedule; pass kind"):
        Action.from_str("0F3", 4)
    with pytest.raises(ValueError, match="depends on the schedule; pass kind"):
        Action.from_str("1SB0.2")
    with pytest.raises(ValueError, match="unknown pipeline schedule 'gpipe'"):
        Action.from_str("0F3", 4, kind="gpipe")
    with pytest.raises(ValueError, match=r"micro-batch 5 is not below num_microbatches=4"):
        Action.from_str("0F1.5", 4, kind="2bw")
    with pytest.raises(ValueError, match="num_microbatches must be >= 1"):
        Action.from_str("0F3", 0, kind="2bw")
    with pytest.raises(ValueError, match="is parsed from a str"):
        Action.from_str(b"0F3", 4, kind="2bw")


# --------------------------------------------------------------------------- purity


def test_schedule_modules_import_only_the_stdlib_and_each_other():
    """Every import under schedule/ names the standard library or lightning_async_pp.schedule; the one
    exception is matplotlib, an optional dependency imported inside the function that draws."""
    optional = {"matplotlib"}
    files = sorted(SCHEDULE_DIR.glob("*.py"))
    assert {f.name for f in files} >= {"ir.py", "generate.py", "verify.py", "transfers.py", "simulate.py"}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(node) for node in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path.name}:{node.lineno}: relative import"
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                pure = root in sys.stdlib_module_names or name.startswith("lightning_async_pp.schedule")
                lazy = root in optional and id(node) not in top_level
                assert pure or lazy, f"{path.name}:{node.lineno} imports {name}"


def test_schedule_imports_without_torch():
    # lightning_async_pp/__init__.py imports torch, so stand in an empty package for it.
    code = f"""
import importlib, sys, types
package = types.ModuleType("lightning_async_pp")
package.__path__ = [{str(SCHEDULE_DIR.parent)!r}]
sys.modules["lightning_async_pp"] = package
for name in ("schedule", "schedule.ir", "schedule.generate", "schedule.verify", "schedule.transfers",
             "schedule.simulate", "schedule.partition"):
    importlib.import_module("lightning_async_pp." + name)
schedule = sys.modules["lightning_async_pp.schedule"]
schedule.check(schedule.build_schedule("2bw", 2, 2, 2))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning", "numpy"))
assert not heavy, heavy
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
