"""Homogeneous search time and memory at scale (issue 2 targets: < 1 s and < 5 s, < 500 MB).

Run: .venv/bin/python bench/bench_search.py   (one process, one core)
"""

from __future__ import annotations

import os
import resource
import time
import tracemalloc

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from rich.console import Console
from rich.table import Table

from hetplan.cluster import parse_inline_cluster
from hetplan.model import load_model
from hetplan.search.homogeneous import search_homogeneous

CASES = [
    ("gpt3-175b", "A100-80GB:128x8", 1536, "fp16", 1.0),
    ("llama3-405b", "H100-80GB:2048x8", 2048, "bf16", 5.0),
    ("gpt3-6.7b", "A100-80GB:4x8", 1024, "bf16", 1.0),
]


def main() -> None:
    """Prints one row per case: search time, candidates, peak memory, best plan."""
    table = Table(title="Homogeneous search: time and memory on one core")
    for col in (
        "model",
        "cluster",
        "GPUs",
        "candidates",
        "fit",
        "search s",
        "target s",
        "py peak MB",
        "RSS MB",
        "best plan",
        "iter s",
        "MFU",
    ):
        table.add_column(col)
    # warm the imports and caches that a CLI call pays once
    search_homogeneous(load_model("gpt2"), parse_inline_cluster("T4:1x4"), 8, "fp16")
    for name, cluster, batch, prec, target in CASES:
        model = load_model(name)
        cl = parse_inline_cluster(cluster)
        start = time.process_time()
        res = search_homogeneous(model, cl, batch, prec, top_k=5)
        elapsed = time.process_time() - start
        # memory in a second run: tracing slows Python several-fold, so it is not timed
        tracemalloc.start()
        search_homogeneous(model, cl, batch, prec, top_k=5)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        plan, est = res.ranked[0]
        stage = plan.pipelines[0].stages[0]
        desc = (
            f"tp{stage.tp} pp{len(plan.pipelines[0].stages)} dp{plan.dp} "
            f"mb{plan.micro_batch_size} {plan.recompute} z{plan.zero_stage}"
        )
        table.add_row(
            name,
            cluster,
            str(cl.num_gpus),
            str(res.candidates),
            str(res.fitting),
            f"{elapsed:.2f}",
            f"{target:.0f}",
            f"{peak / 1e6:.0f}",
            f"{rss_mb:.0f}",
            desc,
            f"{est.iteration_time_s:.2f}",
            f"{est.mfu:.1%}",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
