"""Recovery execution: corrupt peer copies are detected and fetched from storage instead."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from hetplan.elastic.node_ckpt import (
    DISCARD_PREFIX,
    clean_discarded,
    node_manifest,
    write_node_step,
)
from hetplan.elastic.recovery import STORAGE, RecoveryProblem, plan_recovery
from hetplan.elastic.storage import ShardStore
from hetplan.elastic.transfer import (
    execute,
    measured_file_latency_s,
    measured_hash_bytes_per_s,
    survey,
)
from hetplan.model import load_model
from hetplan.runtime import checkpoint as ckpt

MODEL = load_model("gpt2")
UNITS = ["a", "b"]


def _setup(tmp: Path) -> tuple[Path, ShardStore, dict[str, str]]:
    data = {f"{u}.pt": (u * 1000).encode() for u in UNITS}
    digests = {n: hashlib.sha256(b).hexdigest() for n, b in data.items()}
    local = tmp / "local"
    for node in ("p", "q"):
        d = local / node / ckpt.step_dir_name(2)
        d.mkdir(parents=True)
        for n, b in data.items():
            (d / n).write_bytes(b)
        write_node_step(local / node, 2, node_manifest(2, 16, 0, MODEL, digests))
    store = ShardStore(str(tmp / "store"))
    for n in data:
        store.put(2, n, local / "p" / ckpt.step_dir_name(2) / n)
    store.commit(json.loads(node_manifest(2, 16, 0, MODEL, digests)))
    return local, store, digests


def _problem(found, need: dict[str, frozenset[str]], storage_bps: float = 1e6) -> RecoveryProblem:
    nic = {"p": 1e6, "q": 1e6, "r": 1e6}
    return RecoveryProblem(found.sizes_bytes and {u: 1000 for u in UNITS}, need, found.held,
                           nic, storage_bps, found.in_storage)  # fmt: skip


def test_corrupt_peer_copy_is_left_out_at_survey(tmp_path: Path) -> None:
    local, store, _ = _setup(tmp_path)
    (local / "q").rename(tmp_path / "gone")  # only p survives
    bad = local / "p" / ckpt.step_dir_name(2) / "a.pt"
    bad.write_bytes(b"x" * 1000)
    found = survey(local, ["p"], store, UNITS)
    assert found.step == 2 and found.held == {"p": frozenset({"b"})}
    assert any("a.pt" in n and "corrupt" in n for n in found.notes)
    plan = plan_recovery(_problem(found, {"r": frozenset(UNITS)}))
    assert {t.shard: t.source for t in plan.transfers} == {"a": STORAGE, "b": "p"}
    execute(plan, found, local, store, MODEL, 0)
    man = ckpt.read_manifest(local / "r")
    assert all(ckpt.sha256_file(man.path / n) == d for n, d in man.files.items())


def test_copy_corrupted_in_flight_is_fetched_from_storage(tmp_path: Path) -> None:
    local, store, digests = _setup(tmp_path)
    found = survey(local, ["p", "q"], store, UNITS)
    plan = plan_recovery(_problem(found, {"r": frozenset(UNITS)}, storage_bps=1e5))
    peers = [t for t in plan.transfers if t.source not in (STORAGE, "local")]
    assert peers
    for t in peers:  # the peer's disk rots after the survey
        (local / t.source / ckpt.step_dir_name(2) / f"{t.shard}.pt").write_bytes(b"y" * 1000)
    _, notes = execute(plan, found, local, store, MODEL, 0)
    assert len(notes) == len(peers) and all("fetched from storage" in n for n in notes)
    for u in UNITS:
        assert (
            ckpt.sha256_file(local / "r" / ckpt.step_dir_name(2) / f"{u}.pt") == digests[f"{u}.pt"]
        )


def test_machine_figures_are_measured_once(tmp_path: Path) -> None:
    rate = measured_hash_bytes_per_s()
    assert 1e7 < rate < 1e11 and measured_hash_bytes_per_s() is rate
    latency = measured_file_latency_s(str(tmp_path))
    assert 0 < latency < 1.0 and measured_file_latency_s(str(tmp_path)) is latency


def test_newer_partial_step_is_set_aside_then_deleted(tmp_path: Path) -> None:
    """A step newer than the recovered one (a checkpoint a preemption cut short) leaves the
    node's steps before recovery ends, and its files are deleted afterwards, off the path."""
    import threading

    local, store, _ = _setup(tmp_path)
    partial = local / "p" / ckpt.step_dir_name(4)
    partial.mkdir()
    (partial / "a.pt").write_bytes(b"z" * 5000)
    found = survey(local, ["p", "q"], store, UNITS)
    assert found.step == 2  # step 4 has no manifest: not recoverable
    plan = plan_recovery(_problem(found, {"p": frozenset(UNITS), "q": frozenset(UNITS)}))
    execute(plan, found, local, store, MODEL, 0)
    assert sorted(d.name for d in (local / "p").glob("step_*")) == [ckpt.step_dir_name(2)]
    assert ckpt.read_manifest(local / "p").path.name == ckpt.step_dir_name(2)
    for t in threading.enumerate():
        if t.name == "discard-steps":
            t.join(timeout=10)
    assert not any(d.name.startswith(".discard") for d in (local / "p").iterdir())


def test_set_aside_steps_a_dead_process_left_are_cleaned(tmp_path: Path) -> None:
    """A set-aside step whose background delete never ran (the process died) is removed by
    the next start's cleanup; live steps and other files stay."""
    root = tmp_path / "node"
    keep = root / ckpt.step_dir_name(2)
    keep.mkdir(parents=True)
    (keep / "a.pt").write_bytes(b"x")
    left = root / f"{DISCARD_PREFIX}{ckpt.step_dir_name(4)}-0a1b2c3d"
    left.mkdir()
    (left / "a.pt").write_bytes(b"y" * 100)
    (root / "worker-0.pid").write_bytes(b"1")
    assert clean_discarded(root) == [left]
    assert not left.exists()
    assert sorted(p.name for p in root.iterdir()) == [ckpt.step_dir_name(2), "worker-0.pid"]
    assert clean_discarded(tmp_path / "absent") == []
