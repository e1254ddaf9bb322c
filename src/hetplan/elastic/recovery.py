"""The recovery plan: where each node of the new plan gets each checkpoint shard it lacks.

Sources are the node itself (free), a surviving peer node (its network link), or storage.
Transfers run concurrently and share bandwidth as a fluid: a node's NIC carries its
downloads (in) and what it serves to peers (out), each direction at the node's network
bandwidth; storage serves everything at its aggregate bandwidth. With every flow sent at
rate bytes / T, all transfers finish at T exactly when no resource carries more than
capacity x T, so the recovery time of an assignment is its most loaded resource's
load / capacity. Choosing the assignment that minimises it is a MILP (HiGHS): one binary
per (missing shard on a node, source), one continuous T, a capacity row per resource.

Recovery also verifies every shard a node needs (SHA-256): local shards from disk, received
ones while they stream in, on the node's CPU at ``hash_bytes_per_s`` — one more resource per
node, in parallel with its NIC, with a load that no choice of source changes. After the
flows, every node writes its manifest and ``latest`` (two atomic writes, the nodes at the
same time) and one copied file's open/rename is on the critical path: three fixed
``file_latency_s``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp
from scipy.sparse import coo_matrix

from hetplan.cluster import Cluster
from hetplan.elastic.placement import node_shards, shard_bytes
from hetplan.errors import InputError, shown
from hetplan.model import ModelSpec
from hetplan.plan import Plan

LOCAL = "local"
STORAGE = "storage"
DEFAULT_HASH_BYTES_PER_S = 1.4e9
"""hashlib.sha256 on one core with SHA extensions: 1.46 GB/s measured on the bench machine
(x86, 2 cores); CPUs without them reach about 0.4 GB/s. ``measured_hash_bytes_per_s``
measures the machine that recovers."""
HASH_WORKERS = 16
"""Copy threads per node in ``transfer.recover``; each hashes what it copies or checks."""
DEFAULT_NODE_HASH_BYTES_PER_S = DEFAULT_HASH_BYTES_PER_S * HASH_WORKERS
"""Planning default for a GPU server, whose cores outnumber the copy threads; runs on a
machine with fewer cores per node pass their measured rate instead."""
DEFAULT_FILE_LATENCY_S = 1e-3
"""One atomic file write (create, write, fsync, rename) on a local SSD: 0.5-1 ms measured on
the bench machine; ``measured_file_latency_s`` measures a directory."""


@dataclass(frozen=True)
class RecoveryProblem:
    """What each node needs, what each surviving node holds, and every capacity."""

    shard_bytes: dict[str, int]
    need: dict[str, frozenset[str]]
    """Node of the new plan -> shards it must hold before training resumes."""
    held: dict[str, frozenset[str]]
    """Surviving node -> shards it holds with a verified checksum."""
    nic_bytes_per_s: dict[str, float]
    """Node -> network bandwidth per direction (every node of need and held)."""
    storage_bytes_per_s: float
    in_storage: frozenset[str] | None = None
    """Shards storage holds (None: all of them)."""
    hash_bytes_per_s: float = DEFAULT_NODE_HASH_BYTES_PER_S
    """SHA-256 throughput of one node's CPU (every needed shard is verified)."""
    file_latency_s: float = DEFAULT_FILE_LATENCY_S
    """Fixed time of one atomic file write (open, fsync, rename)."""

    def __post_init__(self) -> None:
        if self.storage_bytes_per_s <= 0:
            raise InputError("storage_bandwidth", "must be positive")
        if self.hash_bytes_per_s <= 0 or self.file_latency_s < 0:
            raise InputError("recovery", "hash throughput must be positive, file latency >= 0")
        for node in set(self.need) | set(self.held):
            if self.nic_bytes_per_s.get(node, 0.0) <= 0:
                raise InputError(
                    "network_bandwidth", f"node {shown(node)} has no positive bandwidth"
                )

    def sources(self, node: str, shard: str) -> list[str]:
        """Returns the sources that can send ``shard`` to ``node`` (peers, then storage)."""
        out = [p for p, s in sorted(self.held.items()) if p != node and shard in s]
        if self.in_storage is None or shard in self.in_storage:
            out.append(STORAGE)
        return out

    def hash_loads_s(self) -> dict[str, float]:
        """Returns each node's time verifying every shard it needs (local and received)."""
        return {
            f"hash:{n}": sum(self.shard_bytes[s] for s in shards) / self.hash_bytes_per_s
            for n, shards in self.need.items()
        }

    def fixed_s(self) -> float:
        """Returns the serial file overhead: one copied file's open/rename, then each node's
        manifest and ``latest`` (two atomic writes; the nodes write their disks concurrently)."""
        return 3 * self.file_latency_s if any(self.need.values()) else 0.0

    def missing(self) -> list[tuple[str, str]]:
        """Returns the (node, shard) pairs that must be transferred, in a fixed order."""
        return [
            (n, s)
            for n in sorted(self.need)
            for s in sorted(self.need[n])
            if s not in self.held.get(n, frozenset())
        ]


