"""Baselines for a mixed cluster, scored by the same ``estimate``: the best plan on one GPU
type alone, and the best Megatron-style uniform plan over every GPU."""

from __future__ import annotations

import math

from hetplan.cluster import Cluster
from hetplan.cost.estimate import Estimate, estimate
from hetplan.cost.params import CostParams
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan
from hetplan.search.homogeneous import divisors, search_homogeneous
from hetplan.search.layout import even_layer_split, uniform_plan

Scored = tuple[Plan, Estimate]


def best_single_type(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams,
    flash_attention: bool,
) -> tuple[Scored | None, list[str]]:
    """Returns the fastest homogeneous plan on the nodes of any one class, and notes."""
    notes: list[str] = []
    best: Scored | None = None
    groups: dict[tuple[str, int, float, float], list[str]] = {}
    for n in cluster.nodes:
        sig = (n.gpu.name, n.gpus, n.intra_node_bytes_per_s, n.network_bytes_per_s)
        groups.setdefault(sig, []).append(n.name)
    for sig, names in groups.items():
        sub = cluster.without_nodes({n.name for n in cluster.nodes} - set(names))
        if not sub.nodes[0].gpu.supports(precision):
            notes.append(f"{sig[0]} has no {precision} support; left out")
            continue
        try:
            res = search_homogeneous(
                model, sub, global_batch, precision, 1, params, flash_attention=flash_attention
            )
        except InputError as exc:
            notes.append(f"single-type baseline on {sig[0]}: {exc.reason}")
            continue
        top = res.ranked[0] if res.ranked else None
        if top and (best is None or top[1].iteration_time_s < best[1].iteration_time_s):
            best = top
    return best, notes


def best_uniform(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams,
    flash_attention: bool,
    finalists: int = 12,
) -> Scored | None:
    """Returns the fastest Megatron-style plan over all GPUs: equal layers and batch shares."""
    if not all(n.gpu.supports(precision) for n in cluster.nodes):
        return None
    n_gpus = cluster.num_gpus
    gpn = math.gcd(*(n.gpus for n in cluster.nodes))
    slowest = max(
        cluster.nodes, key=lambda n: (1 / n.gpu.peak_flops(precision), -n.gpu.memory_bytes)
    )
    smallest = min(n.gpu.memory_bytes for n in cluster.nodes)
    cands: list[tuple[float, Plan]] = []
    for tp in divisors(gpn):
        if model.heads % tp or model.ffn % tp or (model.kv_heads % tp and tp % model.kv_heads):
            continue
        for pp in divisors(n_gpus // tp):
            dp = n_gpus // (tp * pp)
            if pp > model.layers or global_batch % dp:
                continue
            for mb in divisors(global_batch // dp):
                if mb > 8:
                    continue
                m = global_batch // dp // mb
                for rc in ("none", "full"):
                    for zero in (0, 1) if dp > 1 else (0,):
                        plan = uniform_plan(
                            cluster, model.layers, tp, pp, dp, mb, global_batch,
                            precision=precision, recompute=rc, zero_stage=zero,
                            sequence_parallel=tp > 1, flash_attention=flash_attention,
                        )  # fmt: skip
                        if not _fits_roughly(model, plan, smallest, params):
                            continue
                        split = max(even_layer_split(model.layers, pp))
                        work = (m + pp - 1) * split * (1.33 if rc == "full" else 1.0) * mb / tp
                        speed = slowest.gpu.peak_flops(precision)
                        cands.append((work / speed, plan))
    cands.sort(key=lambda c: c[0])
    best: Scored | None = None
    for _, plan in cands[: finalists * 4]:
        est = estimate(plan, model, cluster, params, validate=False)
        if est.fits and (best is None or est.iteration_time_s < best[1].iteration_time_s):
            best = (plan, est)
    return best


def _fits_roughly(model: ModelSpec, plan: Plan, capacity_bytes: float, params: CostParams) -> bool:
    """Returns False when the plan's weights and optimizer state alone overflow the smallest
    GPU (a quick filter; ``estimate`` decides the rest)."""
    pipe = plan.pipelines[0]
    worst = max(s.layers for s in pipe.stages) * model.layer_params() / pipe.stages[0].tp
    worst += model.embedding_params() / pipe.stages[0].tp
    per_param = 2 + 4 + 12 / (plan.dp if plan.zero_stage else 1)
    return worst * per_param + params.memory_reserve_bytes <= capacity_bytes
