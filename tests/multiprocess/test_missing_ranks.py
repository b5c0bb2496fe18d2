"""A job started with more ranks than run (``--trainer.num_nodes 2`` on one machine) says early what it waits for,
at which address, and fails at the strategy's timeout with the same message."""

from __future__ import annotations

import re
import sys

import pytest

from tests.fixtures.helpers import run_script

pytestmark = pytest.mark.multiprocess


def test_num_nodes_2_on_one_machine_names_the_awaited_ranks_and_fails_at_the_timeout():
    command = [
        sys.executable,
        "-m",
        "tests.multiprocess.scripts.missing_node_run",
        "--num-nodes",
        "2",
        "--devices",
        "1",
        "--timeout",
        "6",
    ]
    returncode, output = run_script(command, 240)
    assert returncode != 0, output[-4000:]
    awaited = re.search(
        r"Waiting for all 2 ranks of the job \(num_nodes=2 x devices=1\) to join at [\w.:]+:\d+", output
    )
    assert awaited, output[-4000:]
    failed = output.find("could not join the job")
    assert failed > awaited.start(), output[-4000:]  # said while waiting, then repeated in the error
    error = output[failed:]
    assert "strategy's timeout (0:00:06)" in error and "`--trainer.num_nodes 1`" in error, error[:2000]
