"""The recovery optimisation against brute force, and its accounting."""

from __future__ import annotations

import itertools
import random

import pytest

from hetplan.elastic.recovery import (
    LOCAL,
    STORAGE,
    RecoveryProblem,
    balanced_choice,
    baseline_s,
    makespan_s,
    plan_recovery,
)
from hetplan.errors import InputError


def _random_problem(rng: random.Random) -> RecoveryProblem:
    nodes = [f"n{i}" for i in range(rng.randint(2, 3))]
    shards = {f"s{k}": rng.choice([1, 2, 3, 5]) * 10**6 for k in range(rng.randint(2, 4))}
    held = {n: frozenset(s for s in shards if rng.random() < 0.4) for n in nodes}
    need = {n: frozenset(s for s in shards if rng.random() < 0.6) for n in nodes}
    nic = {n: rng.choice([1e6, 2e6, 4e6]) for n in nodes}
    return RecoveryProblem(shards, need, held, nic, rng.choice([1e6, 3e6, 8e6]))


def _brute_force_s(problem: RecoveryProblem) -> float:
    pairs = problem.missing()
    options = [problem.sources(n, s) for n, s in pairs]
    best = float("inf")
    for combo in itertools.product(*options):
        best = min(best, makespan_s(problem, dict(zip(pairs, combo, strict=True))))
    return best if pairs else makespan_s(problem, {})


@pytest.mark.parametrize("seed", range(40))
def test_milp_matches_brute_force(seed: int) -> None:
    problem = _random_problem(random.Random(seed))
    plan = plan_recovery(problem)
    assert plan.optimal
    assert plan.predicted_recovery_s == pytest.approx(_brute_force_s(problem), rel=1e-6, abs=1e-9)
    assert plan.lower_bound_s <= plan.predicted_recovery_s + 1e-9
    assert plan.predicted_recovery_s <= plan.baseline_recovery_s + 1e-9
    # every needed shard gets exactly one source, and the bytes add up
    needed = sum(problem.shard_bytes[s] for n in problem.need for s in problem.need[n])
    assert len(plan.transfers) == sum(len(v) for v in problem.need.values())
    assert plan.bytes_local + plan.bytes_from_peers + plan.bytes_from_storage == needed
    for t in plan.transfers:
        if t.source == LOCAL:
            assert t.shard in problem.held.get(t.node, frozenset())
        elif t.source != STORAGE:
            assert t.shard in problem.held[t.source] and t.source != t.node


def test_contention_spreads_load_over_peers_and_storage() -> None:
    # four equal whole shards needed on a new node, two peers hold them all, storage as fast
    # as a peer: the optimum takes 2/1/1 from three sources (first-found would take 4 from one)
    shards = {f"s{k}": 10**9 for k in range(4)}
    all_ = frozenset(shards)
    problem = RecoveryProblem(
        shards,
        need={"new": all_},
        held={"a": all_, "b": all_},
        nic_bytes_per_s={"new": 4e9, "a": 1e9, "b": 1e9},
        storage_bytes_per_s=1e9,
        hash_bytes_per_s=1e12,  # the flows alone: verification and file overhead negligible
        file_latency_s=0.0,
    )
    plan = plan_recovery(problem)
    sources = sorted(t.source for t in plan.transfers)
    assert plan.predicted_recovery_s == pytest.approx(2.0)
    assert plan.lower_bound_s == pytest.approx(4 / 3)  # shards split across the 3 sources
    assert len(set(sources)) == 3
    assert plan.baseline_recovery_s == pytest.approx(4.0) == baseline_s(problem)
    assert plan.speedup == pytest.approx(2.0)


def test_nothing_to_move_and_unreachable_shard() -> None:
    shards = {"s0": 10, "s1": 20}
    problem = RecoveryProblem(
        shards, {"a": frozenset(shards)}, {"a": frozenset(shards)}, {"a": 1.0}, 1.0, None, 10.0, 0.5
    )
    plan = plan_recovery(problem)
    # nothing moves, but a verifies its 30 local bytes at 10 B/s, then writes one copied file
    # (none here, still counted) and its manifest and latest: 3 + 0.5 x 3
    assert plan.predicted_recovery_s == pytest.approx(4.5) and plan.bytes_local == 30
    assert plan.bytes_from_peers == plan.bytes_from_storage == 0
    lost = RecoveryProblem(
        shards, {"a": frozenset(shards)}, {"a": frozenset()}, {"a": 1.0}, 1.0, frozenset({"s0"})
    )
    with pytest.raises(InputError, match="s1 is on no surviving node"):
        plan_recovery(lost)


