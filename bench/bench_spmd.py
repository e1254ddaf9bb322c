"""SPMD synthesis bench: BERT-base and ViT-Base on 8 V100 + 8 P100 (HAP's setting).

Prints synthesis time (one core) and predicted step time against DP-EV and DP-CP.
P100 figures: NVIDIA Tesla P100 datasheet (SXM2: 18.7 TFLOP/s fp16, 9.3 fp32, 16 GB
HBM2 at 732 GB/s, NVLink 160 GB/s). Usage: python bench/bench_spmd.py [--layers N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hetplan.cluster import cluster_from_dict
from hetplan.spmd import examples
from hetplan.spmd.capture import capture
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


def main() -> None:
    """Runs the bench and prints one JSON line per model."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    devs = devices_from_cluster(cluster_from_dict(CLUSTER))
    for name, factory in (("bert_base", examples.bert_base), ("vit", examples.vit)):
        module, inputs = factory(layers=args.layers)
        t0 = time.perf_counter()
        cap = capture(module, inputs, meta=True)
        capture_s = time.perf_counter() - t0
        out = synthesize(cap, devs)
        print(
            json.dumps(
                {
                    "model": name,
                    "layers": args.layers,
                    "devices": devs.n,
                    "capture_s": round(capture_s, 3),
                    "synthesis_time_s": round(out.synthesis_time_s, 3),
                    "predicted_time_s": out.predicted_time_s,
                    "speedup_vs_dp_ev": out.dp_ev_time_s / out.predicted_time_s,
                    "speedup_vs_dp_cp": out.dp_cp_time_s / out.predicted_time_s,
                    "ratios_v100_p100": [out.program.ratios[0], out.program.ratios[-1]],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
