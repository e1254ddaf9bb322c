"""Heterogeneous planner benchmark: optimality against an exhaustive oracle, plan quality
against both baselines, search CPU time (one timed run) and peak traced memory (a second,
untimed run under tracemalloc). Prints tables; ``--large`` adds 512 GPUs of 3 types."""

from __future__ import annotations

import argparse
import itertools
import math
import resource
import time
import tracemalloc

import numpy as np
from rich.console import Console
from rich.table import Table

from hetplan.cluster import load_cluster, parse_inline_cluster
from hetplan.collector import pace_collector
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import default_params
from hetplan.model import ModelSpec, load_model
from hetplan.plan import Plan
from hetplan.search.grouping import device_classes, select_pipelines
from hetplan.search.het_tables import Knobs, class_table
from hetplan.search.het_templates import stage_arrays
from hetplan.search.het_variants import build_templates, variants
from hetplan.search.heterogeneous import HeteroResult, search_heterogeneous

Scored = tuple[Plan, Estimate]

TINY = ModelSpec("tiny-4l", "gpt", 4, 512, 8, 8, 2048, 8192, 512)
TYPES = ["A100-80GB", "V100-32GB", "T4", "A10", "L4"]


def _oracle_time(tables, layers: int, total: int) -> float:
    """Exhaustive: every stage sequence and split, then an exact DP over group multisets."""
    k = len(tables)
    avail = tuple(t.groups for t in tables)
    items = []
    for p in range(1, layers + 1):
        for seq in itertools.product(range(k), repeat=p):
            counts = tuple(seq.count(i) for i in range(k))
            if any(c > a for c, a in zip(counts, avail, strict=True)):
                continue
            tau, fixed, caps, sends = stage_arrays(tables, seq)
            for cuts in itertools.combinations(range(1, layers), p - 1):
                b = (0, *cuts, layers)
                ls = [b[i + 1] - b[i] for i in range(p)]
                if any(x > c for x, c in zip(ls, caps, strict=True)):
                    continue
                st = [fixed[j] + ls[j] * tau[j] for j in range(p)]
                items.append((counts, sum(st) + sends, max(st)))
    states = list(itertools.product(*(range(a + 1) for a in avail)))

    def units(z: float) -> int:
        best = {s: 0 for s in states}  # most micro-batches within resources s
        for s in states:
            for counts, fill, bott in items:
                if fill > z or any(c > x for c, x in zip(counts, s, strict=True)):
                    continue
                rest = tuple(x - c for x, c in zip(s, counts, strict=True))
                cap = min(total, int((z - fill) / bott * (1 + 1e-12) + 1e-9) + 1)
                best[s] = max(best[s], best[rest] + cap)
        return best[avail]

    cands = sorted({f + (m - 1) * b for _, f, b in items for m in range(1, total + 1)})
    lo, hi = 0, len(cands) - 1
    if units(cands[hi]) < total:
        return math.inf
    while lo < hi:
        mid = (lo + hi) // 2
        if units(cands[mid]) >= total:
            hi = mid
        else:
            lo = mid + 1
    return cands[lo]


def optimality(cases: int) -> tuple[int, int, float]:
    """Returns (cases within 1%, cases, worst ratio) of search vs oracle on random clusters."""
    params = default_params()
    within, worst = 0, 1.0
    for seed in range(cases):
        rng = np.random.default_rng(seed)
        types = rng.choice(TYPES, size=int(rng.integers(2, 4)), replace=False)
        spec = ",".join(f"{t}:1x{int(rng.choice([1, 2, 4]))}" for t in types)
        cluster = parse_inline_cluster(spec)
        total = int(rng.integers(2, 9))
        knobs = Knobs(1, "none", 0, 1, "fp16", True)
        tables = [class_table(TINY, c, 1, knobs, params) for c in device_classes(cluster)]
        templates = build_templates(tables, TINY.layers, sum(t.groups for t in tables))
        var = variants(templates)
        cnt, fill, bott = var.counts, var.fill, var.bott
        avail = np.array([t.groups for t in tables])
        sel = select_pipelines(cnt, fill, bott, avail, total, (1, int(avail.sum())))
        got = sel.time_s if sel else math.inf
        want = _oracle_time(tables, TINY.layers, total)
        ratio = got / want if math.isfinite(want) else (1.0 if got == want else math.inf)
        worst = max(worst, ratio)
        within += ratio <= 1.01
    return within, cases, worst