@dataclass(frozen=True)
class Transfer:
    """One shard copied to one node from one source ('local', 'storage' or a peer node)."""

    node: str
    shard: str
    source: str
    bytes: int


@dataclass
class RecoveryPlan:
    """The chosen source of every needed shard, bytes by source, and predicted times."""

    transfers: list[Transfer]
    bytes_local: int
    bytes_from_peers: int
    bytes_from_storage: int
    predicted_recovery_s: float
    baseline_recovery_s: float
    """Every node downloads everything it needs from storage (a Varuna-style restart)."""
    lower_bound_s: float
    """The LP relaxation's makespan (shards split across sources): no plan beats it."""
    optimal: bool
    solve_time_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float:
        """Returns baseline / predicted recovery time (inf when nothing has to move)."""
        if self.predicted_recovery_s <= 0:
            return float("inf") if self.baseline_recovery_s > 0 else 1.0
        return self.baseline_recovery_s / self.predicted_recovery_s

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON object the CLI prints."""
        return {
            "bytes_local": self.bytes_local,
            "bytes_from_peers": self.bytes_from_peers,
            "bytes_from_storage": self.bytes_from_storage,
            "predicted_recovery_s": self.predicted_recovery_s,
            "baseline_recovery_s": self.baseline_recovery_s,
            "speedup": self.speedup,
            "lower_bound_s": self.lower_bound_s,
            "optimal": self.optimal,
            "solve_time_s": self.solve_time_s,
            "notes": self.notes,
            "transfers": [
                {"node": t.node, "shard": t.shard, "source": t.source, "bytes": t.bytes}
                for t in self.transfers
                if t.source != LOCAL
            ],
        }


def loads_s(problem: RecoveryProblem, choice: dict[tuple[str, str], str]) -> dict[str, float]:
    """Returns the load/capacity in seconds of every resource under ``choice`` (pair -> source),
    node CPUs verifying shards included."""
    out: dict[str, float] = {STORAGE: 0.0, **problem.hash_loads_s()}
    for (node, shard), src in choice.items():
        b = problem.shard_bytes[shard]
        out[f"in:{node}"] = out.get(f"in:{node}", 0.0) + b / problem.nic_bytes_per_s[node]
        if src == STORAGE:
            out[STORAGE] += b / problem.storage_bytes_per_s
        else:
            out[f"out:{src}"] = out.get(f"out:{src}", 0.0) + b / problem.nic_bytes_per_s[src]
    return out


def makespan_s(problem: RecoveryProblem, choice: dict[tuple[str, str], str]) -> float:
    """Returns the recovery time of an assignment: its most loaded resource's busy time plus
    the fixed file overhead."""
    return max(loads_s(problem, choice).values(), default=0.0) + problem.fixed_s()


def baseline_s(problem: RecoveryProblem) -> float:
    """Returns the time for every node to download all it needs from storage."""
    choice = {(n, s): STORAGE for n in problem.need for s in problem.need[n]}
    return makespan_s(problem, choice)


def _matrices(
    problem: RecoveryProblem, pairs: list[tuple[str, str]]
) -> tuple[list[tuple[int, str]], Any, Any, np.ndarray, np.ndarray]:
    """Returns (variable index -> (pair, source)), A_eq, A_ub (sparse: a variable touches one
    pair and at most three resources), b_ub and the objective."""
    cols: list[tuple[int, str]] = []
    for i, (node, shard) in enumerate(pairs):
        srcs = problem.sources(node, shard)
        if not srcs:
            raise InputError(
                "recovery", f"shard {shard} is on no surviving node and not in storage"
            )
        cols += [(i, s) for s in srcs]
    n = len(cols) + 1  # the last variable is T
    hashing = problem.hash_loads_s()
    resources = sorted(
        {f"in:{p[0]}" for p in pairs} | {f"out:{s}" for _, s in cols} | {STORAGE} | set(hashing)
    )
    row = {r: k for k, r in enumerate(resources)}
    b_ub = np.array([-hashing.get(r, 0.0) for r in resources])  # constant load: T >= it
    rows, vals = [], []  # A_ub's entries by column: the pair's inbound, then its source
    weight = np.zeros(n)  # each column's sum, for the tie-break
    for j, (i, src) in enumerate(cols):
        node, shard = pairs[i]
        b = problem.shard_bytes[shard]
        inbound = b / problem.nic_bytes_per_s[node]
        outbound = (b / problem.storage_bytes_per_s if src == STORAGE
                    else b / problem.nic_bytes_per_s[src])  # fmt: skip
        rows += [row[f"in:{node}"], row[STORAGE if src == STORAGE else f"out:{src}"]]
        vals += [inbound, outbound]
        weight[j] = inbound + outbound
    m = len(resources)
    a_ub = coo_matrix(
        (
            np.r_[vals, -np.ones(m)],
            (np.r_[rows, np.arange(m)], np.r_[np.repeat(np.arange(n - 1), 2), np.full(m, n - 1)]),
        ),
        shape=(m, n),
    ).tocsr()  # duplicates (a node's own inbound and outbound never share a row) are summed
    a_eq = coo_matrix(
        (np.ones(n - 1), ([i for i, _ in cols], np.arange(n - 1))), shape=(len(pairs), n)
    ).tocsr()
    c = np.zeros(n)
    c[-1] = 1.0
    # a tie-break far below any real difference: among equal makespans, prefer fewer storage
    # bytes, then less traffic on the busiest peers
    scale = 1e-7 / max(1.0, float(weight.sum()))
    for j, (_, src) in enumerate(cols):
        c[j] = scale * (2.0 if src == STORAGE else 1.0) * weight[j]
    return cols, a_eq, a_ub, b_ub, c


def balanced_choice(
    problem: RecoveryProblem, pairs: list[tuple[str, str]]
) -> tuple[dict[tuple[str, str], str], float]:
    """Returns an assignment of sources to ``pairs`` and the least recovery time any
    assignment can have (without the fixed file overhead).

    The bound: every node receives what it lacks through its own NIC and verifies all it
    needs, whatever the sources, and storage sends every shard no surviving peer holds. The
    assignment takes the pairs largest first, each from the holder whose load after it is
    least, from storage only where no holder stays within the bound; where its makespan
    meets the bound it is optimal, with storage used no more than the bound forces (the
    MILP's tie-break). With many replicas holding every shard, as at scale, it does: the
    receiving NICs are the bottleneck."""
    holders: dict[str, list[str]] = {}
    for peer, shards in sorted(problem.held.items()):
        for shard in shards:
            holders.setdefault(shard, []).append(peer)
    stored = problem.in_storage
    load: dict[str, float] = {**problem.hash_loads_s(), STORAGE: 0.0}
    choice: dict[tuple[str, str], str] = {}
    free: list[tuple[str, str]] = []
    for node, shard in pairs:
        b = problem.shard_bytes[shard]
        key = f"in:{node}"
        load[key] = load.get(key, 0.0) + b / problem.nic_bytes_per_s[node]
        peers = [p for p in holders.get(shard, ()) if p != node]
        if peers:
            free.append((node, shard))
        elif stored is None or shard in stored:
            choice[(node, shard)] = STORAGE
            load[STORAGE] += b / problem.storage_bytes_per_s
        else:
            raise InputError(
                "recovery", f"shard {shard} is on no surviving node and not in storage"
            )
    lower = max(load.values())
    free.sort(key=lambda pair: (-problem.shard_bytes[pair[1]], pair))
    turn: dict[str, int] = {}  # where each shard's next search of its holders starts
    for node, shard in free:
        b = problem.shard_bytes[shard]
        peers = holders[shard]
        start = turn.get(shard, 0)
        best = (math.inf, "")
        for k in range(len(peers)):  # the first holder within the bound, in turn
            p = peers[(start + k) % len(peers)]
            if p == node:
                continue
            after = load.get(f"out:{p}", 0.0) + b / problem.nic_bytes_per_s[p]
            if after < best[0]:
                best = (after, p)
            if after <= lower:
                turn[shard] = start + k + 1
                break
        via_storage = load[STORAGE] + b / problem.storage_bytes_per_s
        if best[0] > lower and (stored is None or shard in stored) and via_storage < best[0]:
            choice[(node, shard)] = STORAGE
            load[STORAGE] = via_storage
        else:
            choice[(node, shard)] = best[1]
            load[f"out:{best[1]}"] = best[0]
    return choice, lower


def _milp_choice(
    problem: RecoveryProblem, pairs: list[tuple[str, str]], time_limit_s: float, notes: list[str]
) -> tuple[dict[tuple[str, str], str], float, bool]:
    """Returns the MILP's assignment of sources to ``pairs`` (HiGHS), its LP relaxation's
    recovery time as the lower bound, and whether the MILP proved it optimal; what it gave
    up on goes to ``notes``."""
    cols, a_eq, a_ub, b_ub, c = _matrices(problem, pairs)
    n = len(cols) + 1
    lp = linprog(
        c,
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=a_eq,
        b_eq=np.ones(len(pairs)),
        bounds=[(0, 1)] * (n - 1) + [(0, None)],
        method="highs",
    )
    lower = float(lp.x[-1]) + problem.fixed_s() if lp.status == 0 else 0.0
    integrality = np.ones(n)
    integrality[-1] = 0
    res = milp(
        c,
        constraints=[
            LinearConstraint(a_eq, 1.0, 1.0),
            LinearConstraint(a_ub, -np.inf, b_ub),
        ],
        integrality=integrality,
        bounds=Bounds(np.r_[np.zeros(n - 1), 0.0], np.r_[np.ones(n - 1), np.inf]),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-6},
    )
    if res.x is not None:
        x = res.x
        optimal = res.status == 0
        if not optimal:
            notes.append(f"MILP stopped at its {time_limit_s:g} s limit; best found kept")
    else:
        x = lp.x  # round the relaxation: each shard from its largest share
        optimal = False
        notes.append("MILP found no solution in time; rounded the LP relaxation")
    best: dict[int, tuple[float, str]] = {}
    for j, (i, src) in enumerate(cols):
        if i not in best or x[j] > best[i][0]:
            best[i] = (x[j], src)
    return {pairs[i]: src for i, (_, src) in best.items()}, lower, optimal


def plan_recovery(problem: RecoveryProblem, time_limit_s: float = 5.0) -> RecoveryPlan:
    """Returns the assignment of sources minimising the recovery time: the balanced choice
    where it meets its lower bound (provably optimal, ``balanced_choice``), else the MILP
    (HiGHS) with its LP relaxation as the lower bound."""
    start = time.perf_counter()
    pairs = problem.missing()
    notes: list[str] = []
    choice: dict[tuple[str, str], str] = {}
    lower, optimal = makespan_s(problem, {}), True
    if pairs:
        choice, bound = balanced_choice(problem, pairs)
        lower = bound + problem.fixed_s()
        if makespan_s(problem, choice) > lower + bound * 1e-12:  # short of its bound
            choice, lower, optimal = _milp_choice(problem, pairs, time_limit_s, notes)
    transfers = []
    for node in sorted(problem.need):
        for shard in sorted(problem.need[node]):
            src = choice.get((node, shard), LOCAL)
            transfers.append(Transfer(node, shard, src, problem.shard_bytes[shard]))
    by = {LOCAL: 0, STORAGE: 0, "peer": 0}
    for t in transfers:
        by[t.source if t.source in (LOCAL, STORAGE) else "peer"] += t.bytes
    return RecoveryPlan(
        transfers=transfers,
        bytes_local=by[LOCAL],
        bytes_from_peers=by["peer"],
        bytes_from_storage=by[STORAGE],
        predicted_recovery_s=makespan_s(problem, choice),
        baseline_recovery_s=baseline_s(problem),
        lower_bound_s=lower,
        optimal=optimal,
        solve_time_s=time.perf_counter() - start,
        notes=notes,
    )


def problem_from_plans(
    old: Plan,
    new: Plan,
    model: ModelSpec,
    old_cluster: Cluster,
    new_cluster: Cluster,
    storage_bytes_per_s: float,
    held: dict[str, frozenset[str]] | None = None,
) -> RecoveryProblem:
    """Returns the recovery problem of moving from ``old`` to ``new``: survivors hold what
    their devices held under ``old`` (or ``held``, e.g. the verified copies on disk)."""
    alive = {n.name for n in new_cluster.nodes}
    if held is None:
        held = {n: s for n, s in node_shards(old, model).items() if n in alive}
    nic = {n.name: n.network_bytes_per_s for n in old_cluster.nodes}
    nic.update({n.name: n.network_bytes_per_s for n in new_cluster.nodes})
    return RecoveryProblem(
        shard_bytes=shard_bytes(model),
        need=node_shards(new, model),
        held={n: s for n, s in held.items() if n in alive},
        nic_bytes_per_s=nic,
        storage_bytes_per_s=storage_bytes_per_s,
    )


def expected_recovery_s(
    shard_total_bytes: float, nodes: int, network_bytes_per_s: float, storage_bytes_per_s: float
) -> float:
    """Returns the modelled recovery time after one of ``nodes`` identical data-parallel nodes
    is preempted: its replacement's shards come from the survivors (one peer per shard, spread
    over the peers) and storage together, so the bottleneck is its own NIC or their sum."""
    if nodes <= 1:
        return shard_total_bytes / min(network_bytes_per_s, storage_bytes_per_s)
    share = shard_total_bytes / nodes  # what the lost node held, re-fetched by its successor
    sources = (nodes - 1) * network_bytes_per_s + storage_bytes_per_s
    return share / min(network_bytes_per_s, sources)
