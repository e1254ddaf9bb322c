"""Optimality gap of every search against an exhaustive enumeration scored by estimate()
(issue 13: "every search's first plan equals the best of an exhaustive enumeration scored by
estimate itself ... report the worst gap found (goal 0)").

The enumerators live in tests/search/test_search_optimality.py (written from the plan-space
definitions, not from the searches' code); this script runs them on more and larger cases:
random homogeneous cases (<= 32 GPUs) plus the issue's gpt3-2.7b on V100-16GB:8x8 (64 GPUs),
random tiny mixed clusters (2-3 GPU types; a few with several nodes per type, where every
stage-to-node placement is enumerated), and provisioning over small markets (single-type
configurations, objectives time and cost). gap = search first / exhaustive best - 1.

Run: .venv/bin/python bench/bench_search_gap.py [--cases N] [--seed S] [--jobs J] [--wide]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from rich.console import Console
from rich.table import Table

from hetplan.cluster import parse_inline_cluster

TESTS = Path(__file__).resolve().parent.parent / "tests" / "search" / "test_search_optimality.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("search_optimality", TESTS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["search_optimality"] = mod
    spec.loader.exec_module(mod)
    return mod


opt = _load()


@dataclass
class Row:
    """One line of the table."""

    search: str
    case: str
    plans: int
    fitting: int
    brute: float
    first: float
    gap: float
    brute_s: float
    search_s: float
    unit: str = "s"
    note: str = ""


def _hom(case: Any) -> list[Row]:
    o = opt.run_homogeneous(case)
    b = o.brute
    return [Row("homogeneous", o.case, b.scored, b.fitting, b.best_s, o.search_s, o.gap,
                b.seconds, o.search_seconds)]  # fmt: skip


def _het(args: tuple[Any, bool]) -> list[Row]:
    case, wide = args
    knobs = opt.WIDE_HET if wide else opt.HetKnobs()
    o = opt.run_heterogeneous(case, knobs=knobs)
    b = o.brute
    classes = opt.node_classes(parse_inline_cluster(case.cluster), case.precision)
    note = "several nodes per type" if any(len(c) > 1 for c in classes) else ""
    note = (note + " (wide knobs)" if wide else note).strip()
    return [Row("heterogeneous", o.case, b.scored, b.fitting, b.best_s, o.search_s, o.gap,
                b.seconds, o.search_seconds, note=note)]  # fmt: skip


def _prov(case: Any) -> list[Row]:
    o = opt.run_provision(case)
    b = o.brute
    return [
        Row("provision/time", o.case, b.scored, b.fitting, o.brute_time_s, o.search_time_s,
            o.time_gap, b.seconds, o.search_seconds, note=f"{o.configurations} configs"),
        Row("provision/cost", o.case, b.scored, b.fitting, o.brute_cost_usd, o.search_cost_usd,
            o.cost_gap, b.seconds, o.search_seconds, unit="$"),
    ]  # fmt: skip


def _run(job: tuple[str, Any]) -> list[Row]:
    kind, arg = job
    return {"hom": _hom, "het": _het, "prov": _prov}[kind](arg)


def het_plan_count(case: Any, wide: bool) -> int:
    """Returns how many plans the heterogeneous enumeration builds for a case."""
    knobs = opt.WIDE_HET if wide else opt.HetKnobs()
    cluster = parse_inline_cluster(case.cluster)
    return sum(1 for _ in opt.heterogeneous_plans(case.model, cluster, case.batch,
                                                  case.precision, knobs))  # fmt: skip


def random_market(seed: int) -> Any:
    """Returns a seeded random two-offer market of at most 32 GPUs per offer."""
    rng = random.Random(seed)
    gpus = rng.sample(opt.HOM_GPUS, 2)
    offers = []
    for g in gpus:
        k = rng.choice([4, 8])
        offers.append((g, k, rng.choice([n for n in (1, 2, 3, 4) if n * k <= 32]),
                       round(rng.uniform(0.3, 4.0), 2)))  # fmt: skip
    return opt.ProvisionCase(rng.choice(opt.HOM_MODELS), tuple(offers),
                             rng.choice([32, 64, 128]))  # fmt: skip


def jobs_for(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """Returns every case to run, in table order."""
    out: list[tuple[str, Any]] = [
        ("hom", opt.HomCase("gpt3-2.7b", "V100-16GB:8x8", 256, "fp16")),  # the case
        ("hom", opt.HomCase("gpt3-2.7b", "V100-16GB:4x8", 256, "fp16")),
    ]
    out += [("hom", opt.random_hom_case(s)) for s in range(args.seed, args.seed + args.cases)]
    het: list[tuple[str, Any]] = []
    seed = args.seed
    while len(het) < args.cases:
        # every fourth may put a type on several nodes (every placement is enumerated)
        case = opt.random_het_case(seed, one_node_per_type=len(het) % 4 != 3)
        seed += 1
        if het_plan_count(case, args.wide) <= args.max_het_plans:
            het.append(("het", (case, args.wide)))
    out += het
    out += [("prov", c) for c in opt.PROVISION_CASES]
    out += [("prov", random_market(s)) for s in range(args.seed, args.seed + args.cases // 4)]
    return out


def _fmt(x: float, unit: str) -> str:
    if math.isinf(x):
        return "no fit"
    return f"${x:,.2f}" if unit == "$" else f"{x:.4f}"


def main() -> None:
    """Prints one row per case and the worst gap per search."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=12, help="random cases per search")
    ap.add_argument("--seed", type=int, default=1000, help="first seed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-het-plans", type=int, default=40_000)
    ap.add_argument("--wide", action="store_true",
                    help="heterogeneous: also selective recomputation, ZeRO 0-3, SP off, "
                         "Interleaved1F1B (the space the search's rewrite documents)")  # fmt: skip
    args = ap.parse_args()
    start = time.perf_counter()
    jobs = jobs_for(args)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, jobs))
    else:
        results = [_run(j) for j in jobs]
    rows = [r for rs in results for r in rs]
    table = Table(title="Search first plan vs exhaustive enumeration scored by estimate()")
    for col in ("search", "case", "plans enumerated", "fit", "brute best s", "search first s",
                "gap %", "brute s", "search s", "note"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("search", "case", "note") else "right")
    worst: dict[str, Row] = {}
    for r in rows:
        style = "red" if r.gap > 1e-9 else ("yellow" if r.gap < -1e-9 else "")
        table.add_row(
            r.search, r.case, str(r.plans), str(r.fitting), _fmt(r.brute, r.unit),
            _fmt(r.first, r.unit), f"{100 * r.gap:+.3f}", f"{r.brute_s:.1f}",
            f"{r.search_s:.2f}", r.note, style=style,
        )  # fmt: skip
        if r.search not in worst or r.gap > worst[r.search].gap:
            worst[r.search] = r
    console = Console(width=220)
    console.print(table)
    for name, r in worst.items():
        console.print(f"worst {name} gap: {100 * r.gap:+.3f}% ({r.case})")
    top = max(rows, key=lambda r: r.gap)
    failing = sum(1 for r in rows if r.gap > 1e-9)
    console.print(
        f"worst gap: {100 * top.gap:+.3f}% ({top.search}: {top.case}); {failing} of {len(rows)} "
        f"rows above 0 (goal 0); {time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