def measured(model: ModelSpec, cluster_spec: str, batch: int) -> tuple[HeteroResult, float, float]:
    """Returns the search result, its CPU seconds, and its peak traced memory in bytes
    (from a second run under tracemalloc, which slows Python down, so it is not timed)."""
    cluster = load_cluster(cluster_spec)
    t0 = time.process_time()
    res = search_heterogeneous(model, cluster, batch, "fp16")
    cpu_s = time.process_time() - t0
    tracemalloc.start()
    search_heterogeneous(model, cluster, batch, "fp16")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return res, cpu_s, float(peak)


def main() -> None:
    """Runs the benchmark and prints its tables."""
    pace_collector()  # as the command line paces it: the figures are the commands'
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=50)
    ap.add_argument("--large", action="store_true")
    args = ap.parse_args()
    con = Console(width=240)
    t0 = time.process_time()
    ok, n, worst = optimality(args.cases)
    tab = Table(title="Optimality vs exhaustive oracle (same cost tables)")
    for c in ("cases", "within 1%", "worst ratio", "CPU s"):
        tab.add_column(c, justify="right")
    tab.add_row(
        str(n), f"{ok}/{n} ({ok / n:.0%})", f"{worst:.4f}", f"{time.process_time() - t0:.1f}"
    )
    con.print(tab)
    big = "A100-80GB:16x8,V100-32GB:16x8,T4:32x8"
    amp = ModelSpec("gpt2-24l-1024", "gpt", 24, 1024, 16, 16, 4096, 50257, 1024)
    runs = [
        ("mixed64", "examples/clusters/mixed64.yaml", load_model("gpt3-6.7b"), 1024, 5.0),
        ("mixed64", "examples/clusters/mixed64.yaml", load_model("llama2-13b"), 1024, 5.0),
        ("AMP", "examples/clusters/amp_hetero.yaml", amp, 32, 5.0),
    ]
    if args.large:
        runs.append(("512 GPUs", big, load_model("gpt3-6.7b"), 2048, 60.0))
        runs.append(("512 GPUs", big, load_model("gpt3-13b"), 2048, 60.0))
    tab = Table(title="Plan quality, search CPU time and peak memory (fp16, one core)")
    for c in ("cluster", "model", "plan s", "single-type s", "uniform s", "vs single", "vs uniform",
              "CPU s", "target s", "peak MB", "plan"):  # fmt: skip
        tab.add_column(c, justify="right" if c not in ("plan", "model", "cluster") else "left")
    for name, spec, model, batch, target in runs:
        cluster = load_cluster(spec)
        res, cpu_s, peak = measured(model, spec, batch)
        best = res.ranked[0] if res.ranked else None
        single, uniform = res.baselines["single_type"], res.baselines["uniform"]

        def fmt(x: Scored | None) -> str:
            return "-" if x is None else f"{x[1].iteration_time_s:.3f}"

        def ratio(x: Scored | None, best: Scored | None = best) -> str:
            if x is None or best is None:
                return "-"
            return f"{x[1].iteration_time_s / best[1].iteration_time_s:.2f}x"

        desc = "-"
        if best is not None:
            plan = best[0]
            shapes = sorted({
                "+".join(f"{s.layers}L@{cluster.device_node(s.devices[0]).gpu.name}x{s.tp}"
                         for s in p.stages) + f" b{p.batch_size}"
                for p in plan.pipelines
            })  # fmt: skip
            desc = f"dp={plan.dp} mb={plan.micro_batch_size} rc={plan.recompute} " + " | ".join(
                shapes[:3]
            )
        verdict = "ok" if cpu_s < target and peak < 1e9 else "MISSED"
        tab.add_row(name, model.name, fmt(best), fmt(single), fmt(uniform), ratio(single),
                    ratio(uniform), f"{cpu_s:.2f}", f"<{target:.0f} {verdict}",
                    f"{peak / 2**20:.0f}", desc)  # fmt: skip
    con.print(tab)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    con.print(f"peak resident memory of the benchmark process: {rss_mb:.0f} MB")


if __name__ == "__main__":
    main()
