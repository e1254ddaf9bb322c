"""Plans and recoveries for the replay: the real planner, replanner and recovery MILP, cached.

The first state is planned by the search ``hetplan plan`` runs (homogeneous on one node
shape, else heterogeneous). A later set of nodes is planned the way ``launch --elastic``
replans: ``elastic.replan.replan`` warm-started from the plan in force, timed for real
(the CPU time of the call, so the shared machine replaying does not stretch it).
Plans are cached per set of nodes, so a state seen again is not planned again; it keeps the
replan time measured the first time. Recoveries are the recovery MILP of
``elastic/recovery.py`` (peers first, storage for the rest), cached per transition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hetplan.cluster import Cluster, Node
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams
from hetplan.elastic.placement import node_of, node_shards, shard_bytes
from hetplan.elastic.recovery import (
    DEFAULT_FILE_LATENCY_S,
    DEFAULT_NODE_HASH_BYTES_PER_S,
    RecoveryPlan,
    RecoveryProblem,
    plan_recovery,
)
from hetplan.elastic.replan import replan
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.spot.pool import Pool, key_of


@dataclass(frozen=True)
class PlanEntry:
    """A plan on a set of nodes, its estimate, and how long finding it took."""

    plan: Plan
    estimate: Estimate
    cluster: Cluster
    replan_time_s: float
    """CPU time of the replan (or search) call: what it takes on an idle core, however
    loaded the machine replaying is (the planner runs on one thread)."""
    method: str

    def nodes_used(self) -> tuple[Node, ...]:
        """Returns the nodes the plan runs on (a node it leaves idle is not rented)."""
        used = {node_of(d) for d in self.plan.devices()}
        return tuple(n for n in self.cluster.nodes if n.name in used)

    @property
    def rate(self) -> float:
        """Returns the modelled tokens/s (0 when the plan does not fit)."""
        return self.estimate.tokens_per_s if self.estimate.fits else 0.0


@dataclass
class Planner:
    """The caches and settings shared by every policy of one replay."""

    model: ModelSpec
    pool: Pool
    precision: str
    global_batch: int
    params: CostParams
    storage_bytes_per_s: float
    hash_bytes_per_s: float = DEFAULT_NODE_HASH_BYTES_PER_S
    file_latency_s: float = DEFAULT_FILE_LATENCY_S
    replan_search: bool = False
    """False: the warm-started repair, as ``launch --elastic`` replans (the heterogeneous
    search runs only when the repair does not fit); True: as ``hetplan replan --search``
    (the repair and the full heterogeneous search, the faster plan wins)."""
    plans: dict[tuple[tuple[str, str, int], ...], PlanEntry | None] = field(default_factory=dict)
    recoveries: dict[tuple[object, ...], RecoveryPlan] = field(default_factory=dict)
    searches: int = 0
    replans: int = 0

    def search(self, nodes: tuple[Node, ...]) -> PlanEntry | None:
        """Returns the best plan on ``nodes`` by the full search (None if none fits)."""
        cluster = self.pool.cluster(nodes)
        start = time.process_time()
        if cluster.is_homogeneous():
            from hetplan.search.homogeneous import search_homogeneous

            ranked = search_homogeneous(
                self.model, cluster, self.global_batch, self.precision, 1, self.params
            ).ranked
        else:
            from hetplan.search.heterogeneous import search_heterogeneous

            ranked = search_heterogeneous(
                self.model, cluster, self.global_batch, self.precision, 1, self.params
            ).ranked
        self.searches += 1
        elapsed = time.process_time() - start
        if not ranked or not ranked[0][1].fits:
            return None
        return PlanEntry(ranked[0][0], ranked[0][1], cluster, elapsed, "search")

    def given(self, plan: Plan, nodes: tuple[Node, ...]) -> PlanEntry:
        """Makes ``plan`` the plan on ``nodes`` (the first plan, instead of a search)."""
        from hetplan.cost.estimate import estimate

        cluster = self.pool.cluster(nodes)
        entry = PlanEntry(
            plan, estimate(plan, self.model, cluster, self.params), cluster, 0.0, "given"
        )
        self.plans[key_of(nodes)] = entry
        return entry

    def first(self, nodes: tuple[Node, ...]) -> PlanEntry:
        """Returns the plan every policy starts with: a given one, else the search's (an
        InputError when none fits)."""
        given = self.plans.get(key_of(nodes))
        if given is not None:
            return given
        entry = self.search(nodes)
        if entry is None:
            gpus = ", ".join(f"{n.name} ({n.gpus}x {n.gpu.name})" for n in nodes)
            raise InputError(
                "--trace", f"no plan of {self.model.name} fits on its first state: {gpus}"
            )
        self.plans[key_of(nodes)] = entry
        return entry

    def for_nodes(self, nodes: tuple[Node, ...], current: PlanEntry | None) -> PlanEntry | None:
        """Returns the plan on ``nodes``: cached, else replanned from ``current`` (its nodes
        not in ``nodes`` lost, the nodes it lacks joined), else searched."""
        key = key_of(nodes)
        if key in self.plans:
            return self.plans[key]
        entry: PlanEntry | None = None
        wanted = {n.name for n in nodes}
        lost = (
            []
            if current is None
            else [n.name for n in current.cluster.nodes if n.name not in wanted]
        )
        if current is not None and len(lost) < len(current.cluster.nodes):
            names = {n.name for n in current.cluster.nodes}
            extra = tuple(n for n in nodes if n.name not in names)
            joined = self.pool.cluster(extra) if extra else None
            cpu = time.process_time()
            try:
                res = replan(
                    current.plan,
                    self.model,
                    current.cluster,
                    lost,
                    joined,
                    self.params,
                    search=self.replan_search,
                )
            except InputError:
                res = None
            cpu = time.process_time() - cpu
            self.replans += 1
            if res is not None and res.estimate.fits:
                entry = PlanEntry(res.plan, res.estimate, res.cluster, cpu, res.method)
        if entry is None:
            entry = self.search(nodes)
        self.plans[key] = entry
        return entry

    def recovery(
        self, old: PlanEntry | None, new: PlanEntry, survivors: frozenset[str]
    ) -> RecoveryPlan:
        """Returns the recovery MILP's plan for moving from ``old`` to ``new`` when the nodes
        in ``survivors`` kept their checkpoint shards (peers first, storage for the rest)."""
        key = (
            None if old is None else key_of(old.cluster.nodes),
            key_of(new.cluster.nodes),
            tuple(sorted(survivors)),
        )
        if key in self.recoveries:
            return self.recoveries[key]
        held = {} if old is None else node_shards(old.plan, self.model)
        nodes = {n.name: n for n in new.cluster.nodes}
        if old is not None:  # survivors serve their shards, released ones included
            nodes.update({n.name: n for n in old.cluster.nodes if n.name in survivors})
        alive = set(nodes) & survivors
        problem = RecoveryProblem(
            shard_bytes=shard_bytes(self.model),
            need=node_shards(new.plan, self.model),
            held={n: s for n, s in held.items() if n in alive},
            nic_bytes_per_s={n: node.network_bytes_per_s for n, node in nodes.items()},
            storage_bytes_per_s=self.storage_bytes_per_s,
            hash_bytes_per_s=self.hash_bytes_per_s,
            file_latency_s=self.file_latency_s,
        )
        rec = plan_recovery(problem)
        self.recoveries[key] = rec
        return rec
