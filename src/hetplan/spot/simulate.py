"""Replaying an availability trace under four policies, side by side.

- ``hetplan``: at each change, what ``launch --elastic`` does: replan (warm start, timed),
  recover peers first (the recovery MILP), redo the work since the last checkpoint after a
  preemption, resume. Arrivals are used when that pays off over the trace's mean time
  between changes H: with the new nodes the run trains ``rate_new x (H - downtime)`` tokens
  against ``rate_now x H`` without (the downtime: a checkpoint, the restart, the replan and
  the joined nodes' recovery).
- ``restart``: Varuna-style: after a loss it moves to the faster plan of the survivors
  with or without the arrivals, and it joins arrivals whenever they make the plan faster;
  every move reloads every node's full state from storage.
- ``wait``: keep the first plan; when nodes are lost, hold the survivors and wait until the
  lost GPUs are available again, then recover the replacements peers first and redo the lost
  work. This is the run provisioning prices (``search/spot.py``).
- ``on-demand``: the first plan on on-demand GPUs at on-demand prices: no preemptions, no
  checkpoints.

The checkpoint interval is Young's optimum sqrt(2 C M) (``search/spot.py``), C the time to
write the first plan's largest node's shards to local disk, M the trace's mean time between
preemptions (its duration over the change points at which a count falls), unless given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hetplan.cluster import Node
from hetplan.elastic.recovery import RecoveryPlan
from hetplan.errors import InputError
from hetplan.report.table import plan_label
from hetplan.search.spot import checkpoint_time_s as plan_checkpoint_s
from hetplan.search.spot import young_daly_interval_s
from hetplan.spot.ledger import Ledger
from hetplan.spot.planner import PlanEntry, Planner
from hetplan.spot.pool import counts_of, key_of, layout
from hetplan.spot.traces import Trace, TracePoint

DEFAULT_RESTART_S = 30.0
"""Relaunching the workers after a change (process start, communicator set-up, warm-up): an
assumption; ``--restart-time`` sets it."""
POLICIES = ("hetplan", "restart", "wait", "on-demand")


@dataclass(frozen=True)
class Settings:
    """What the replay needs besides the trace and the planner."""

    restart_s: float = DEFAULT_RESTART_S
    target_tokens: float | None = None
    interval_s: float | None = None
    """Checkpoint interval; None: Young's optimum from the trace."""
    checkpoint_s: float | None = None
    """Time one checkpoint stalls training; None: the first plan's node state / local disk."""


