"""The configuration of one training run (no torch: the CLI imports it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetplan.errors import InputError
from hetplan.model import ModelSpec, load_model
from hetplan.runtime.optim_config import OptimConfig


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
    threads: int = 1
    """Threads per process (0: torch's default, every core: slow when ranks share cores)."""
    lr: float = 1e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Global gradient-norm clipping (0: off); the DeepSpeed export writes the same 1.0."""
    lr_warmup_steps: int = 0
    lr_decay_steps: int = 0
    """Cosine decay of the learning rate until this step (0: constant after warm-up)."""
    min_lr_ratio: float = 0.1
    dropout: float = 0.0
    keep: int = 0
    """Checkpoints kept in checkpoint_dir (0: all)."""
    allow_batch_change: bool = False
    seq_len: int = 0
    """Sequence length (0: the model's own)."""
    device: str = "auto"
    on_node: str | None = None
    """The node this process runs on (multi-node); None: rank i runs the plan's device i.
    Not ``node``: torchrun's parser reads every option of its command line, the worker's
    too, and ``--node`` is a prefix of two of its own (``--node-rank``, ``--node_rank``)."""
    warmup_steps: int = 1
    progress: bool = False
    local_dir: str | None = None
    """Elastic runs: root of the node-local checkpoint disks (one directory per node)."""
    storage: str | None = None
    """Elastic runs: where checkpoint shards are uploaded (a directory or an fsspec URL)."""
    init_from: str | None = None
    """A local Hugging Face checkpoint (config.json + safetensors) to start from."""

    def model_spec(self) -> ModelSpec:
        """Returns the model of this run (with the --seq-len override), dropout as the run
        applies it (--dropout; 0 keeps no masks): what the run's prediction costs."""
        return replace(load_model(self.model, self.seq_len or None), uses_dropout=self.dropout > 0)

    def optim(self) -> OptimConfig:
        """Returns the optimizer settings of this run."""
        return OptimConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            grad_clip=self.grad_clip,
            warmup_steps=self.lr_warmup_steps,
            decay_steps=self.lr_decay_steps,
            min_lr_ratio=self.min_lr_ratio,
        )


TOKEN_DTYPES = {"uint16": 2, "uint32": 4}


def token_dtype(path: Path, vocab: int) -> str | None:
    """Returns the dtype of a token file (``.bin``: uint16 ids as nanoGPT writes them, or
    uint32 when the vocabulary exceeds 65536; ``.u16``/``.u32`` say it); None: text bytes."""
    suffix = path.suffix.lower()
    if suffix == ".u16":
        return "uint16"
    if suffix == ".u32":
        return "uint32"
    if suffix == ".bin":
        return "uint16" if vocab <= 65536 else "uint32"
    return None


def check_data_file(path: Path, vocab: int, seq: int, global_batch: int = 1) -> None:
    """Raises InputError unless ``path`` can feed the model: a token file (see
    ``token_dtype``, or a NumPy ``.npy`` array of integer ids) whose ids are below the
    vocabulary and that holds one global batch of sequences, or a text file read as byte
    tokens."""
    if not path.is_file():
        raise InputError("--data", f"no such file: {path}")
    need = global_batch * seq + 1
    short = f"fewer than one global batch ({global_batch} x {seq} + 1 = {need})"
    ids = open_tokens(path, vocab)
    if ids is None:
        if vocab < 256:
            raise InputError(
                "--data", f"byte-level tokens need a vocabulary >= 256, model has {vocab}"
            )
        if path.stat().st_size < need:
            raise InputError("--data", f"{path.name} holds {path.stat().st_size} bytes, {short}")
        return
    if len(ids) < need:
        raise InputError("--data", f"{path.name} holds {len(ids)} tokens, {short}")
    step = 1 << 24
    low = min(int(ids[i : i + step].min()) for i in range(0, len(ids), step))
    top = max(int(ids[i : i + step].max()) for i in range(0, len(ids), step))
    if low < 0:
        raise InputError("--data", f"{path.name} holds token id {low}, below 0")
    if top >= vocab:
        raise InputError(
            "--data", f"{path.name} holds token id {top}, beyond the vocabulary of {vocab}"
        )


def open_tokens(path: Path, vocab: int) -> Any:
    """Returns the token ids of ``path`` memory-mapped (a 1-D NumPy array), or None for a
    text file read as bytes; raises InputError for a file of the wrong size or dtype."""
    import numpy as np

    if path.suffix.lower() == ".npy":
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise InputError("--data", f"{path.name} is not a readable .npy array ({e})") from e
        if ids.dtype.kind not in "ui":
            raise InputError(
                "--data", f"{path.name} holds {ids.dtype} values, not integer token ids"
            )
        if ids.ndim != 1:
            raise InputError(
                "--data", f"{path.name} is a {ids.ndim}-D array; token ids are one flat array"
            )
        return ids
    dtype = token_dtype(path, vocab)
    if dtype is None:
        return None
    size, item = path.stat().st_size, TOKEN_DTYPES[dtype]
    if dtype == "uint16" and vocab > 65536:
        raise InputError("--data", f"uint16 ids cannot hold a vocabulary of {vocab}")
    if size % item:
        raise InputError(
            "--data", f"{path.name} is {size} bytes, not a whole number of {dtype} token ids"
        )
    if size == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")
