"""SPMD synthesis bench: BERT-base and ViT-Base on 8 V100 + 8 P100 (HAP's setting).

Part 1 prints synthesis CPU time (one core, ``time.process_time``) and the predicted step
time against DP-EV and DP-CP. P100 figures: NVIDIA Tesla P100 datasheet (SXM2: 18.7
TFLOP/s fp16, 9.3 fp32, 16 GB HBM2 at 732 GB/s, NVLink 160 GB/s).

Part 2 measures the synthesised program against DP-EV on two CPU ranks of different
speeds, run by ``hetplan spmd run`` (torchrun, gloo): both ranks use one thread and rank
1 is throttled to a 50% duty cycle by SIGSTOP/SIGCONT (``spmd/throttle.py``, the method
of ``cpulimit``), so it is half as fast. Usage: python bench/bench_spmd.py [--layers N]
[--skip-run]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import yaml

from hetplan.cluster import cluster_from_dict
from hetplan.collector import pace_collector
from hetplan.spmd import examples
from hetplan.spmd.capture import capture
from hetplan.spmd.cli import plan_module
from hetplan.spmd.costmodel import devices_from_cluster
from hetplan.spmd.synth import synthesize

CLUSTER = {
    "gpu_types": {
        "P100": {
            "fp16_tflops": 18.7,
            "fp32_tflops": 9.3,
            "memory_gb": 16,
            "hbm_gbyte_per_s": 732,
            "intra_node_gbyte_per_s": 160,
            "network_gbit_per_s": 10,
        },
    },
    "nodes": [{"gpu": "V100-16GB", "gpus": 8}, {"gpu": "P100", "gpus": 8}],
}
DUTY = (1.0, 0.5)
"""CPU duty cycle of each rank in the measured run."""
CPU_CLUSTER = {
    "gpu_types": {
        f"cpu-{int(d * 100)}": {
            "fp16_tflops": 0.03 * d,
            "fp32_tflops": 0.03 * d,
            "memory_gb": 8,
            "hbm_gbyte_per_s": 10 * d,
            "intra_node_gbyte_per_s": 2,
            "network_gbit_per_s": 16,
        }
        for d in DUTY
    },
    "nodes": [{"gpu": f"cpu-{int(d * 100)}", "gpus": 1} for d in DUTY],
}
RUN_MODEL = ("hetplan.spmd.examples:mlp", "batch=4096,hidden=256,layers=4")


def synthesis_rows(layers: int) -> list[dict[str, object]]:
    """Returns one row per model: synthesis CPU time and predicted speedups."""
    devs = devices_from_cluster(cluster_from_dict(CLUSTER))
    rows = []
    for name, factory in (("BERT-base", examples.bert_base), ("ViT-Base/16", examples.vit)):
        module, inputs = factory(layers=layers)
        t0 = time.process_time()
        cap = capture(module, inputs, meta=True)
        capture_s = time.process_time() - t0
        out = synthesize(cap, devs)
        rows.append(
            {
                "model": name,
                "capture_cpu_s": capture_s,
                "synth_cpu_s": out.synthesis_time_s,
                "pred_ms": out.predicted_time_s * 1e3,
                "vs_dp_ev": out.dp_ev_time_s / out.predicted_time_s,
                "vs_dp_cp": out.dp_cp_time_s / out.predicted_time_s,
                "ratio_v100": out.program.ratios[0],
                "ratio_p100": out.program.ratios[-1],
            }
        )
    return rows


def measured_step(cluster: str, program: str, steps: int) -> tuple[float, str]:
    """Returns the median step time (s) and ratios of ``hetplan spmd run --program``."""
    hetplan = os.path.join(os.path.dirname(sys.executable), "hetplan")
    cmd = [hetplan, "spmd", "run", "--module", RUN_MODEL[0], "--inputs", RUN_MODEL[1]]
    cmd += ["--cluster", cluster, "--nproc", "2", "--threads", "1,1", "--steps", str(steps)]
    cmd += ["--duty", ",".join(str(d) for d in DUTY), "--program", program]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    m = re.search(r"ratios (\S+) median step ([0-9.]+) s", out.stdout)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{program} run failed:\n{out.stdout}\n{out.stderr[-2000:]}")
    return float(m.group(2)), m.group(1)


def main() -> None:
    """Runs the bench and prints the two tables."""
    pace_collector()  # as the command line paces it: the figures are the commands'
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-run", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"== synthesis, {args.layers} layers, 8x V100-16GB + 8x P100 (target < 10 s CPU)")
    print(
        f"{'model':<12} {'capture s':>9} {'synth s':>8} {'pred ms':>8} "
        f"{'vs DP-EV':>8} {'vs DP-CP':>8} {'b V100':>7} {'b P100':>7}"
    )
    for r in synthesis_rows(args.layers):
        print(
            f"{r['model']:<12} {r['capture_cpu_s']:>9.2f} {r['synth_cpu_s']:>8.2f} "
            f"{r['pred_ms']:>8.1f} {r['vs_dp_ev']:>8.2f} {r['vs_dp_cp']:>8.2f} "
            f"{r['ratio_v100']:>7.4f} {r['ratio_p100']:>7.4f}",
            flush=True,
        )
    if args.skip_run:
        return
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(CPU_CLUSTER, f)
    try:
        plan = plan_module(RUN_MODEL[0], f.name, RUN_MODEL[1])
        predicted = plan.dp_ev_time_s / plan.predicted_time_s
        times: dict[str, list[float]] = {"synth": [], "dp-ev": []}
        ratios = {}
        for _ in range(args.repeats):  # interleaved: the box is shared with other jobs
            for program in times:
                t, ratios[program] = measured_step(f.name, program, args.steps)
                times[program].append(t)
    finally:
        os.unlink(f.name)
    print(f"\n== measured: {RUN_MODEL[0]} ({RUN_MODEL[1]}), 2 gloo CPU ranks, duty {DUTY}")
    print(f"{'program':<8} {'ratios':<14} {'median step s (per run)':<28}")
    for program, ts in times.items():
        print(f"{program:<8} {ratios[program]:<14} {', '.join(f'{t:.4f}' for t in ts):<28}")
    best = {p: min(ts) for p, ts in times.items()}
    print(
        f"measured speedup vs DP-EV: x{best['dp-ev'] / best['synth']:.2f} "
        f"(predicted x{predicted:.2f})"
    )


if __name__ == "__main__":
    main()
