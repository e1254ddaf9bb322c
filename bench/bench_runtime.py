"""Predicted against measured step time and peak memory: profile this CPU, then run plans
on 2 processes: the parallel layouts, each plan feature the runtime honours (ZeRO-1/2/3,
recomputation, bf16, sequence parallelism), and the dp2 plan through ``launch --elastic``.

The profile measures what a training step runs here (layers, embedding, head with loss,
AdamW step, gloo point-to-point, all-reduce and ZeRO's all-gather and reduce-scatter, the
pipelining overhead, TP collectives with and without sequence parallelism, a ZeRO-3
layer's gathers and reduce-scatters);
``estimate`` predicts each plan from it. Each plan runs ``--repeats`` times; the measured
time is the median of the runs' median step times. The load average (1 min) is read
before and after each run: other jobs on this machine inflate the measurements, so the
bench (profile and runs, which inherit it) raises its own priority (``--nice``, as root)
to measure the machine rather than its neighbours' load.

Run: .venv/bin/python bench/bench_runtime.py [--steps 8] [--repeats 3] [--keep DIR] [--cpu]
Prints one row per plan and exits 1 if any prediction of step time or peak memory is off
by more than 20%, or a step under ``--elastic`` takes more than 10% longer than without. ``--cpu``
adds each plan's CPU time (user+sys) per step and rank, which other jobs' load inflates
far less than wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from hetplan.cluster import load_cluster
from hetplan.cost.estimate import estimate
from hetplan.measured.profile_db import LINKS, ProfileDB
from hetplan.model import load_model
from hetplan.plan import load_plan
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.runtime.profile import profile_model

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
DP2 = [(4, [(4, [A])]), (4, [(4, [B])])]
ELASTIC = " --elastic"
# plan features: name -> (schedule, micro-batch, virtual stages, pipelines, plan fields)
FEATURES = {
    "dp2 zero1": ("1F1B", 2, 1, DP2, {"zero_stage": 1}),
    "dp2 zero2": ("1F1B", 2, 1, DP2, {"zero_stage": 2}),
    "dp2 zero3": ("1F1B", 2, 1, DP2, {"zero_stage": 3}),
    # unequal micro-batch counts: each layer synced once a step (cost.sharding.deferred_sync)
    "dp2 uneven 2:6 zero3": ("1F1B", 2, 1, PLANS["dp2 uneven 2:6"][3], {"zero_stage": 3}),
    "dp2 full recompute": ("1F1B", 2, 1, DP2, {"recompute": "full"}),
    "dp2 selective recompute": ("1F1B", 2, 1, DP2, {"recompute": "selective"}),
    "dp2 bf16": ("1F1B", 2, 1, DP2, {"precision": "bf16"}),
    # every micro-batch in flight at once: a weight copy kept per micro-batch shows here
    "pp2 GPipe bf16": ("GPipe", 2, 1, PLANS["pp2 GPipe"][3], {"precision": "bf16"}),
    "tp2 sequence parallel": ("1F1B", 2, 1, [(8, [(4, [A, B])])], {"sequence_parallel": True}),
}


def write_plan(
    path: Path, schedule: str, mb: int, v: int, pipes: list, fields: dict | None = None
) -> Path:
    """Writes one bench plan."""
    data = {
        "global_batch_size": sum(b for b, _ in pipes),
        "micro_batch_size": mb,
        "precision": "fp32",
        "schedule": schedule,
        # the runtime reduces gradients after the pipeline's step, not under its backward
        "overlap_grad_reduce": False,
        "pipelines": [
            {"batch_size": b, "stages": [{"layers": n, "devices": d} for n, d in st]}
            for b, st in pipes
        ],
    }
    if v > 1:
        data["virtual_stages"] = v
    data.update(fields or {})
    path.write_text(json.dumps(data))
    return path


def profile_round(root: Path, model_path: Path, reps: int, k: int) -> tuple[ProfileDB, float]:
    """Profiles this CPU into round ``k``'s database; returns it and the load average."""
    load = os.getloadavg()[0]
    db = ProfileDB(root / f"profile{k}.sqlite")
    model = load_model(str(model_path))
    profile_model(
        db,
        "cpu",
        model,
        [2],
        [1, 2],
        torch.device("cpu"),
        reps=reps,
        links=True,
        precisions=("fp32", "bf16"),
    )
    return db, load


def write_cluster(path: Path, db: ProfileDB) -> Path:
    """Writes the 2-device cluster file naming the profiled CPU (analytical figures too)."""
    figures = db.device_figures("cpu")
    assert figures is not None
    tflops, gbps = figures
    path.write_text(
        "gpu_types:\n"
        f"  cpu: {{fp16_tflops: {tflops:.4f}, bf16_tflops: {tflops:.4f}, "
        f"fp32_tflops: {tflops:.4f}, memory_gb: 16, "
        f"hbm_gbyte_per_s: {gbps:.2f}}}\n"
        "nodes:\n  - {name: host, gpu: cpu, gpus: 2, intra_node_bandwidth: 2 GB/s}\n"
    )
    return path