@dataclass
class Result:
    """Every policy's run and what the replay chose and measured."""

    policies: list[dict[str, Any]]
    interval_s: float
    interval_source: str
    checkpoint_s: float
    mtbf_s: float
    horizon_s: float
    first_plan: str
    first_tokens_per_s: float
    changes: int
    preemption_points: int
    replan_times_s: list[float]
    recovery_times_s: list[float]
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON object ``spot simulate --json`` prints."""
        return {
            "checkpoint_interval_s": _finite(self.interval_s),
            "checkpoint_interval_source": self.interval_source,
            "checkpoint_s": self.checkpoint_s,
            "mtbf_s": _finite(self.mtbf_s),
            "join_horizon_s": self.horizon_s,
            "first_plan": self.first_plan,
            "first_tokens_per_s": self.first_tokens_per_s,
            "changes": self.changes,
            "preemption_points": self.preemption_points,
            "replans": len(self.replan_times_s),
            "replan_time_s": _stats(self.replan_times_s),
            "recovery_time_s": _stats(self.recovery_times_s),
            "policies": self.policies,
            "notes": self.notes,
        }


def _finite(x: float) -> float | None:
    """Returns ``x``, or None for infinity (JSON has no infinity)."""
    return x if math.isfinite(x) else None


def _stats(xs: list[float]) -> dict[str, float] | None:
    if not xs:
        return None
    return {"mean": sum(xs) / len(xs), "max": max(xs), "min": min(xs)}


class _Run:
    """A policy: its ledger, the nodes it holds and the plan in force."""

    def __init__(self, ledger: Ledger, sim: _Sim) -> None:
        self.ledger, self.sim = ledger, sim
        self.entry: PlanEntry | None = None
        self.nodes: tuple[Node, ...] = ()

    def start(self, entry: PlanEntry, point: TracePoint) -> None:
        self.entry, self.nodes = entry, entry.nodes_used()
        self.ledger.run(entry.rate, _gpus(self.nodes), self.sim.usd(self.nodes, point), 0.0)

    def change(self, point: TracePoint) -> None:
        self.ledger.reprice(self.sim.usd(self.nodes, point))


def _names(nodes: tuple[Node, ...]) -> set[str]:
    return {n.name for n in nodes}


class _Elastic(_Run):
    """hetplan (peer-first recovery, arrivals when they pay) or restart (from storage)."""

    def __init__(self, ledger: Ledger, sim: _Sim, from_storage: bool) -> None:
        super().__init__(ledger, sim)
        self.from_storage = from_storage

    def value(self, rate: float, down: float) -> float:
        """Returns what a plan is worth: hetplan, the tokens over the next H seconds after
        the downtime; restart, its rate."""
        if self.from_storage:
            return rate
        return rate * max(self.sim.horizon_s - down, 0.0)

    def change(self, point: TracePoint) -> None:
        sim, led = self.sim, self.ledger
        pool = sim.planner.pool
        avail = sim.available(point)
        used = counts_of(self.nodes)
        kept = layout(pool, {g: min(c, avail.get(g, 0)) for g, c in used.items()})
        preempted = _names(self.nodes) - _names(kept)
        grown = layout(pool, avail)
        if preempted:
            led.preempt()
        must = bool(preempted) or self.entry is None
        if not must and key_of(grown) == key_of(self.nodes):
            led.reprice(sim.usd(self.nodes, point))
            return
        # after a loss both weigh the survivors against the survivors and the arrivals; an
        # arrival alone is weighed against staying. hetplan counts the downtime over the
        # next H seconds; restart (Varuna-style morphing) takes the faster plan
        options = [grown, kept] if must else [grown]
        commit = 0.0 if must else led.commit_cost()
        survivors = frozenset(_names(self.nodes) - preempted)
        best: tuple[float, PlanEntry, float] | None = None
        chosen: RecoveryPlan | None = None
        for nodes in dict.fromkeys(o for o in options if o):
            entry = sim.planner.for_nodes(nodes, self.entry)
            if entry is None:
                continue
            rec = sim.planner.recovery(self.entry, entry, survivors)
            moved = rec.baseline_recovery_s if self.from_storage else rec.predicted_recovery_s
            down = sim.settings.restart_s + entry.replan_time_s + moved + commit
            value = self.value(entry.rate, down)
            if best is None or value > best[0]:
                best = (value, entry, down)
                if not self.from_storage:
                    chosen = rec
        stay = 0.0 if must or self.entry is None else self.value(self.entry.rate, 0.0)
        if best is None or (not must and (best[0] <= stay or best[1] is self.entry)):
            if must:  # nothing fits on what is left: wait for GPUs, holding none
                self.entry, self.nodes = None, ()
                led.run(0.0, 0, 0.0, 0.0)
            else:
                led.reprice(sim.usd(self.nodes, point))
            return
        _, entry, down = best
        if not must:
            led.commit()
            led.joins += 1
        led.replans += 1
        if not self.from_storage:
            sim.replan_times[id(entry)] = entry.replan_time_s
            assert chosen is not None
            sim.recovery_times.append(chosen.predicted_recovery_s)
        nodes = entry.nodes_used()
        self.entry, self.nodes = entry, nodes
        led.run(entry.rate, _gpus(nodes), sim.usd(nodes, point), down)


class _Wait(_Run):
    """Keeps the first plan; waits for lost nodes to come back."""

    def __init__(self, ledger: Ledger, sim: _Sim) -> None:
        super().__init__(ledger, sim)
        self.alive: tuple[Node, ...] = ()
        self.waiting = False

    def start(self, entry: PlanEntry, point: TracePoint) -> None:
        super().start(entry, point)
        self.alive = self.nodes

    def change(self, point: TracePoint) -> None:
        sim, led = self.sim, self.ledger
        assert self.entry is not None
        avail = sim.available(point)
        room = layout(
            sim.planner.pool,
            {g: min(c, avail.get(g, 0)) for g, c in counts_of(self.alive).items()},
        )
        lost = _names(self.alive) - _names(room)
        if lost and not self.waiting:
            led.preempt()
        self.alive = tuple(n for n in self.alive if n.name not in lost)
        need = counts_of(self.nodes)
        back = all(avail.get(g, 0) >= c for g, c in need.items())
        if (lost or self.waiting) and back:
            survivors = frozenset(_names(self.alive))
            rec = sim.planner.recovery(self.entry, self.entry, survivors)
            down = sim.settings.restart_s + rec.predicted_recovery_s
            self.alive, self.waiting = self.nodes, False
            led.replans += 1
            led.run(self.entry.rate, _gpus(self.nodes), sim.usd(self.nodes, point), down)
        elif lost or self.waiting:
            self.waiting = True
            led.run(0.0, _gpus(self.alive), sim.usd(self.alive, point), 0.0)
        else:
            led.reprice(sim.usd(self.nodes, point))


class _OnDemand(_Run):
    def start(self, entry: PlanEntry, point: TracePoint) -> None:
        self.entry, self.nodes = entry, entry.nodes_used()
        usd = sum(
            n.gpus * self.sim.planner.pool.types[n.gpu.name].on_demand_usd_per_gpu_hour
            for n in self.nodes
        )
        self.ledger.run(entry.rate, _gpus(self.nodes), usd, 0.0)

    def change(self, point: TracePoint) -> None:
        return


def _gpus(nodes: tuple[Node, ...]) -> int:
    return sum(n.gpus for n in nodes)


class _Sim:
    """The trace, the planner and the shared figures of one replay."""

    def __init__(self, trace: Trace, planner: Planner, settings: Settings) -> None:
        self.trace, self.planner, self.settings = trace, planner, settings
        self.replan_times: dict[int, float] = {}
        self.recovery_times: list[float] = []
        changes = trace.changes()
        self.horizon_s = trace.duration_s / max(changes, 1)
        self.notes: list[str] = []
        planner.pool.check(trace.types)
        for gpu in trace.types:
            ceiling = planner.pool.types[gpu].max_gpus
            top = max(p.counts.get(gpu, 0) for p in trace.points)
            if top > ceiling:
                self.notes.append(
                    f"the trace reaches {top} {gpu} GPUs; the pool holds {ceiling}: counts capped"
                )

    def available(self, point: TracePoint) -> dict[str, int]:
        return {g: min(c, self.planner.pool.types[g].max_gpus) for g, c in point.counts.items()}

    def usd(self, nodes: tuple[Node, ...], point: TracePoint) -> float:
        """Returns the spot price per hour of ``nodes`` at ``point``."""
        pool = self.planner.pool.types
        return sum(
            n.gpus * point.prices.get(n.gpu.name, pool[n.gpu.name].spot_usd_per_gpu_hour)
            for n in nodes
        )


def checkpoint_time_s(entry: PlanEntry, planner: Planner) -> float:
    """Returns C: the largest node's shard bytes under the plan over the local write rate
    (``search/spot.py``, the block provisioning uses too)."""
    return plan_checkpoint_s(entry.plan, planner.model)


def simulate(trace: Trace, planner: Planner, settings: Settings) -> Result:
    """Returns the four policies' runs through ``trace``."""
    sim = _Sim(trace, planner, settings)
    first = trace.points[0]
    nodes = layout(planner.pool, sim.available(first))
    if not nodes:
        raise InputError("--trace", "its first change point has no GPUs available")
    entry = planner.first(nodes)
    c = (
        settings.checkpoint_s
        if settings.checkpoint_s is not None
        else checkpoint_time_s(entry, planner)
    )
    falls = trace.decreases()
    mtbf = trace.duration_s / falls if falls else math.inf
    if settings.interval_s is not None:
        interval, source = settings.interval_s, "given"
    else:
        interval, source = young_daly_interval_s(c, mtbf), "Young: sqrt(2 C M)"
        if interval <= 0:
            interval = math.inf
    t0 = first.time_s
    target = settings.target_tokens
    runs: list[_Run] = [
        _Elastic(Ledger("hetplan", t0, interval, c, target), sim, from_storage=False),
        _Elastic(Ledger("restart", t0, interval, c, target), sim, from_storage=True),
        _Wait(Ledger("wait", t0, interval, c, target), sim),
        _OnDemand(Ledger("on-demand", t0, math.inf, 0.0, target), sim),
    ]
    for run in runs:
        run.start(entry, first)
    for point in trace.points[1:]:
        for run in runs:
            run.ledger.advance(point.time_s)
            if not run.ledger.done:
                run.change(point)
    for run in runs:
        run.ledger.advance(trace.end_s)
    return Result(
        policies=[r.ledger.summary() for r in runs],
        interval_s=interval,
        interval_source=source,
        checkpoint_s=c,
        mtbf_s=mtbf,
        horizon_s=sim.horizon_s,
        first_plan=plan_label(entry.plan),
        first_tokens_per_s=entry.rate,
        changes=trace.changes(),
        preemption_points=falls,
        replan_times_s=[t for t in sim.replan_times.values() if t > 0],
        recovery_times_s=sim.recovery_times,
        notes=sim.notes,
    )
