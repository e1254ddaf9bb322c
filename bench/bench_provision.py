"""Provisioning benchmark (issue 4): front correctness against exhaustive search, search time
on large markets, and GPT-3 175B over the default market.

Run: .venv/bin/python bench/bench_provision.py [--quick] [--mix-bounds] [--mixes LIMIT]
[--floor-gaps] [--mix-searches N] [--only]
"""

from __future__ import annotations

import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
from rich.console import Console
from rich.table import Table

from hetplan.collector import pace_collector
from hetplan.market import Offer, load_market, market_from_dict
from hetplan.model import load_model
from hetplan.search.provision import provision
from hetplan.search.provision_points import ProvisionJob, gpus_label

TYPES = [
    ("A100-80GB", 8, 3.43),
    ("V100-32GB", 8, 0.9),
    ("T4", 4, 0.526),
    ("L4", 1, 0.8),
    ("H100-80GB", 8, 6.88),
    ("A10", 1, 1.29),
    ("L40S", 4, 2.62),
    ("RTX 4090", 1, 0.6),
]


def random_market(rng: random.Random, max_gpus: int, types: int) -> dict[str, object]:
    """Returns a market of ``types`` random offers with at most ``max_gpus`` GPUs each."""
    offers = []
    for gpu, gpn, price in rng.sample(TYPES, types):
        offers.append(
            {
                "gpu": gpu,
                "gpus_per_node": gpn,
                "max_nodes": max(1, max_gpus // gpn),
                "on_demand_usd_per_gpu_hour": round(price * rng.uniform(0.6, 1.4), 3),
            }
        )
    return {"offers": offers}


def _key(res):
    return [
        (tuple(sorted(p.gpus.items())), round(p.time_to_train_s, 6), round(p.total_cost_usd, 6))
        for p in res.front
    ]


def correctness(console: Console, cases: int) -> None:
    """Pruned search against exhaustive search of the same cost model, seeded markets."""
    table = Table(title="Front correctness: bounded search vs exhaustive (same cost model)")
    for col in (
        "seed",
        "types",
        "model",
        "mixes",
        "front",
        "planned",
        "exhaustive planned",
        "pruned",
        "equal",
    ):
        table.add_column(col)
    model = load_model("gpt3-1.3b")
    equal = 0
    for seed in range(cases):
        rng = random.Random(seed)
        mixes = seed < 3
        market = market_from_dict(random_market(rng, 8 if mixes else 32, rng.randint(2, 3)))
        fast = provision(model, market, 20e9, 256, "fp16", mixes=mixes, prune=True)
        full = provision(model, market, 20e9, 256, "fp16", mixes=mixes, prune=False)
        same = _key(fast) == _key(full)
        equal += same
        table.add_row(
            str(seed),
            ",".join(o.gpu.name for o in market.offers),
            model.name,
            "yes" if mixes else "no",
            str(len(fast.front)),
            str(fast.planned),
            str(full.planned),
            str(fast.pruned),
            "yes" if same else "NO",
        )
    console.print(table)
    console.print(f"equal fronts: {equal}/{cases}")


def large_markets(console: Console) -> None:
    """Search time on a market of 8 types with up to 1,024 GPUs each."""
    table = Table(title="Search time, 8 GPU types x up to 1,024 GPUs each (CPU seconds; "
                  "mixes stop planning at their target and list what is left)")  # fmt: skip
    for col in ("model", "mixes", "planned", "pruned", "impossible", "unexplored", "front",
                "search s", "target"):  # fmt: skip
        table.add_column(col)
    market = market_from_dict(
        {
            "offers": [
                {
                    "gpu": g,
                    "gpus_per_node": n,
                    "max_nodes": 1024 // n,
                    "on_demand_usd_per_gpu_hour": p,
                }
                for g, n, p in TYPES
            ]
        }
    )
    for name, mixes, target in (
        ("gpt3-175b", False, 10),
        ("gpt3-13b", False, 10),
        ("gpt3-175b", True, 90),
    ):
        res = provision(
            load_model(name),
            market,
            300e9,
            1536 if "175" in name else 1024,
            "fp16",
            mixes=mixes,
            time_limit_s=float(target) if mixes else None,
        )
        table.add_row(
            name,
            "yes" if mixes else "no",
            str(res.planned),
            str(res.pruned),
            str(res.impossible),
            str(len(res.unexplored)),
            str(len(res.front)),
            f"{res.search_time_s:.1f}",
            f"< {target}",
        )
    console.print(table)


def gpt3_default_market(console: Console) -> None:
    """GPT-3 175B, 300B tokens, default market: the cheapest and the fastest points."""
    start = time.process_time()
    res = provision(load_model("gpt3-175b"), load_market(None), 300e9, 1536, "fp16")
    fastest = min(res.front, key=lambda p: p.time_to_train_s)
    cheapest = min(res.front, key=lambda p: p.total_cost_usd)
    table = Table(title="GPT-3 175B on 300B tokens, default market (on-demand)")
    for col in ("point", "GPUs", "days", "total $", "$/hour"):
        table.add_column(col)
    for label, p in (("fastest", fastest), ("cheapest", cheapest)):
        table.add_row(
            label,
            gpus_label(p.gpus),
            f"{p.time_to_train_s / 86400:.1f}",
            f"{p.total_cost_usd:,.0f}",
            f"{p.usd_per_hour:,.2f}",
        )
    console.print(table)
    saving = 1 - cheapest.total_cost_usd / fastest.total_cost_usd
    console.print(
        f"cheapest saves {saving:.1%} of the fastest point's cost, taking "
        f"{cheapest.time_to_train_s / fastest.time_to_train_s:.1f}x as long "
        f"(front of {len(res.front)} points, {time.process_time() - start:.1f} s)"
    )


def default_market_spot_mixes(console: Console, model_name: str, tokens: float) -> None:
    """Issue 14: `provision --spot --mixes` on the default market, every mix explored or
    pruned by a proven bound (target < 30 s)."""
    model = load_model(model_name)
    wall = time.perf_counter()
    res = provision(model, load_market(None), tokens, model.default_global_batch, "fp16",
                    spot=True, mixes=True)  # fmt: skip
    wall = time.perf_counter() - wall
    table = Table(title="provision --spot --mixes, default market (every mix explored or pruned)")
    for col in ("model", "planned", "pruned", "impossible", "front", "CPU s", "wall s", "target"):
        table.add_column(col)
    cells = (res.planned, res.pruned, res.impossible, len(res.front))
    table.add_row(model_name, *map(str, cells), f"{res.search_time_s:.1f}", f"{wall:.1f}", "< 30 s")
    console.print(table)


def default_market_mixes_limited(console: Console, limit: str) -> None:
    """Issue 14: the whole command `provision --model gpt3-1.3b --spot --mixes --time-limit`
    on the default market, timed from process start to exit (wall, and the child's CPU):
    what was planned, pruned and impossible, the mixes the limit left, and the best any of
    them could reach against the front found (its proven bounds)."""
    import json
    import resource
    import subprocess

    cmd = [sys.executable, "-m", "hetplan", "provision", "--model", "gpt3-1.3b", "--tokens",
           "20e9", "--spot", "--mixes", "--precision", "fp16", "--json"]  # fmt: skip
    if limit != "none":
        cmd += ["--time-limit", limit]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = Table(title=f"provision --spot --mixes on the default market, --time-limit {limit} "
                  "(whole command)")  # fmt: skip
    for col in ("planned", "pruned", "impossible", "unexplored", "front",
                "fastest: front / best unexplored bound", "cheapest: front / best unexplored bound",
                "wall s", "CPU s", "target"):  # fmt: skip
        table.add_column(col)
    if proc.returncode != 0:
        console.print(f"provision failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}")
        return
    out = json.loads(proc.stdout)
    left = out["unexplored"]
    hours = [p["time_to_train_s"] / 3600 for p in out["front"]]
    usd = [p["total_cost_usd"] for p in out["front"]]
    fast = min((u["time_bound_s"] / 3600 for u in left), default=float("nan"))
    cheap = min((u["cost_bound_usd"] for u in left), default=float("nan"))
    table.add_row(
        str(out["configurations_planned"]), str(out["configurations_pruned"]),
        str(out["configurations_impossible"]), str(len(left)), str(len(out["front"])),
        f"{min(hours):.2f} h / {fast:.2f} h", f"${min(usd):,.0f} / ${cheap:,.0f}",
        f"{wall:.1f}", f"{cpu:.1f}", "< 30 s, none unexplored",
    )  # fmt: skip
    console.print(table)


def default_market_mix_bounds(console: Console) -> None:
    """Issue 14: how far the proven bounds alone take `provision --spot --mixes` on the default
    market (GPT-3 1.3B, 2e10 tokens): every (count, count) mix of every two spot offers,
    those no plan can finish (a spot run preempted faster than it progresses, too little
    memory), those a dominating offer stands in for (``provision_dominance``: the RTX 4090
    for the L4, the H200 for the H100), and of the rest those the single-type front prunes
    at their bounds: with the throughput, path and coupled floors alone, with the batch
    floor too (whole micro-batches, layers and GPUs: ``provision_batch``; the floors coupled
    size by size), then with the
    fewest-stages spot bound and the type-aware batch floor (``provision_mixbatch``); and those
    whose time bound is below the fastest single-type point (no front point can prune them:
    they must be planned, or a tighter time bound found). CPU seconds of each step."""
    from hetplan.search import provision as prov
    from hetplan.search import provision_mixes as mixes_mod
    from hetplan.search import provision_points as pts

    job, offers = _default_spot_job()
    start = time.process_time()
    points: list[pts.Point] = []
    prov._single_types(job, offers, points)
    singles_s = time.process_time() - start
    start = time.process_time()
    old, _, _ = mixes_mod.mix_grid(job, offers, batch=False)
    old_s = time.process_time() - start
    start = time.process_time()
    before_grid = job.dominated[0]
    grid, pairs, impossible = mixes_mod.mix_grid(job, offers)
    grid_s = time.process_time() - start
    stood_in = job.dominated[0] - before_grid
    before = pts.front_cost(old.t_lb, points) > old.c_lb
    first = pts.front_cost(grid.t_lb, points) > grid.c_lb
    start = time.process_time()
    mixes_mod.tighten(job, grid, pairs, np.nonzero(first)[0])
    stage_s = time.process_time() - start
    live = pts.front_cost(grid.t_lb, points) > grid.c_lb
    fastest = min(p.time_to_train_s for p in points)
    table = Table(title="Default market, spot mixes, GPT-3 1.3B: what the proven bounds decide")
    for col in ("mixes", "no plan can finish", "dominated offer", "bounded",
                "live: throughput, path, coupled",
                "live: + batch floor", "live: + stage bound, type-aware batch floor",
                "live with time bound < fastest single", "singles CPU s",
                "bounds CPU s (without / with batch)", "stage + type-aware CPU s"):  # fmt: skip
        table.add_column(col)
    table.add_row(
        f"{grid.t_lb.size + impossible + stood_in:,}", f"{impossible:,}", f"{stood_in:,}",
        f"{grid.t_lb.size:,}",
        f"{int(before.sum()):,}", f"{int(first.sum()):,}", f"{int(live.sum()):,}",
        f"{int((live & (grid.t_lb < fastest)).sum()):,}", f"{singles_s:.1f}",
        f"{old_s:.1f} / {grid_s:.1f}", f"{stage_s:.1f}",
    )  # fmt: skip
    console.print(table)


def _default_spot_job() -> tuple[ProvisionJob, list[Offer]]:
    """Returns (job, spot offers sorted as ``provision`` sorts them) for GPT-3 1.3B on 2e10
    tokens over the default market's spot offers, as ``provision --spot --mixes`` builds
    them."""
    from dataclasses import replace as dc_replace

    from hetplan.cost.params import default_params
    from hetplan.search import provision_points as pts
    from hetplan.search.constraints import PlanConstraints
    from hetplan.search.provision_dominance import dominators
    from hetplan.search.spot import SpotTerms

    model = load_model("gpt3-1.3b")
    terms = dc_replace(SpotTerms(), state_bytes=12.0 * model.total_params())
    offers = [o for o in load_market(None).offers if o.has_price("spot")]
    largest = max(o.gpus_per_node for o in offers)  # as provision() sets it
    job = pts.ProvisionJob(model, 20e9, model.default_global_batch, "fp16", True,
                           default_params(), terms, True, True, PlanConstraints(),
                           pricing="spot", largest=largest)  # fmt: skip
    offers.sort(key=lambda o: o.price("spot") / max(pts.offer_floor(job, o).rate_flops))
    return dc_replace(job, dominated_by=dominators(job, offers)), offers


def floor_gaps(console: Console) -> None:
    """Issue 14: where the proven iteration floors are loose. Per spot offer of the default
    market and GPU count (GPT-3 1.3B, batch 512, fp16): the single-type floor provisioning
    prunes with (the throughput, path and coupled floors and the batch floor, at their least
    over the micro-batch sizes) against the best plan the homogeneous search finds on that
    many GPUs (idle GPUs allowed, as provisioning plans them). A ratio near 1 is a tight
    floor; mixes inherit the looseness of their types' floors at large counts."""
    from hetplan.search import provision_points as pts
    from hetplan.search.homogeneous import search_homogeneous
    from hetplan.search.provision_batch import batch_floor_s
    from hetplan.search.provision_bounds import iteration_floor_s

    job, offers = _default_spot_job()
    counts = (32, 128, 256, 512, 1024)
    table = Table(title="Default spot market, GPT-3 1.3B: best plan / iteration floor, by GPUs")
    table.add_column("offer")
    for n in counts:
        table.add_column(f"{n} GPUs", justify="right")
    for offer in offers:
        floor = pts.offer_floor(job, offer)
        row = [offer.name]
        for n in counts:
            nodes = n // offer.gpus_per_node
            if nodes < 1 or nodes > offer.max_nodes or n % offer.gpus_per_node:
                row.append("-")
                continue
            gpus = np.array([n])
            lb = max(
                float(iteration_floor_s(job.model, job.global_batch, [floor], [gpus])[0]),
                float(batch_floor_s(job.model, job.global_batch, [floor], gpus)[0]),
            )
            cluster = job.limits.apply_to_cluster(offer.cluster(nodes, "spot"))
            ranked = search_homogeneous(job.model, cluster, job.global_batch, job.precision,
                                        top_k=1, params=job.params,
                                        exact_counts=False).ranked  # fmt: skip
            row.append(f"{ranked[0][1].iteration_time_s / lb:.2f}" if ranked else "no plan")
        table.add_row(*row)
    console.print(table)


def mix_searches(console: Console, samples: int) -> None:
    """Issue 14: the per-mix cost of exploring. ``samples`` live mixes of the default spot
    market (GPT-3 1.3B: live after the single types' front and every proven bound; seeded
    sample) searched as ``provision_mixes.explore_mixes`` searches them (heterogeneous
    search under the ceiling the single types' front sets, without the single-type
    baseline): how many found a plan under it, wall seconds per mix, and the share spent in
    the generation pass. The live mixes times the mean is what exploring them all costs."""
    from hetplan.search import heterogeneous as het
    from hetplan.search import provision as prov
    from hetplan.search import provision_mixes as mixes_mod
    from hetplan.search import provision_points as pts
    from hetplan.search.het_cache import SearchCache

    job, offers = _default_spot_job()
    points: list[pts.Point] = []
    prov._single_types(job, offers, points)
    grid, pairs, _ = mixes_mod.mix_grid(job, offers)
    first = np.nonzero(pts.front_cost(grid.t_lb, points) > grid.c_lb)[0]
    mixes_mod.tighten(job, grid, pairs, first)
    live = np.nonzero(pts.front_cost(grid.t_lb, points) > grid.c_lb)[0]
    pick = random.Random(1).sample(list(live), min(samples, live.size))
    at = pts.front_cost_at(points)
    cache = SearchCache(job.model, job.params)
    generate = het.SearchState.generate
    spent = [0.0]

    def timed(state: het.SearchState) -> None:
        start = time.perf_counter()
        generate(state)
        spent[0] += time.perf_counter() - start

    het.SearchState.generate = timed
    times, found = [], 0
    try:
        for q in pick:
            a, b = pairs[int(grid.pair[q])]
            cluster = job.limits.apply_to_cluster(
                mixes_mod.mix_cluster(a, int(grid.na[q]), b, int(grid.nb[q]), job.pricing)
            )
            cut = (pts.dominated_from_s(float(grid.usd_hour[q]), points, at)
                   / pts.iterations(job) / float(grid.slow[q]) * (1 + 1e-9))  # fmt: skip
            start = time.perf_counter()
            res = het.search_heterogeneous(job.model, cluster, job.global_batch, job.precision,
                                           1, job.params, job.flash, job.limits, cache=cache,
                                           ceiling_s=cut, single_type=False,
                                           every_node=True)  # fmt: skip
            times.append(time.perf_counter() - start)
            found += bool(res.ranked)
    finally:
        het.SearchState.generate = generate
    table = Table(title=f"Default spot market, GPT-3 1.3B: {len(pick)} sampled live mixes "
                  "searched under their ceilings")  # fmt: skip
    for col in ("live mixes", "sampled", "found a plan", "mean s", "median s", "max s",
                "generation share", "all live at the mean"):  # fmt: skip
        table.add_column(col, justify="right")
    total = sum(times)
    table.add_row(
        f"{live.size:,}", str(len(pick)), str(found), f"{total / len(times):.3f}",
        f"{float(np.median(times)):.3f}", f"{max(times):.2f}",
        f"{spent[0] / total:.0%}", f"{live.size * total / len(times) / 60:.0f} min",
    )  # fmt: skip
    console.print(table)


def owned_and_rented(console: Console) -> None:
    """Issue 17: GPT-3 13B on 1e11 tokens over 32 owned A100-40GB + rented H100-80GB (a small
    market), the front against exhaustive enumeration (no pruning), and the whole command."""
    import resource
    import subprocess
    import tempfile
    from pathlib import Path

    from hetplan.cluster import cluster_from_dict

    owned_yaml = "nodes:\n  - {gpu: A100-40GB, gpus: 8, count: 4, owned: true}\n"
    market = {"offers": [{"gpu": "H100-80GB", "gpus_per_node": 8, "max_nodes": 4,
                          "on_demand_usd_per_gpu_hour": 6.88}]}  # fmt: skip
    model = load_model("gpt3-13b")
    owned = cluster_from_dict({"nodes": [{"gpu": "A100-40GB", "gpus": 8, "count": 4,
                                          "owned": True}]})  # fmt: skip
    search_cpu = time.process_time()
    fast = provision(model, market_from_dict(market), 1e11, 1024, "fp16", owned=owned)
    search_cpu = time.process_time() - search_cpu
    full = provision(model, market_from_dict(market), 1e11, 1024, "fp16", owned=owned,
                     prune=False)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "owned.yaml").write_text(owned_yaml)
        import yaml

        (Path(tmp) / "m.yaml").write_text(yaml.safe_dump(market))
        start = time.perf_counter()
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = subprocess.run(
            [sys.executable, "-m", "hetplan", "provision", "-m", "gpt3-13b", "--tokens", "1e11",
             "--cluster", str(Path(tmp) / "owned.yaml"), "--market", str(Path(tmp) / "m.yaml"),
             "--precision", "fp16", "--json"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        command_s = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    table = Table(title="GPT-3 13B, 1e11 tokens: 32 owned A100-40GB + up to 32 rented H100")
    for col in ("point", "days", "total $", "$/hour", "non-dominated", "search CPU s",
                "command wall/CPU s", "target"):  # fmt: skip
        table.add_column(col)
    for p in fast.front:
        others = [q for q in full.points if q is not p]
        ok = not any(q.time_to_train_s <= p.time_to_train_s and q.total_cost_usd <
                     p.total_cost_usd * (1 - 1e-9) for q in others)  # fmt: skip
        label = " + ".join([f"{n} x {g} (owned)" for g, n in p.owned.items()]
                           + [f"{n} x {g}" for g, n in p.gpus.items()])  # fmt: skip
        table.add_row(label, f"{p.time_to_train_s / 86400:.2f}", f"{p.total_cost_usd:,.0f}",
                      f"{p.usd_per_hour:,.2f}", "yes" if ok else "NO", f"{search_cpu:.1f}",
                      f"{command_s:.1f} / {cpu_s:.1f} (exit {proc.returncode})",
                      "< 15 s")  # fmt: skip
    console.print(table)
    same = [(p.gpus, p.time_to_train_s) for p in fast.front] == [
        (p.gpus, p.time_to_train_s) for p in full.front
    ]
    counts = f"{fast.planned} planned, {fast.pruned} pruned; exhaustive {full.planned}"
    console.print(f"pruned front equals the exhaustive front: {'yes' if same else 'NO'} ({counts})")
    console.print(f"recommended: {fast.reason}")


def break_even_by_hand(console: Console) -> None:
    """Issue 17: a hand-computed break-even utilisation against money.py."""
    from hetplan.cost.money import Ownership, break_even_utilisation

    own = Ownership(25_000.0, 5.0, 0.7, 400.0, 1.0, 1.5, 0.10)
    got = break_even_utilisation(own, 2.06)
    hand = 25_000 / (5 * 8760 * (2.06 - 0.4 * 1.0 * 1.5 * 0.10))
    console.print(f"break-even by hand {hand:.12f}, money.py {got:.12f}, "
                  f"difference {abs(got - hand):.1e} (target < 1e-9)")  # fmt: skip


def main() -> None:
    """Prints the tables (--quick: fewer cases; --mix-bounds: what the proven bounds decide
    for the default market's spot mixes; --mixes-default MODEL: the default market's
    spot mixes, which can take long; --mixes LIMIT: the whole `provision --spot --mixes`
    command on the default market with --time-limit LIMIT, or none; --floor-gaps: best
    plan over floor per offer and GPU count; --mix-searches N: N sampled live mixes
    searched; --only: none of the default tables)."""
    pace_collector()  # as the command line paces it: the figures are the commands'
    console = Console(width=200)
    quick = "--quick" in sys.argv
    only = "--only" in sys.argv
    if not only:
        correctness(console, 5 if quick else 12)
        gpt3_default_market(console)
        break_even_by_hand(console)
        owned_and_rented(console)
    if "--floor-gaps" in sys.argv:
        floor_gaps(console)
    if "--mix-searches" in sys.argv:
        mix_searches(console, int(sys.argv[sys.argv.index("--mix-searches") + 1]))
    if "--mixes" in sys.argv:
        default_market_mixes_limited(console, sys.argv[sys.argv.index("--mixes") + 1])
    if "--mix-bounds" in sys.argv:
        default_market_mix_bounds(console)
    if "--mixes-default" in sys.argv:
        name = sys.argv[sys.argv.index("--mixes-default") + 1]
        default_market_spot_mixes(console, name, 20e9)
    if not (quick or only):
        large_markets(console)


if __name__ == "__main__":
    main()
