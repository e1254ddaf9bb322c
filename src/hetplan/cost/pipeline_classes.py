"""Which pipelines of a plan estimate() may cost once: identical stages on identical hardware.

Two pipelines get identical stage times, transfers, memory, replay and gradient-sync ends
when they have the same batch share; stage by stage the same fields but the devices, on
nodes with the same GPU type, links and price, the same number of the node's devices
talking across nodes, the same neighbour relation (the next stage on the same node or
another); and, stage by stage, the same data-parallel group (the same layer segments held
with the same replicas, so the same reductions and the same ZeRO group). Everything
estimate() computes for a stage is a function of these, so the first pipeline of each
class stands for all of its class.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from operator import attrgetter
from typing import Any

from hetplan.cluster import Node
from hetplan.plan import Plan, Stage

_STAGE_FIELDS = attrgetter(*(f.name for f in fields(Stage) if f.name != "devices"))
"""A stage's fields but its devices, as one tuple."""


def node_key(node: Node) -> tuple[Any, ...]:
    """Returns what the cost model reads of a node besides its name."""
    return (
        node.gpu.name,
        node.gpus,
        node.intra_node_bytes_per_s,
        node.network_bytes_per_s,
        node.usd_per_gpu_hour,
    )


def pipeline_classes(
    plan: Plan,
    node_of: Callable[[str], Node],
    talkers: dict[str, int],
    dp_group: dict[tuple[int, int], Any],
) -> list[int]:
    """Returns, per pipeline, the index of the first pipeline identical to it for the cost
    model (itself when it is the first of its class).

    ``talkers``: per node, its devices exchanging pipeline transfers across nodes;
    ``dp_group``: per (pipeline, stage), an object standing for its data-parallel group
    (compared by identity: the sync layout shares one per group)."""
    fields_of = _STAGE_FIELDS
    first_of: dict[tuple[Any, ...], int] = {}
    out: list[int] = []
    keys: dict[str, tuple[Any, ...]] = {}  # per node name: what the cost model reads of it
    for r, pipe in enumerate(plan.pipelines):
        stages = pipe.stages
        nodes = [node_of(st.devices[0]) for st in stages]
        sig: list[Any] = [pipe.batch_size]
        for j, (st, node) in enumerate(zip(stages, nodes, strict=True)):
            nxt = nodes[(j + 1) % len(nodes)]
            group = dp_group.get((r, j))
            nk = keys.get(node.name)
            if nk is None:
                nk = keys[node.name] = node_key(node)
            sig.append(
                (
                    fields_of(st),
                    st.tp,
                    nk,
                    talkers.get(node.name, 0),
                    nxt.name == node.name,
                    talkers.get(nxt.name, 0),
                    None if group is None else id(group),
                )
            )
        key = tuple(sig)
        out.append(first_of.setdefault(key, r))
    return out


def pipeline_talkers(plan: Plan, node_of: Any) -> dict[str, int]:
    """Returns, per node, how many of its devices exchange pipeline activations or gradients
    with a stage on another node (they send at about the same time, over the node's link)."""
    devs: dict[str, set[str]] = {}
    wrap = plan.virtual_stages > 1  # interleaved chunks also pass from the last stage to the first
    for pipe in plan.pipelines:
        p = len(pipe.stages)
        for j in range(p if wrap else p - 1):
            a, b = pipe.stages[j], pipe.stages[(j + 1) % p]
            na, nb = node_of(a.devices[0]).name, node_of(b.devices[0]).name
            if na != nb and p > 1:
                devs.setdefault(na, set()).update(a.devices)
                devs.setdefault(nb, set()).update(b.devices)
    return {k: len(v) for k, v in devs.items()}
