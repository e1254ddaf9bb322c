"""Builds src/hetplan/data/gpu_catalog.csv from the team's shared datasheet and price tables.

Run from the repository root with the shared folder beside it:
    python tools/build_gpu_catalog.py ../shared/data
The output keeps every source string; rows marked unverified stay marked. Two tables beside
this script add to the shared ones: gpu_specs_extra.csv (GPUs the shared table lacks, same
columns) and gpu_tf32.csv (dense TF32 tensor-core peak of every catalog GPU, with its source;
blank where the GPU has no TF32 tensor cores).
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

# canonical name -> (gpu column, form-factor prefix) in gpu_specs.csv
SPEC_ROWS = {
    "A100-40GB": ("A100-40GB", "SXM"),
    "A100-80GB": ("A100-80GB", "SXM"),
    "A100-80GB-PCIe": ("A100-80GB", "PCIe"),
    "H100-80GB": ("H100-80GB", "SXM"),
    "H100-80GB-PCIe": ("H100-80GB", "PCIe"),
    "H200-141GB": ("H200-141GB", "SXM"),
    "H20-96GB": ("H20-96GB", "SXM"),
    "GH200-96GB": ("GH200-96GB", "Superchip"),
    "V100-16GB": ("V100-16GB", "SXM"),
    "V100-32GB": ("V100-32GB", "SXM"),
    "A10": ("A10", "PCIe"),
    "L4": ("L4", "PCIe"),
    "L40S": ("L40S", "PCIe"),
    "T4": ("T4", "PCIe"),
    "RTX 3090": ("RTX 3090", "PCIe"),
    "RTX 4090": ("RTX 4090", "PCIe"),
    "RTX A6000": ("RTX A6000", "PCIe"),
    "RTX 2080": ("RTX 2080", "PCIe"),
    "Titan RTX": ("Titan RTX", "PCIe"),
    "MI250X": ("MI250X", "OAM"),
    "MI300X": ("MI300X", "OAM"),
}
ALIASES = {
    "A100-40GB": "A100;A100-SXM4-40GB;A100-40",
    "A100-80GB": "A100-SXM4-80GB",
    "H100-80GB": "H100;H100-SXM;H100-SXM5",
    "H200-141GB": "H200",
    "H20-96GB": "H20",
    "V100-16GB": "V100;V100-16",
    "GH200-96GB": "GH-96;GH200",
    "RTX 3090": "RTX3090;3090;RTX-3090",
    "RTX 4090": "RTX4090;4090",
    "RTX A6000": "A6000",
    "RTX 2080": "RTX-2080;RTX2080",
    "Titan RTX": "Titan-RTX;TITAN RTX",
}
# price table gpu string -> canonical name
PRICE_NAMES = {
    "H100-80GB SXM": "H100-80GB",
    "H100-80GB PCIe": "H100-80GB-PCIe",
    "A100-80GB SXM": "A100-80GB",
    "A100-80GB PCIe": "A100-80GB-PCIe",
    "A100-40GB SXM": "A100-40GB",
    "V100-32GB SXM2": "V100-32GB",
    "V100-16GB SXM2": "V100-16GB",
    "V100-16GB": "V100-16GB",
    "L4": "L4",
    "L40S": "L40S",
    "T4": "T4",
    "A10": "A10",
    "RTX A6000": "RTX A6000",
    "RTX 3090": "RTX 3090",
    "RTX 4090": "RTX 4090",
    "H200": "H200-141GB",
    "H200-141GB": "H200-141GB",
    "GH200-96GB": "GH200-96GB",
}
PROVIDER_RANK = {"AWS": 0, "Lambda": 1, "RunPod": 2}
# PCIe x16 per-direction bandwidth by generation (PCI-SIG base specification figures)
PCIE_GBYTE_PER_S = {"Gen3": 15.75, "Gen4": 31.5, "Gen5": 63.0}
# Per-node network defaults, Gbit/s, with where they come from.
NETWORK = {
    "A100-40GB": (1600, "DGX A100: 8x 200 Gb/s HDR InfiniBand (gpu_specs.csv)"),
    "A100-80GB": (1600, "DGX A100: 8x 200 Gb/s HDR InfiniBand (gpu_specs.csv)"),
    "H100-80GB": (3200, "DGX H100: 8x 400 Gb/s CX-7 (gpu_specs.csv)"),
    "H200-141GB": (3200, "HGX H200: 8x 400 Gb/s (gpu_specs.csv)"),
    "V100-16GB": (10, "AWS p3.8xlarge 10 Gbps (gpu_specs.csv)"),
    "T4": (50, "AWS g4dn.12xlarge 50 Gbps (gpu_specs.csv)"),
    "GH200-96GB": (
        800,
        "Alps/Clariden GH200 node: 4 Slingshot-11 NICs x 200 Gbit/s, one per GPU "
        "(gpu_specs_extra.csv)",
    ),
}
# gpu_specs.csv notes say these run BF16 at the FP16 tensor rate ("BF16 same rate",
# "FP16/BF16 tensor"), though the bf16 column is blank.
BF16_AS_FP16 = {"RTX 3090", "RTX 4090"}
DEFAULT_NETWORK = (100, "assumed 100 Gbit/s Ethernet: no source; set network_bandwidth")


def _num(text: str) -> str:
    return text.strip() if text.strip() else ""


def _mid(text: str) -> str:
    text = text.strip()
    if not text:
        return ""
    parts = [float(p) for p in text.split("-")]
    return f"{sum(parts) / len(parts):.4f}"


HERE = Path(__file__).parent


def main(shared: Path, out: Path) -> None:
    specs = list(csv.DictReader((shared / "gpu_specs.csv").open()))
    specs += csv.DictReader((HERE / "gpu_specs_extra.csv").open())
    tf32 = {r["name"]: r for r in csv.DictReader((HERE / "gpu_tf32.csv").open())}
    missing = set(SPEC_ROWS) - set(tf32)
    if missing:
        raise SystemExit(f"gpu_tf32.csv has no row for {sorted(missing)}")
    prices = list(csv.DictReader((shared / "gpu_prices.csv").open()))
    best: dict[str, tuple[int, dict[str, str]]] = {}
    for row in prices:
        name = PRICE_NAMES.get(row["gpu"].strip())
        kind = row["price_type"]
        if name is None or "capacity" in kind or "historical" in kind:
            continue
        if not row["on_demand_usd_per_gpu_hr"].strip():
            continue
        rank = PROVIDER_RANK.get(row["provider"], 9)
        if name not in best or rank < best[name][0]:
            best[name] = (rank, row)
    fields = [
        "name", "aliases", "form_factor", "bf16_tflops", "fp16_tflops", "fp32_tflops",
        "tf32_tflops", "memory_gb", "hbm_gbyte_per_s", "intra_node_link", "intra_node_gbyte_per_s",
        "network_gbit_per_s", "network_source", "on_demand_usd_per_gpu_hour",
        "spot_usd_per_gpu_hour", "price_source", "verified", "source",
    ]
    with out.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for name, (gpu, ff) in SPEC_ROWS.items():
            row = next(r for r in specs if r["gpu"] == gpu and r["form_factor"].startswith(ff))
            link = row["intra_node_link"]
            if row["intra_node_bw_gbs"].strip() and not link.startswith("NVLink bridge"):
                # datasheet NVLink figures are bidirectional totals
                intra = float(row["intra_node_bw_gbs"]) / 2
            else:
                gen = row["pcie_gen"].split()[0] if row["pcie_gen"] else "Gen4"
                intra = PCIE_GBYTE_PER_S.get(gen, 31.5)
                link = f"PCIe {gen}"
            net, net_src = NETWORK.get(name, DEFAULT_NETWORK)
            price = best.get(name)
            writer.writerow({
                "name": name,
                "aliases": ALIASES.get(name, ""),
                "form_factor": row["form_factor"],
                "bf16_tflops": (
                    _num(row["dense_fp16_tensor_tflops"])
                    if name in BF16_AS_FP16
                    else _num(row["dense_bf16_tflops"])
                ),
                "fp16_tflops": _num(row["dense_fp16_tensor_tflops"]),
                "fp32_tflops": _num(row["fp32_tflops"]),
                "tf32_tflops": _num(tf32[name]["tf32_tflops"]),
                "memory_gb": row["memory_gb"],
                "hbm_gbyte_per_s": row["hbm_bw_gbs"],
                "intra_node_link": link,
                "intra_node_gbyte_per_s": f"{intra:g}",
                "network_gbit_per_s": net,
                "network_source": net_src,
                "on_demand_usd_per_gpu_hour": price[1]["on_demand_usd_per_gpu_hr"] if price else "",
                "spot_usd_per_gpu_hour": _mid(price[1]["spot_usd_per_gpu_hr"]) if price else "",
                "price_source": (
                    f"{price[1]['provider']} {price[1]['instance']} "
                    f"({price[1]['date_or_snapshot']}): {price[1]['source']}"
                ) if price else "no price in shared/data/gpu_prices.csv",
                "verified": row["verified"],
                "source": f"{row['source']}; TF32: {tf32[name]['source']}",
            })


if __name__ == "__main__":
    shared_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/data")
    main(shared_dir, Path("src/hetplan/data/gpu_catalog.csv"))
