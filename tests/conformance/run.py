"""Run a folder of Lightning's own tests with the strategy injected, and summarise what differs.

    python tests/conformance/run.py --form async_pp --folder trainer
    python tests/conformance/run.py --form microbatches --folder trainer/test_trainer.py -k "checkpoint"
    make conformance FORM=microbatches FOLDER=callbacks

``--form none`` records the tests as they are (the baseline). The suite is Lightning's ``tests/tests_pytorch``
(``--suite``, default ``../shared/lightning-tests`` beside the checkout, or ``$LIGHTNING_TESTS``); the package
tested is the one under ``--package`` (default: this checkout). Each run writes, under ``--out`` (default
``runs/conformance``),
``<form>-<name>.jsonl`` (one line a test, from the plugin :mod:`async_pp_conformance`) and ``<form>-<name>.json``
/ ``.txt``: the summary. ``--only-injected RECORDS`` runs only the tests into which an earlier run (its
``.jsonl``) injected a strategy: the injection does not depend on the form, and the other tests run as they are.

**The selection** is the tests that pass as they are (passed in the ``none`` run of the same name, when there
is one; otherwise the tests not skipped) and exercise the strategy: an injected strategy's ``setup`` ran in the
test (with ``microbatches``, on a pipeline module). Of these, the summary counts those that pass, and lists each
that fails with the reason ``differences.txt`` gives, or as unexplained.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Lightning's suite lies in shared/ beside the checkout (see its README).
SHARED_SUITE = HERE.parents[2] / "shared" / "lightning-tests"
FORMS = ("none", "async_pp", "microbatches")


def read_differences(path: Path) -> list[tuple[str, str, str]]:
    """``(form, nodeid prefix, reason)`` of each line ``<form|both> <nodeid prefix> -- <reason>`` of ``path``."""
    entries = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, reason = line.partition(" -- ")
        form, _, prefix = head.strip().partition(" ")
        if form not in ("both", "async_pp", "microbatches") or not prefix.strip() or not reason.strip():
            raise ValueError(f"{path}: a line must read `<both|async_pp|microbatches> <nodeid> -- <reason>`: {line!r}")
        entries.append((form, prefix.strip(), reason.strip()))
    return entries


def reason_for(nodeid: str, form: str, differences: list[tuple[str, str, str]]) -> str | None:
    """The listed reason why ``nodeid`` differs in ``form``: the entry whose nodeid is the test's, or a prefix of
    it (a file, a test without its parameters)."""
    for listed_form, prefix, reason in differences:
        if listed_form in ("both", form) and (nodeid == prefix or nodeid.startswith((prefix + "[", prefix + "::"))):
            return reason
        if listed_form in ("both", form) and prefix.endswith(".py") and nodeid.startswith(prefix + "::"):
            return reason
    return None


def read_records(path: Path) -> dict[str, dict]:
    records = {}
    if path.exists():
        for line in path.read_text().splitlines():
            record = json.loads(line)
            records[record["nodeid"]] = record
    return records


def summarise(form: str, records: dict[str, dict], baseline: dict[str, dict] | None, differences: list) -> dict:
    """Counts of the run, the selection and its failures, each with its listed reason or none."""

    def passes_as_is(nodeid: str, record: dict) -> bool:
        if baseline is not None:
            return baseline.get(nodeid, {}).get("outcome") == "passed"
        return record["outcome"] != "skipped"

    def exercises(record: dict) -> bool:
        return record["exercised"] and (form != "microbatches" or record["pipeline"])

    selected = {n: r for n, r in records.items() if form != "none" and exercises(r) and passes_as_is(n, r)}
    failing = {n: r for n, r in selected.items() if r["outcome"] != "passed"}
    listed = {n: reason_for(n, form, differences) for n in failing}
    unexplained = sorted(n for n, reason in listed.items() if reason is None)
    stale = sorted(n for n, r in selected.items() if r["outcome"] == "passed" and reason_for(n, form, differences))
    causes = Counter(failing[n]["message"][:160] for n in unexplained)
    return {
        "form": form,
        "tests": len(records),
        "outcomes": dict(Counter(r["outcome"] for r in records.values())),
        "baseline": baseline is not None,
        "selected": len(selected),
        "passed": len(selected) - len(failing),
        "pass_rate": round((len(selected) - len(failing)) / len(selected), 4) if selected else None,
        "listed": {n: reason for n, reason in sorted(listed.items()) if reason is not None},
        "unexplained": {n: failing[n]["message"] for n in unexplained},
        "causes": dict(causes.most_common()),
        "listed_but_passing": stale,
        "refused_plain_modules": sorted(
            n for n, r in records.items() if form == "microbatches" and r["exercised"] and not r["pipeline"]
        ),
    }


def as_text(name: str, summary: dict) -> str:
    lines = [
        f"{summary['form']} {name}: {summary['tests']} tests {summary['outcomes']}",
        f"selection (passes as is{'' if summary['baseline'] else ' [no baseline: not skipped]'}, exercises the "
        f"strategy): {summary['selected']}; pass: {summary['passed']} ({summary['pass_rate']})",
        f"failing, listed with a reason: {len(summary['listed'])}; unexplained: {len(summary['unexplained'])}",
    ]
    lines += ["", "unexplained failures by cause:"] + [f"  {n:4d}  {c}" for c, n in summary["causes"].items()]
    lines += ["", "unexplained:"] + [f"  {n}  {m}" for n, m in summary["unexplained"].items()]
    lines += ["", "listed:"] + [f"  {n}  -- {r}" for n, r in summary["listed"].items()]
    lines += ["", "listed but passing (remove from the list):"] + [f"  {n}" for n in summary["listed_but_passing"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--form", choices=FORMS, default="async_pp")
    parser.add_argument("--folder", default="trainer", help="a folder or file under tests/tests_pytorch")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k expression")
    parser.add_argument("--name", default=None, help="the name of the outputs (default: from --folder and -k)")
    parser.add_argument("--suite", default=os.environ.get("LIGHTNING_TESTS", str(SHARED_SUITE)))
    parser.add_argument("--package", default=str(HERE.parents[1]), help="the checkout whose package is tested")
    parser.add_argument("--out", default="runs/conformance")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test")
    parser.add_argument(
        "--only-injected",
        default=None,
        metavar="RECORDS",
        help="run only the tests into which a strategy was injected in the run that wrote RECORDS (a .jsonl of the "
        "same folder): the others run as they are in any form",
    )
    parser.add_argument("--summarise-only", action="store_true", help="summarise an earlier run's records")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = parser.parse_args(argv)

    suite, out = Path(args.suite).resolve(), Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", args.folder + (f"-k-{args.keyword}" if args.keyword else ""))
    report = out / f"{args.form}-{name}.jsonl"
    status = 0
    if not args.summarise_only:
        report.unlink(missing_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.package, str(HERE), env.get("PYTHONPATH")) if p)
        env.update(
            ASYNC_PP_CONFORMANCE_FORM=args.form,
            ASYNC_PP_CONFORMANCE_REPORT=str(report),
            ASYNC_PP_CONFORMANCE_TIMEOUT=str(args.timeout),
            PYTHONDONTWRITEBYTECODE="1",
        )
        command = [sys.executable, "-m", "pytest", "-c", str(suite / "pytest.ini"), "--rootdir", str(suite)]
        if args.only_injected:
            injected = [n for n, r in read_records(Path(args.only_injected)).items() if r["injected"]]
            command += [str(suite / nodeid) for nodeid in injected]
        else:
            command += [str(suite / "tests" / "tests_pytorch" / args.folder)]
        command += ["-p", "async_pp_conformance"]
        command += ["-p", "no:cacheprovider", "-q", "-o", "console_output_style=classic"]
        command += ["--continue-on-collection-errors"]  # e.g. test_legacy_checkpoints.py: its data is not copied
        command += ["-k", args.keyword] if args.keyword else []
        command += args.pytest_args
        with tempfile.TemporaryDirectory(prefix="conformance-") as cwd:  # tests may write to the working directory
            status = subprocess.call(command, cwd=cwd, env=env)
    baseline_path = out / f"none-{name}.jsonl"
    baseline = read_records(baseline_path) if baseline_path.exists() and args.form != "none" else None
    summary = summarise(args.form, read_records(report), baseline, read_differences(HERE / "differences.txt"))
    (out / f"{args.form}-{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = as_text(name, summary)
    (out / f"{args.form}-{name}.txt").write_text(text)
    print(text.split("\n\n")[0])
    return 0 if status in (0, 1) else status


if __name__ == "__main__":
    sys.exit(main())