AUTOGROUP = Path("/proc/self/autogroup")


def set_priority(nice: int) -> bool:
    """Sets this process's niceness and its scheduler autogroup's (which the kernel weighs
    against other sessions'); returns whether it could."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        if AUTOGROUP.exists():
            AUTOGROUP.write_text(str(nice))
    except OSError:
        return False
    return True


def _descendants(root: int) -> list[int]:
    """Returns the process ids below ``root`` (from /proc)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parent.items() if p == pid]
        out += kids
        todo += kids
    return out


def keep_priority(nice: int, stop: threading.Event) -> None:
    """Gives the bench's descendants ``nice`` until ``stop``: torchrun starts each worker in
    a session (an autogroup) of its own, which would otherwise compete at the default."""
    while not stop.wait(0.2):
        for pid in _descendants(os.getpid()):
            try:
                group = Path(f"/proc/{pid}/autogroup")
                if int(group.read_text().split()[-1]) != nice:
                    group.write_text(str(nice))
            except (OSError, ValueError):
                continue


def group_nice() -> int:
    """Returns the niceness of this process's scheduler autogroup (0 without one)."""
    return int(AUTOGROUP.read_text().split()[-1]) if AUTOGROUP.exists() else 0


LINK_NAMES = {
    "p2p": "gloo p2p",
    "allreduce": "all-reduce",
    "allgather": "all-gather",
    "reduce_scatter": "reduce-scatter",
}


def _describe(links: dict[str, tuple[float, float] | None]) -> str:
    """Returns the profiled link figures in words (latency per ring step for collectives)."""
    out = []
    for kind, name in LINK_NAMES.items():
        fig = links.get(kind)
        if fig is not None:
            step = " per step" if kind != "p2p" else ""
            out.append(f"{name} {fig[0] * 1e6:.0f} us{step} + {fig[1] / 1e9:.2f} GB/s")
    one = links.get("scalar")
    if one is not None:
        out.append(f"one number {one[0] * 1e6:.0f} us per tree step")
    over = links.get("pipeline")
    if over is not None:
        out.append(f"pipelining {over[0] * 1e6:.0f} us/action")
    return ", ".join(out)


def _children_cpu_s() -> float:
    """Returns user+sys seconds of this process's finished descendants (torchrun's workers
    included: each parent waits for its children)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> int:
    """Profiles and runs every plan in rounds, prints the table; returns the exit code."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of profile + runs (median)")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions in the profile")
    ap.add_argument("--only", default=None, help="comma-separated plan names")
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--nice", type=int, default=-10, help="niceness of the bench (0: as is)")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="also measure CPU time (user+sys) per step and rank: each plan runs again with "
        "twice the steps, the difference divided by the extra steps (load-independent)",
    )
    args = ap.parse_args()
    console = Console(width=200)
    before = group_nice()
    if args.nice and not set_priority(args.nice):
        console.print(f"cannot set niceness {args.nice}: measuring at normal priority")
    stop = threading.Event()
    keeper = threading.Thread(target=keep_priority, args=(args.nice, stop), daemon=True)
    if args.nice:
        keeper.start()
    try:
        return run_bench(args, console)
    finally:
        stop.set()
        if keeper.is_alive():
            keeper.join()
        if AUTOGROUP.exists() and args.nice:
            set_priority(before)  # the autogroup is the whole session's: give it back


