"""The recovery optimisation against brute force, and its accounting."""

from __future__ import annotations

import itertools
import random

import pytest

from hetplan.elastic.recovery import (
    LOCAL,
    STORAGE,
    RecoveryProblem,
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
    return best if pairs else 0.0


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
        shards, {"a": frozenset(shards)}, {"a": frozenset(shards)}, {"a": 1.0}, 1.0
    )
    plan = plan_recovery(problem)
    assert plan.predicted_recovery_s == 0 and plan.bytes_local == 30
    lost = RecoveryProblem(
        shards, {"a": frozenset(shards)}, {"a": frozenset()}, {"a": 1.0}, 1.0, frozenset({"s0"})
    )
    with pytest.raises(InputError, match="s1 is on no surviving node"):
        plan_recovery(lost)
