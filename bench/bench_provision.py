"""Provisioning benchmark (issue 4): front correctness against exhaustive search, search time
on large markets, and GPT-3 175B over the default market.

Run: .venv/bin/python bench/bench_provision.py [--quick]
"""

from __future__ import annotations

import os
import random
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from rich.console import Console
from rich.table import Table

from hetplan.market import load_market, market_from_dict
from hetplan.model import load_model
from hetplan.search.provision import provision

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
    table = Table(title="Search time, 8 GPU types x up to 1,024 GPUs each (CPU seconds)")
    for col in ("model", "mixes", "planned", "pruned", "skipped", "front", "search s", "target"):
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
            max_mix_plans=16,
        )
        table.add_row(
            name,
            "yes" if mixes else "no",
            str(res.planned),
            str(res.pruned),
            str(res.skipped),
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
            str(p.gpus),
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


def main() -> None:
    """Prints the three tables."""
    console = Console(width=200)
    quick = "--quick" in sys.argv
    correctness(console, 5 if quick else 12)
    gpt3_default_market(console)
    if not quick:
        large_markets(console)


if __name__ == "__main__":
    main()
