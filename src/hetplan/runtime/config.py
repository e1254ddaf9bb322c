"""The configuration of one training run (no torch: the CLI imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hetplan.errors import InputError


@dataclass
class RunConfig:
    """Everything one training run needs; the launcher passes it to every rank."""

    plan: str
    model: str
    cluster: str
    steps: int = 10
    """Train until this step (a resumed run continues from its checkpoint's step)."""
    seed: int = 0
    data: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    """Save every K steps (0: only at the end) when checkpoint_dir is set."""
    resume: bool = False
    result: str | None = None
    threads: int = 0
    lr: float = 1e-3
    device: str = "auto"
    node: str | None = None
    """The node this process runs on (multi-node); None: rank i runs the plan's device i."""
    warmup_steps: int = 1
    progress: bool = False
    local_dir: str | None = None
    """Elastic runs: root of the node-local checkpoint disks (one directory per node)."""
    storage: str | None = None
    """Elastic runs: where checkpoint shards are uploaded (a directory or an fsspec URL)."""


def check_data_file(path: Path, vocab: int, seq: int) -> None:
    """Raises InputError unless ``path`` can feed byte-level tokens to the model."""
    if not path.is_file():
        raise InputError("--data", f"no such file: {path}")
    if vocab < 256:
        raise InputError("--data", f"byte-level tokens need a vocabulary >= 256, model has {vocab}")
    if path.stat().st_size < seq + 1:
        raise InputError("--data", f"{path} is shorter than one sequence ({seq + 1} bytes)")
