"""The runtime's elastic checkpoints: every node keeps the shards it holds on local disk,
the owner of each shard uploads it to the store in the background, and the store commits a
step once the next checkpoint (or the end of the run) has seen all its uploads done."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hetplan.elastic.placement import Placement, node_of
from hetplan.elastic.storage import ShardStore, Uploader
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.state import gather_unit, load_unit, restore_unit, save_unit

KEEP_LOCAL_STEPS = 2


def node_manifest(step: int, position: int, seed: int, model: Any, files: dict[str, str]) -> bytes:
    """Returns the manifest bytes of a (possibly partial) checkpoint step."""
    data = {
        "format": ckpt.FORMAT,
        "step": step,
        "data_position": position,
        "seed": seed,
        "model": ckpt.model_fields(model),
        "files": dict(sorted(files.items())),
    }
    return (json.dumps(data, indent=2) + "\n").encode()


def write_node_step(root: Path, step: int, manifest: bytes) -> None:
    """Writes a node's manifest for ``step`` and points its 'latest' at it; prunes old steps."""
    ckpt.write_atomic(root / ckpt.step_dir_name(step) / ckpt.MANIFEST, manifest)
    ckpt.write_atomic(root / ckpt.LATEST, (ckpt.step_dir_name(step) + "\n").encode())
    steps = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit())
    for old in steps[:-KEEP_LOCAL_STEPS]:
        shutil.rmtree(root / ckpt.step_dir_name(old), ignore_errors=True)


DISCARD_PREFIX = ".discard-"
"""Names a cut-short step a recovery set aside; a background thread deletes it."""


def clean_discarded(root: Path) -> list[Path]:
    """Removes the set-aside steps under a node's ``root`` that a process which died before
    its background delete finished left behind; returns them."""
    stale = [p for p in root.glob(DISCARD_PREFIX + "*") if p.is_dir()] if root.is_dir() else []
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


class NodeCheckpointer:
    """One rank's part in writing node-local checkpoints and uploading them."""

    def __init__(self, trainer: Any, local_dir: str, storage: str | None) -> None:
        self.tr = trainer
        self.node = node_of(trainer.place.device)
        self.root = Path(local_dir) / self.node
        self.store = ShardStore(storage) if storage else None
        self.uploader = Uploader(self.store) if self.store else None
        self.pending: tuple[int, int] | None = None
        peers = [p.rank for p in trainer.layout.places if node_of(p.device) == self.node]
        self.leader = trainer.rank == min(peers)
        # where an operator (or a test) finds the process to preempt
        self.root.mkdir(parents=True, exist_ok=True)
        if self.leader:
            clean_discarded(self.root)
        ckpt.write_atomic(self.root / f"worker-{trainer.rank}.pid", str(os.getpid()).encode())

    def _native(self) -> list[str]:
        return list(dict.fromkeys(u for c in self.tr.place.chunks for u in c.native_units()))

    def save(self) -> None:
        """Writes this node's shards of the current step, commits the previous step's uploads."""
        tr, step = self.tr, self.tr.step
        d = self.root / ckpt.step_dir_name(step)
        files: dict[str, str] = {}
        for unit in self._native():
            mine = [lp for lp in tr.params if lp.unit == unit]
            state = gather_unit(mine, tr.opt, tr.place.tp, tr.tp_group)
            if tr.place.tp_index == 0:
                d.mkdir(parents=True, exist_ok=True)
                save_unit(d / f"{unit}.pt", state)
                files[f"{unit}.pt"] = ckpt.sha256_file(d / f"{unit}.pt")
        uploaded = self.uploader.wait() if self.uploader else {}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.node, files, uploaded))
        self._commit_pending(gathered)
        holders: dict[str, dict[str, str]] = {}
        for node, f, _ in gathered:
            holders.setdefault(node, {}).update(f)
        if self.leader:
            man = node_manifest(step, tr.position, tr.cfg.seed, tr.model, holders[self.node])
            write_node_step(self.root, step, man)
        if tr.rank == 0 and self.store is not None:
            self.store.write_placement(step, Placement(step, tr.position, holders).dumps())
        if self.uploader is not None:
            for name in files:
                if tr.layout.owner(name.removesuffix(".pt")).rank == tr.rank:
                    self.uploader.submit(step, name, d / name)
            self.pending = (step, tr.position)
        dist.barrier()

    def _commit_pending(self, gathered: list[Any]) -> None:
        if self.pending is None or self.store is None or self.tr.rank != 0:
            return
        step, position = self.pending
        merged = {k: v for _, _, up in gathered for k, v in up.items()}
        man = node_manifest(step, position, self.tr.cfg.seed, self.tr.model, merged)
        self.store.commit(json.loads(man))

    def finish(self) -> None:
        """Waits for the last uploads and commits them (collective); stops the uploader."""
        if self.uploader is None:
            return
        uploaded = self.uploader.wait()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.node, {}, uploaded))
        self._commit_pending(gathered)
        self.pending = None
        self.uploader.close()
        dist.barrier()

    def restore(self) -> None:
        """Loads this rank's shards from its node's latest local step, checking every checksum."""
        tr = self.tr
        man = ckpt.read_manifest(self.root)
        for unit in tr._units():
            name = f"{unit}.pt"
            path = man.path / name
            if name not in man.files or not path.is_file():
                raise RuntimeError(f"{self.node} lacks {name} of step {man.step} after recovery")
            if ckpt.sha256_file(path) != man.files[name]:
                raise RuntimeError(f"{path} is corrupt (checksum mismatch)")
            mine = [lp for lp in tr.params if lp.unit == unit]
            restore_unit(load_unit(path), mine, tr.opt, tr.place.tp, tr.place.tp_index)
        tr.step, tr.position = man.step, man.data_position