def _two_shards(hash_bytes_per_s: float) -> RecoveryProblem:
    shards = {"s0": 10**9, "s1": 10**9}
    both = frozenset(shards)
    return RecoveryProblem(
        shards,
        need={"a": both, "new": both},
        held={"a": both},
        nic_bytes_per_s={"a": 1e9, "new": 2e9},
        storage_bytes_per_s=1e9,
        hash_bytes_per_s=hash_bytes_per_s,
        file_latency_s=0.01,
    )


def test_verification_and_file_latency_by_hand() -> None:
    # new (2 GB/s in) takes one shard from a and one from storage: 1 s on each link. Fixed: one
    # copied file, then manifest + latest, a and new writing their disks at the same time:
    # 0.01 x (1 + 2) = 0.03 s
    fast = _two_shards(hash_bytes_per_s=1e10)  # each node hashes 2 GB in 0.2 s, under the NIC
    assert fast.hash_loads_s() == {"hash:a": pytest.approx(0.2), "hash:new": pytest.approx(0.2)}
    assert fast.fixed_s() == pytest.approx(0.03)
    plan = plan_recovery(fast)
    assert plan.predicted_recovery_s == pytest.approx(1.03)
    assert sorted(t.source for t in plan.transfers if t.node == "new") == ["a", STORAGE]
    # baseline: storage sends 4 GB (a re-downloads too) at 1 GB/s
    assert plan.baseline_recovery_s == pytest.approx(4.03)
    # hashing at 0.5 GB/s: each node's CPU needs 4 s, more than any link; the MILP's T row
    # for it is a constant, so the bound and the optimum both move to it
    slow = plan_recovery(_two_shards(hash_bytes_per_s=5e8))
    assert slow.predicted_recovery_s == pytest.approx(4.03)
    assert slow.lower_bound_s == pytest.approx(4.03)
    assert slow.baseline_recovery_s == pytest.approx(4.03) and slow.speedup == pytest.approx(1.0)


def test_bad_hash_throughput_is_an_input_error() -> None:
    with pytest.raises(InputError, match="hash throughput"):
        RecoveryProblem({"s": 1}, {"a": frozenset({"s"})}, {}, {"a": 1.0}, 1.0, None, 0.0)


@pytest.mark.parametrize("seed", range(40))
def test_balanced_bound_never_exceeds_the_optimum(seed: int) -> None:
    problem = _random_problem(random.Random(seed))
    pairs = problem.missing()
    if not pairs:
        return
    choice, bound = balanced_choice(problem, pairs)
    assert set(choice) == set(pairs)
    assert bound + problem.fixed_s() <= _brute_force_s(problem) + 1e-12


def test_many_replicas_recover_at_the_receiving_nics() -> None:
    # 64 surviving replicas each hold all 10 shards of 4 MB; 4 fresh nodes need all of
    # them through their own 1 MB/s NICs: 10 x 4 MB / 1 MB/s = 40 s each, however the
    # sources are chosen, and 64 peers can serve that without any one exceeding it
    shards = {f"s{k}": 4 * 10**6 for k in range(10)}
    peers = {f"p{i}": frozenset(shards) for i in range(64)}
    fresh = {f"f{i}": frozenset(shards) for i in range(4)}
    nic = {n: 1e6 for n in [*peers, *fresh]}
    problem = RecoveryProblem(shards, {**fresh, **peers}, peers, nic, 1e6,
                              hash_bytes_per_s=1e12, file_latency_s=0.0)  # fmt: skip
    plan = plan_recovery(problem)
    assert plan.optimal and plan.bytes_from_storage == 0
    # (each node's CPU verifies its 40 MB at 1 TB/s beside the transfers: 40 us, not added)
    assert plan.predicted_recovery_s == pytest.approx(40.0)
    assert plan.lower_bound_s == pytest.approx(plan.predicted_recovery_s)
    busiest: dict[str, int] = {}
    for t in plan.transfers:
        if t.source not in (LOCAL, STORAGE):
            busiest[t.source] = busiest.get(t.source, 0) + t.bytes
    assert max(busiest.values()) <= 40e6  # no peer sends more than a NIC's 40 s
