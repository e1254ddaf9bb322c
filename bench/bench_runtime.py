"""Predicted against measured step time: profile this CPU, then run plans on 2 processes.

Run: .venv/bin/python bench/bench_runtime.py [--steps 6] [--keep DIR]
Prints one row per plan and exits 1 if any prediction is off by more than 20%.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from hetplan.cluster import load_cluster
from hetplan.cost.estimate import estimate
from hetplan.model import load_model
from hetplan.plan import load_plan
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.runtime.profile import profile_model
from hetplan.runtime.profile_db import ProfileDB

MODEL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}
A, B = "host:0", "host:1"
# name -> (schedule, micro-batch, virtual stages, [(batch, [(layers, devices)])])
PLANS = {
    "dp2": ("1F1B", 2, 1, [(4, [(4, [A])]), (4, [(4, [B])])]),
    "dp2 uneven 2:6": ("1F1B", 2, 1, [(2, [(4, [A])]), (6, [(4, [B])])]),
    "pp2 GPipe": ("GPipe", 2, 1, [(8, [(2, [A]), (2, [B])])]),
    "pp2 1F1B 1:3": ("1F1B", 2, 1, [(8, [(1, [A]), (3, [B])])]),
    "pp2 Interleaved1F1B": ("Interleaved1F1B", 2, 2, [(8, [(2, [A]), (2, [B])])]),
    "tp2": ("1F1B", 2, 1, [(8, [(4, [A, B])])]),
}


def write_plan(path: Path, schedule: str, mb: int, v: int, pipes: list) -> Path:
    """Writes one bench plan."""
    data = {
        "global_batch_size": sum(b for b, _ in pipes),
        "micro_batch_size": mb,
        "precision": "fp32",
        "schedule": schedule,
        "pipelines": [
            {"batch_size": b, "stages": [{"layers": n, "devices": d} for n, d in st]}
            for b, st in pipes
        ],
    }
    if v > 1:
        data["virtual_stages"] = v
    path.write_text(json.dumps(data))
    return path


def main() -> int:
    """Profiles, runs every plan, prints the table; returns the exit code."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="hetplan-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "model").mkdir(exist_ok=True)
    model_path = root / "model" / "config.json"
    model_path.write_text(json.dumps(MODEL))
    model = load_model(str(model_path))
    torch.set_num_threads(1)
    db = ProfileDB(root / "profile.sqlite")
    profile_model(db, "cpu", model, [2], [1, 2], torch.device("cpu"), reps=7)
    figures = db.device_figures("cpu")
    assert figures is not None
    tflops, gbps = figures
    cluster_path = root / "cluster.yaml"
    cluster_path.write_text(
        "gpu_types:\n"
        f"  cpu: {{fp16_tflops: {tflops:.4f}, fp32_tflops: {tflops:.4f}, memory_gb: 16, "
        f"hbm_gbyte_per_s: {gbps:.2f}}}\n"
        "nodes:\n  - {name: host, gpu: cpu, gpus: 2, intra_node_bandwidth: 2 GB/s}\n"
    )
    cluster = load_cluster(str(cluster_path))
    table = Table(title=f"predicted vs measured step time, 2 CPU processes x 1 thread ({root})")
    for col in ("plan", "predicted s", "measured s", "error", "source"):
        table.add_column(col, justify="right")
    worst = 0.0
    for name, (schedule, mb, v, pipes) in PLANS.items():
        plan_path = write_plan(root / f"{name.replace(' ', '_')}.json", schedule, mb, v, pipes)
        est = estimate(load_plan(plan_path), model, cluster, profile=db)
        cfg = RunConfig(
            plan=str(plan_path),
            model=str(model_path),
            cluster=str(cluster_path),
            steps=args.steps,
            threads=1,
            warmup_steps=2,
        )
        measured = run_local(cfg)["measured_step_time_s"]
        err = est.iteration_time_s / measured - 1
        worst = max(worst, abs(err))
        table.add_row(
            name,
            f"{est.iteration_time_s:.4f}",
            f"{measured:.4f}",
            f"{err:+.1%}",
            est.compute_source,
        )
    Console().print(table)
    Console().print(
        f"cpu: {tflops * 1e3:.1f} GFLOP/s fp32 matmul, {gbps:.1f} GB/s copy; "
        f"worst error {worst:.1%}"
    )
    return 0 if worst <= 0.2 else 1


if __name__ == "__main__":
    sys.exit(main())
