"""What the benchmark scripts share: the description of the machine a report was measured on."""

from __future__ import annotations

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
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


def save_report(report: dict[str, Any], out: str | None) -> None:
    """Write a benchmark report as indented JSON to ``out`` (creating its folder); nothing if ``out`` is None."""
    if out:
        import json
        from pathlib import Path

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1))