def run_bench(args: argparse.Namespace, console: Console) -> int:
    """Profiles and runs every plan in rounds, prints the table; returns the exit code."""
    root = args.keep or Path(tempfile.mkdtemp(prefix="hetplan-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    (root / "model").mkdir(exist_ok=True)
    model_path = root / "model" / "config.json"
    model_path.write_text(json.dumps(MODEL))
    load_model(str(model_path))  # a malformed config fails here, before any run
    torch.set_num_threads(1)
    every: dict[str, tuple[Any, ...]] = {**{k: (*v, {}) for k, v in PLANS.items()}, **FEATURES}
    every["dp2" + ELASTIC] = every["dp2"]  # the same plan through launch --elastic
    names = args.only.split(",") if args.only else list(every)
    plans = {}
    for name in names:
        schedule, mb, v, pipes, fields = every[name]
        path = root / f"{name.replace(' ', '_')}.json"
        plans[name] = write_plan(path, schedule, mb, v, pipes, fields)
    mem_pred: dict[str, float] = {}
    mem_meas: dict[str, list[float]] = {n: [] for n in names}
    pred: dict[str, list[float]] = {n: [] for n in names}
    meas: dict[str, list[float]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    profile_loads, sources = [], {}
    for k in range(args.repeats):
        db, load = profile_round(root, model_path, args.reps, k)
        profile_loads.append(load)
        cluster_path = root / "cluster.yaml"
        if k == 0:
            write_cluster(cluster_path, db)
        cluster = load_cluster(str(cluster_path))
        gpu = cluster.nodes[0].gpu
        links = {kind: db.link_figures(gpu, kind) for kind in LINKS}
        console.print(f"round {k}: profiled at load {load:.1f}: " + _describe(links))
        for name, plan_path in plans.items():
            cfg = RunConfig(
                plan=str(plan_path),
                model=str(model_path),
                cluster=str(cluster_path),
                steps=args.steps,
                threads=1,
                warmup_steps=2,
            )
            # the model as the run trains it (its dropout), as launch predicts it
            est = estimate(load_plan(plan_path), cfg.model_spec(), cluster, profile=db)
            loads[name].append(os.getloadavg()[0])
            if name.endswith(ELASTIC):
                from hetplan.elastic.elastic_run import run_elastic

                work = root / f"elastic_{k}"
                shutil.rmtree(work, ignore_errors=True)
                local = replace(cfg, local_dir=str(work / "local"), storage=str(work / "store"))
                record = run_elastic(local, 1e9)
            else:
                before = _children_cpu_s()
                record = run_local(cfg)
                if args.cpu:  # the same run with more steps: the difference is steady steps
                    mid = _children_cpu_s()
                    run_local(replace(cfg, steps=2 * args.steps))
                    extra = _children_cpu_s() - mid - (mid - before)
                    cpu[name].append(extra / args.steps / record["world_size"])
            meas[name].append(record["measured_step_time_s"])
            mem_meas[name].append(max(record["peak_memory_bytes"].values()))
            mem_pred[name] = est.max_memory_bytes
            loads[name].append(os.getloadavg()[0])
            pred[name].append(est.iteration_time_s)
            sources[name] = est.compute_source
            console.print(
                f"  {name}: predicted {pred[name][-1]:.4f} s, measured {meas[name][-1]:.4f} s"
            )
    table = Table(
        title=f"predicted vs measured step time, 2 CPU processes x 1 thread, median of "
        f"{args.repeats} rounds ({root})"
    )
    cols = (
        "plan",
        "predicted s",
        "measured s",
        "error",
        "per-round error",
        "load",
        "source",
        "pred. MB",
        "meas. MB",
        "mem. error",
    )
    if args.cpu:
        cols += ("CPU s/step/rank", "vs CPU")
    for col in cols:
        table.add_column(col, justify="right")
    worst = worst_mem = 0.0
    for name in names:
        p, m = statistics.median(pred[name]), statistics.median(meas[name])
        err = p / m - 1
        worst = max(worst, abs(err))
        mem_err = mem_pred[name] / statistics.median(mem_meas[name]) - 1
        worst_mem = max(worst_mem, abs(mem_err))
        rounds = " ".join(f"{a / b - 1:+.0%}" for a, b in zip(pred[name], meas[name], strict=True))
        table.add_row(
            name,
            f"{p:.4f}",
            f"{m:.4f}",
            f"{err:+.1%}",
            rounds,
            f"{min(loads[name]):.1f}-{max(loads[name]):.1f}",
            sources[name],
            f"{mem_pred[name] / 1e6:.1f}",
            f"{statistics.median(mem_meas[name]) / 1e6:.1f}",
            f"{mem_err:+.1%}",
            *_cpu_cells(cpu[name], p),
        )
    console.print(table)
    console.print(
        f"niceness {os.getpriority(os.PRIO_PROCESS, 0)}; load average (1 min) while profiling: "
        f"{' '.join(f'{x:.1f}' for x in profile_loads)}; worst error {worst:.1%}, "
        f"memory {worst_mem:.1%}"
    )
    overhead = 0.0
    if "dp2" in names and "dp2" + ELASTIC in names:
        ratios = [a / b for a, b in zip(meas["dp2" + ELASTIC], meas["dp2"], strict=True)]
        overhead = statistics.median(ratios) - 1
        console.print(
            f"elastic overhead (dp2 --elastic against dp2, median of the rounds' ratios): "
            f"{overhead:+.1%}, target within 10%"
        )
    return 0 if worst <= 0.2 and worst_mem <= 0.2 and overhead <= 0.1 else 1


def _cpu_cells(cpu: list[float], predicted: float) -> list[str]:
    """Returns the CPU-time cells of a row (none without ``--cpu`` or for elastic runs)."""
    if not cpu:
        return []
    c = statistics.median(cpu)
    return [f"{c:.4f}", f"{predicted / c - 1:+.1%}"]


if __name__ == "__main__":
    sys.exit(main())
