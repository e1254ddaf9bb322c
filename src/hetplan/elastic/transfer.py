"""Executing a recovery plan: find the newest recoverable step, copy shards, verify them.

Copies run concurrently; with a ``Throttle`` each byte also reserves time on the links it
crosses (the destination's NIC in, the source's NIC out, or storage) at the cluster file's
bandwidths, so a run on one machine measures the contention the recovery model predicts.
Received shards are hashed as they stream in; local ones are read and hashed in parallel.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hetplan.elastic.node_ckpt import DISCARD_PREFIX, node_manifest, write_node_step
from hetplan.elastic.placement import Placement
from hetplan.elastic.recovery import LOCAL, STORAGE, RecoveryPlan, Transfer
from hetplan.elastic.storage import ShardStore
from hetplan.runtime import checkpoint as ckpt

CHUNK_BYTES = 1 << 16
LINK_BUFFER_CHUNKS = 4
"""A link keeps sending for this many chunks while its copier is busy (a socket buffer)."""


@functools.cache
def measured_hash_bytes_per_s(buffer_bytes: int = 32 << 20) -> float:
    """Returns this machine's SHA-256 throughput on one core (best of 3; measured once)."""
    data = bytes(buffer_bytes)
    best_s = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        best_s = min(best_s, time.perf_counter() - t0)
    return buffer_bytes / best_s


