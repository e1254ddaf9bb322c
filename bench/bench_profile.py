"""Profile database speed: loading a 10k-row database and lookups per second (target: load
< 0.5 s; lookups are dictionary hits, not SQL queries).

Run: .venv/bin/python bench/bench_profile.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hetplan.cost.compute import LayerTimes
from hetplan.hardware import catalog_gpus
from hetplan.measured.network import SailorFit
from hetplan.measured.profile_db import LayerRecord, ProfileDB, shape_key
from hetplan.model import load_model

ROWS = 10_000
MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
TPS = (1, 2, 4, 8)
PRECISIONS = ("bf16", "fp16", "tf32")


def generate(path: Path, rows: int = ROWS) -> ProfileDB:
    """Writes ``rows`` layer rows (every GPU type of the catalog, shapes varied by sequence
    length) plus their embedding and head parts for the first shape; returns the database."""
    base = load_model("gpt3-1.3b")
    gpus = [g.name for g in catalog_gpus()]
    db = ProfileDB(path)
    n = 0
    with db.transaction():
        seq = 256
        while n < rows:
            model = replace(base, seq=seq)
            for gpu in gpus:
                for prec in PRECISIONS:
                    for tp in TPS:
                        for mb in MICRO_BATCHES:
                            if n == rows:
                                break
                            t = LayerTimes(1e-3 * mb / tp, 2e-3 * mb / tp, 3e-4 * mb / tp)
                            key = shape_key(model)
                            db.put(LayerRecord(gpu, key, tp, mb, prec, t, 1e6 * mb, 0))
                            n += 1
            seq += 256
        for gpu in gpus:
            for mb in MICRO_BATCHES:
                t = LayerTimes(1e-4 * mb, 2e-4 * mb, 0.0)
                db.put_part(gpu, replace(base, seq=256), "head", 1, mb, "bf16", t)
            db.put_network_fit(gpu, "intra", 4, SailorFit(-0.75, 26.5, 82.1, 2.5e11))
    return db


def rate(fn: Callable[[], object], calls: int) -> float:
    """Returns calls per second of ``fn`` (best of three rounds)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
    return calls / best


def main() -> None:
    """Prints load time and lookup rates of a generated 10k-row database."""
    with tempfile.TemporaryDirectory(prefix="hetplan-bench-") as tmp:
        path = Path(tmp) / "profile.sqlite"
        t0 = time.perf_counter()
        generate(path)
        write_s = time.perf_counter() - t0
        loads = []
        for _ in range(5):
            t0 = time.perf_counter()
            db = ProfileDB(path)
            loads.append(time.perf_counter() - t0)
        rows = db.counts()["layer_times"]
        model = replace(load_model("gpt3-1.3b"), seq=256)
        gpu = catalog_gpus()[0]
        cases = [
            ("layer_times, exact row", lambda: db.layer_times(gpu, model, 2, 8, "bf16")),
            ("layer_times, interpolated", lambda: db.layer_times(gpu, model, 2, 12, "bf16")),
            ("layer_times, not profiled", lambda: db.layer_times(gpu, model, 3, 8, "bf16")),
            ("part_times, head", lambda: db.part_times(gpu, model, "head", 1, 8, "bf16")),
            ("network_bandwidth, fit", lambda: db.network_bandwidth(gpu.name, "intra", 4, 1e8)),
        ]
        table = Table(
            title=f"Profile database: {rows} layer rows ({path.stat().st_size >> 10} KiB)"
        )
        for col in ("measure", "value", "target"):
            table.add_column(col, justify="right" if col != "measure" else "left")
        table.add_row("write (one transaction)", f"{write_s:.3f} s", "")
        table.add_row("load (median of 5)", f"{statistics.median(loads):.3f} s", "< 0.5 s")
        t0 = time.perf_counter()
        points = db.layer_points()
        table.add_row(f"layer_points ({len(points)} rows)", f"{time.perf_counter() - t0:.3f} s", "")
        for name, fn in cases:
            table.add_row(name, f"{rate(fn, 50_000):,.0f} /s", "")
        for label, with_s, without_s in planning_times(Path(tmp)):
            table.add_row(f"plan {label}: with / without profile",
                          f"{with_s:.2f} / {without_s:.2f} s", "with <= without")  # fmt: skip
    Console(width=200).print(table)


def planning_times(folder: Path) -> list[tuple[str, float, float]]:
    """Returns (case, seconds with the Sailor GH200 profile, seconds without) of the
    homogeneous search: opt-350m on 16 and 64 GH200 nodes (best of 3 each)."""
    from hetplan.cluster import parse_inline_cluster
    from hetplan.cost.params import default_params
    from hetplan.measured.importers import parse_bindings, write_db
    from hetplan.measured.sailor import read_sailor_network, read_sailor_profile
    from hetplan.search.homogeneous import search_homogeneous

    sailor = Path(__file__).resolve().parents[1] / "src/hetplan/data/calibration"
    sailor = sailor / "sailor_clariden_opt350"
    batch = read_sailor_profile(sailor / "profile_opt350_gh96.json",
                                parse_bindings(["OPT-350=opt-350m"]))  # fmt: skip
    batch.extend(read_sailor_network(sailor / "network_gh96.json"))
    db = write_db(folder / "gh200.sqlite", batch)
    model = load_model("opt-350m")
    out = []
    for nodes in (16, 64):
        cluster = parse_inline_cluster(f"GH200-96GB:{nodes}x4")
        times, evaluated = [], []
        for params in (default_params().with_profile(db), default_params()):
            best = float("inf")
            for _ in range(3):
                # a fresh compute source each round: no memo carried over between rounds
                fresh = params.with_profile(params.profile)
                t0 = time.perf_counter()
                found = search_homogeneous(model, cluster, 1024, "tf32", 5, fresh)
                best = min(best, time.perf_counter() - t0)
            times.append(best)
            evaluated.append(found.evaluated)
        out.append((f"opt-350m on {nodes * 4} GH200 (estimated exactly: {evaluated[0]} with "
                    f"profile, {evaluated[1]} without)", times[0], times[1]))  # fmt: skip
    return out


if __name__ == "__main__":
    main()
