"""Plan-independent checkpoints: one file per unit (embedding, each layer, head) holding full
(unsharded) parameters and Adam state, a manifest with step, data position and a SHA-256
per file. Files go to a staging directory that is renamed into place once complete, so a
crash never leaves a half checkpoint and a good checkpoint is never overwritten."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hetplan.errors import InputError, shown
from hetplan.model import ModelSpec

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 1
SHAPE_FIELDS = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds and where training stood."""

    path: Path
    step: int
    data_position: int
    """Sequences of the data stream consumed so far."""
    seed: int
    files: dict[str, str]
    """File name -> SHA-256."""
    model: dict[str, Any]
    global_batch: int | None = None
    """The global batch the run trained with (None: written before it was recorded)."""


def step_dir_name(step: int) -> str:
    """Returns the directory name of the checkpoint at ``step``."""
    return f"step_{step:08d}"


def sha256_file(path: Path) -> str:
    """Returns the hex SHA-256 of a file."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def model_fields(model: ModelSpec) -> dict[str, Any]:
    """Returns the shape fields a checkpoint must agree on."""
    return {k: getattr(model, k) for k in SHAPE_FIELDS}


def resolve(ckpt: Path) -> Path:
    """Returns the checkpoint directory named by ``ckpt`` (itself, or its 'latest')."""
    if (ckpt / MANIFEST).is_file():
        return ckpt
    latest = ckpt / LATEST
    if not ckpt.is_dir():
        raise InputError("--checkpoint-dir", f"no such directory: {ckpt}")
    if not latest.is_file():
        raise InputError("--resume", f"no checkpoint in {ckpt} (no '{LATEST}' and no manifest)")
    target = ckpt / latest.read_text().strip()
    if not (target / MANIFEST).is_file():
        raise InputError("--resume", f"{latest} points to {target.name}, which has no manifest")
    return target


def read_manifest(ckpt: Path) -> Manifest:
    """Returns the manifest of the checkpoint at (or latest under) ``ckpt``."""
    path = resolve(ckpt)
    try:
        data = json.loads((path / MANIFEST).read_text())
        return Manifest(
            path=path,
            step=int(data["step"]),
            data_position=int(data["data_position"]),
            seed=int(data["seed"]),
            files=dict(data["files"]),
            model=dict(data["model"]),
            global_batch=int(data["global_batch"]) if "global_batch" in data else None,
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError("--resume", f"{path / MANIFEST} is unreadable: {exc}") from None


def verify_checkpoint(ckpt: Path, model: ModelSpec) -> Manifest:
    """Returns the manifest after checking the model shape and every file's checksum."""
    man = read_manifest(ckpt)
    want = model_fields(model)
    for key, value in want.items():
        if man.model.get(key) != value:
            raise InputError(
                "--resume",
                f"checkpoint {man.path} has {key} {shown(man.model.get(key))}, "
                f"the model {shown(value)}",
            )
    expected = {"embed.pt", "head.pt"} | {f"layer_{i:04d}.pt" for i in range(model.layers)}
    missing = sorted(expected - set(man.files))
    if missing:
        raise InputError("--resume", f"checkpoint {man.path} lacks {missing[0]}")
    for name, digest in man.files.items():
        f = man.path / name
        if not f.is_file():
            raise InputError("--resume", f"checkpoint file {f} is missing")
        if sha256_file(f) != digest:
            raise InputError("--resume", f"checkpoint file {f} is corrupt (checksum mismatch)")
    return man


def check_batch(man: Manifest, global_batch: int, allow_change: bool) -> None:
    """Raises InputError if the plan's global batch differs from the checkpoint's."""
    if allow_change or man.global_batch is None or man.global_batch == global_batch:
        return
    raise InputError(
        "global_batch_size",
        f"the plan has {global_batch}, checkpoint {man.path.name} was trained with "
        f"{man.global_batch} (pass --allow-batch-change to resume anyway)",
    )


def check_resume(step: int, seed: int, steps: int, run_seed: int) -> None:
    """Raises InputError unless a run to ``steps`` with ``run_seed`` can resume from the
    checkpoint of ``step`` trained with ``seed``: something left to train, and the same
    seed (the data order and the dropout masks follow it)."""
    if steps <= step:
        raise InputError("--steps", f"the checkpoint is at step {step}: "
                         f"{steps} steps leave nothing to train")  # fmt: skip
    if seed != run_seed:
        raise InputError("--seed", f"checkpoint {step_dir_name(step)} was trained with seed "
                         f"{seed}, not {run_seed}")  # fmt: skip


def staging_dir(root: Path, step: int) -> Path:
    """Returns the staging directory for the checkpoint at ``step``."""
    return root / f".staging-{step_dir_name(step)}"


def begin(root: Path, step: int) -> bool:
    """Prepares the staging directory; returns False if a checkpoint for ``step`` exists."""
    if (root / step_dir_name(step) / MANIFEST).is_file():
        return False
    stage = staging_dir(root, step)
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    return True


def fsync_dir(path: Path) -> None:
    """Makes a rename or creation inside directory ``path`` durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(
    root: Path,
    step: int,
    data_position: int,
    seed: int,
    model: ModelSpec,
    files: dict[str, str],
    global_batch: int | None = None,
    keep: int = 0,
) -> Path:
    """Writes the manifest, renames the staging directory into place (fsyncing the files'
    directory and the root), points 'latest' at it, then keeps the ``keep`` newest steps."""
    stage = staging_dir(root, step)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "data_position": data_position,
        "seed": seed,
        "model": model_fields(model),
        "files": dict(sorted(files.items())),
    }
    if global_batch is not None:
        manifest["global_batch"] = global_batch
    write_atomic(stage / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    fsync_dir(stage)
    final = root / step_dir_name(step)
    os.rename(stage, final)
    fsync_dir(root)
    write_atomic(root / LATEST, (final.name + "\n").encode())
    fsync_dir(root)
    if keep > 0:
        prune(root, keep)
    return final


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Returns the complete checkpoints under ``root`` as (step, directory), oldest first."""
    out = []
    for p in root.glob("step_*"):
        if p.name[5:].isdigit() and (p / MANIFEST).is_file():
            out.append((int(p.name[5:]), p))
    return sorted(out)


def prune(root: Path, keep: int) -> list[Path]:
    """Removes all but the ``keep`` newest checkpoints (never the one 'latest' names)."""
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    removed = []
    for _, path in step_dirs(root)[:-keep]:
        if path.name != latest:
            shutil.rmtree(path)
            removed.append(path)
    if removed:
        fsync_dir(root)
    return removed


def clean_staging(root: Path) -> list[Path]:
    """Removes staging directories a killed run left behind; returns them."""
    stale = [p for p in root.glob(".staging-*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p)
    return stale