@functools.cache
def measured_file_latency_s(directory: str | None = None) -> float:
    """Returns the median time of one small atomic file write in ``directory`` (measured once)."""
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        times_s = []
        for i in range(9):
            t0 = time.perf_counter()
            ckpt.write_atomic(Path(tmp) / f"probe{i}", b"{}\n" * 256)
            times_s.append(time.perf_counter() - t0)
    return sorted(times_s)[len(times_s) // 2]


class Throttle:
    """Links with bandwidths; a chunk waits until every link it crosses is free."""

    def __init__(self, nic_bytes_per_s: dict[str, float], storage_bytes_per_s: float) -> None:
        self.rate = {f"in:{n}": b for n, b in nic_bytes_per_s.items()}
        self.rate.update({f"out:{n}": b for n, b in nic_bytes_per_s.items()})
        self.rate[STORAGE] = storage_bytes_per_s
        self.free_at = dict.fromkeys(self.rate, 0.0)
        self.lock = threading.Lock()

    def pass_bytes(self, links: list[str], n: int) -> None:
        """Blocks until ``n`` bytes have crossed ``links`` at their rates."""
        with self.lock:
            now = time.perf_counter()
            # a link idles while its copier reads, hashes and writes only once its buffer ran dry
            start = max(
                [now - LINK_BUFFER_CHUNKS * CHUNK_BYTES / min(self.rate[k] for k in links)]
                + [self.free_at[k] for k in links]
            )
            end = start
            for k in links:
                self.free_at[k] = start + n / self.rate[k]
                end = max(end, self.free_at[k])
        time.sleep(max(0.0, end - time.perf_counter()))


@dataclass
class Survey:
    """The newest step that can be recovered, who holds which verified shard, and notes."""

    step: int
    data_position: int
    digests: dict[str, str]
    """Shard file name -> SHA-256 of that step."""
    held: dict[str, frozenset[str]]
    in_storage: frozenset[str]
    sizes_bytes: dict[str, int]
    notes: list[str] = field(default_factory=list)


def _steps(root: Path) -> list[int]:
    return [int(p.name[5:]) for p in root.glob("step_*") if (p / ckpt.MANIFEST).is_file()]


def survey(local_root: Path, alive: list[str], store: ShardStore, units: list[str]) -> Survey:
    """Returns the newest step whose every shard is on a survivor (checksum verified) or in
    storage; corrupt local copies are left out and named in the notes."""
    names = [f"{u}.pt" for u in units]
    steps = {s for n in alive for s in _steps(local_root / n)}
    latest = store.latest_step()
    steps |= {latest} if latest is not None else set()
    for step in sorted(steps, reverse=True):
        notes: list[str] = []
        digests: dict[str, str] = {}
        stored = store.manifest(step)
        position = int(stored["data_position"]) if stored else -1
        digests.update(stored["files"] if stored else {})
        record = store.read_placement(step)
        if record is not None:
            placed = Placement.from_json(json.loads(record))
            for shards in placed.holders.values():
                for name, digest in shards.items():
                    digests.setdefault(name, digest)
        held: dict[str, set[str]] = {}
        sizes: dict[str, int] = {}
        for node in alive:
            d = local_root / node / ckpt.step_dir_name(step)
            if not (d / ckpt.MANIFEST).is_file():
                continue
            man = ckpt.read_manifest(d)
            position = man.data_position
            for name, digest in man.files.items():
                if digests.setdefault(name, digest) != digest:
                    notes.append(f"{node}: {name} of step {step} disagrees with storage")
                    continue
                if (d / name).is_file() and ckpt.sha256_file(d / name) == digest:
                    held.setdefault(node, set()).add(name.removesuffix(".pt"))
                    sizes[name] = (d / name).stat().st_size
                else:
                    notes.append(f"{node}: {name} of step {step} is corrupt; not used")
        in_storage = {n.removesuffix(".pt") for n in names if n in digests and store.has(step, n)}
        if stored is None:  # uncommitted uploads: usable only with a digest from a survivor
            in_storage = {u for u in in_storage if f"{u}.pt" in digests}
        have = set().union(*held.values()) | in_storage
        if position >= 0 and all(u in have for u in units):
            for n in names:
                if n not in sizes and store.fs is None:
                    sizes[n] = Path(store._path(ckpt.step_dir_name(step), n)).stat().st_size
                elif n not in sizes:
                    sizes[n] = int(store.fs.size(store._path(ckpt.step_dir_name(step), n)))
            return Survey(
                step,
                position,
                digests,
                {n: frozenset(s) for n, s in held.items()},
                frozenset(in_storage),
                sizes,
                notes,
            )
    raise RuntimeError("no checkpoint step can be recovered from the survivors and storage")


def _copy(src: Path, dest: Path, links: list[str], throttle: Throttle | None) -> str:
    tmp = dest.with_name(f".{dest.name}.part")
    digest = hashlib.sha256()
    with src.open("rb") as fin, tmp.open("wb") as fout:
        while block := fin.read(CHUNK_BYTES):
            if throttle is not None:
                throttle.pass_bytes(links, len(block))
            digest.update(block)
            fout.write(block)
    tmp.replace(dest)
    return digest.hexdigest()


def _fetch(t: Transfer, root: Path, step: int, store: ShardStore, thr: Throttle | None) -> str:
    """Copies one shard to its node; returns the SHA-256 of what arrived."""
    dest = root / t.node / ckpt.step_dir_name(step) / f"{t.shard}.pt"
    dest.parent.mkdir(parents=True, exist_ok=True)
    if t.source == STORAGE:
        if store.fs is None:
            src = Path(store._path(ckpt.step_dir_name(step), dest.name))
            return _copy(src, dest, [STORAGE, f"in:{t.node}"], thr)
        store.get(step, dest.name, dest)
        return ckpt.sha256_file(dest)
    src = root / t.source / ckpt.step_dir_name(step) / dest.name
    return _copy(src, dest, [f"out:{t.source}", f"in:{t.node}"], thr)


def execute(
    plan: RecoveryPlan,
    found: Survey,
    local_root: Path,
    store: ShardStore,
    model: object,
    seed: int,
    throttle: Throttle | None = None,
    workers: int = 16,
) -> tuple[float, list[str]]:
    """Runs the transfers (network ones first), verifies every shard's checksum (a bad peer
    copy is fetched again from storage), writes each node's manifest; returns the wall time
    and notes."""
    start = time.perf_counter()
    notes: list[str] = []
    step = found.step

    def one(t: Transfer) -> None:
        name = f"{t.shard}.pt"
        dest = local_root / t.node / ckpt.step_dir_name(step) / name
        if t.source != LOCAL:
            digest = _fetch(t, local_root, step, store, throttle)
        else:
            digest = ckpt.sha256_file(dest)
        if digest != found.digests[name]:
            if t.source == STORAGE or t.shard not in found.in_storage:
                raise RuntimeError(f"{name} from {t.source} fails its checksum; no other copy")
            notes.append(f"{name} from {t.source} failed its checksum; fetched from storage")
            again = Transfer(t.node, t.shard, STORAGE, t.bytes)
            if _fetch(again, local_root, step, store, throttle) != found.digests[name]:
                raise RuntimeError(f"{name} from storage fails its checksum too")

    # the network copies are the critical path: start them before the local verifications
    ordered = sorted(plan.transfers, key=lambda t: t.source == LOCAL)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, ordered))
    discarded: list[Path] = []

    def finish(node: str) -> None:
        root = local_root / node
        for d in root.glob("step_*"):  # steps newer than the recovered one were never complete
            if d.name[5:].isdigit() and int(d.name[5:]) > step:
                aside = root / f"{DISCARD_PREFIX}{d.name}-{uuid.uuid4().hex[:8]}"
                discarded.append(d.rename(aside))
        files = {
            f"{t.shard}.pt": found.digests[f"{t.shard}.pt"]
            for t in plan.transfers
            if t.node == node
        }
        write_node_step(root, step, node_manifest(step, found.data_position, seed, model, files))

    # every node writes its own disk: the manifests and 'latest' files are written concurrently
    nodes = sorted({t.node for t in plan.transfers})
    with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        list(pool.map(finish, nodes))
    elapsed = time.perf_counter() - start
    if discarded:  # freeing their blocks is not needed to resume: off the critical path
        threading.Thread(target=_delete, args=(discarded,), name="discard-steps").start()
    return elapsed, notes


def _delete(dirs: list[Path]) -> None:
    """Deletes the set-aside step directories (a background thread's work)."""
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def complete_storage(
    found: Survey, local_root: Path, store: ShardStore, model: object, seed: int
) -> list[str]:
    """Uploads the recovered step's shards storage lacks and commits it there; returns names."""
    if store.manifest(found.step) is not None:
        return []
    uploaded = []
    for name in sorted(found.digests):
        if store.has(found.step, name):
            continue
        for node in sorted(found.held):
            src = local_root / node / ckpt.step_dir_name(found.step) / name
            if name.removesuffix(".pt") in found.held[node] and src.is_file():
                store.put(found.step, name, src)
                uploaded.append(name)
                break
    man = node_manifest(found.step, found.data_position, seed, model, found.digests)
    store.commit(json.loads(man))
    return uploaded
