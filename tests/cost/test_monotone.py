"""Faster hardware never makes a plan slower: on random small mixed clusters, every plan of
the heterogeneous space (the enumeration written apart from the searches, in
``tests/search/test_search_optimality.py``) estimated again with one GPU type's peaks, HBM,
intra-node and network bandwidth raised is no slower. Provisioning's dominated offers rest
on this (``search/provision_dominance.py``), and a planner whose prediction rises when a
GPU gets faster ranks plans by an artefact.

At fb1a91b, 6 of these 9 cases had plans up to 12.7% slower on the faster GPUs: a
mixed data-parallel group overlapped its reduction with its fastest member's last
backward, so a faster member shrank a slower one's window, and a stage holding several
layer segments added each segment's exposure after the latest end."""

from __future__ import annotations

import dataclasses
import importlib.util
import random
import sys
from pathlib import Path

import pytest

from hetplan.cluster import Cluster, Node, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.errors import InputError

_PATH = Path(__file__).resolve().parent.parent / "search" / "test_search_optimality.py"


def _enumerator():
    name = "search_optimality_enumeration"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


FIGURES = ("flops", "hbm", "intra", "network", "all")


def _faster(node: Node, figure: str, factor: float) -> Node:
    g = node.gpu
    if figure in ("flops", "all"):
        g = dataclasses.replace(
            g,
            fp16_flops=g.fp16_flops * factor,
            fp32_flops=g.fp32_flops * factor,
            bf16_flops=None if g.bf16_flops is None else g.bf16_flops * factor,
            tf32_flops=None if g.tf32_flops is None else g.tf32_flops * factor,
        )
    if figure in ("hbm", "all"):
        g = dataclasses.replace(g, hbm_bytes_per_s=g.hbm_bytes_per_s * factor)
    out = dataclasses.replace(node, gpu=g)
    if figure in ("intra", "all"):
        out = dataclasses.replace(out, intra_node_bytes_per_s=node.intra_node_bytes_per_s * factor)
    if figure in ("network", "all"):
        out = dataclasses.replace(out, network_bytes_per_s=node.network_bytes_per_s * factor)
    return out


@pytest.mark.parametrize("seed", range(100, 118, 2))
def test_one_faster_gpu_type_makes_no_plan_slower(seed):
    so = _enumerator()
    case = so.random_het_case(seed, one_node_per_type=False)
    cluster = parse_inline_cluster(case.cluster)
    rng = random.Random(seed)
    gpu = rng.choice(sorted({n.gpu.name for n in cluster.nodes}))
    factor = rng.choice([1.2, 1.5, 2.0])
    figure = rng.choice(FIGURES)
    faster = Cluster(
        tuple(_faster(n, figure, factor) if n.gpu.name == gpu else n for n in cluster.nodes)
    )
    params = default_params()
    checked = 0
    for k, plan in enumerate(
        so.heterogeneous_plans(case.model, cluster, case.batch, case.precision, so.WIDE_HET)
    ):
        if k >= 1500:
            break
        try:
            before = estimate(plan, case.model, cluster, params)
        except (InputError, ValueError):
            continue
        after = estimate(plan, case.model, faster, params)
        assert after.iteration_time_s <= before.iteration_time_s * (1 + 1e-9), (
            f"{case.name()}, {gpu} {figure} x{factor}: {before.iteration_time_s:.6g} s -> "
            f"{after.iteration_time_s:.6g} s for {plan}"
        )
        checked += 1
    assert checked >= 200
