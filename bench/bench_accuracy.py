"""Accuracy of the cost model on published runs, leave-one-out: each row is predicted by
parameters fitted without it. Prints one table per file and a summary.

    .venv/bin/python bench/bench_accuracy.py            # report only
    .venv/bin/python bench/bench_accuracy.py --write    # also refresh data/calibration.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from hetplan.cost.calibrate import calibrate_runs, load_runs, shipped_files

TARGETS = {
    "megatron_homogeneous.csv": "MAE <= 10%, every row within 20%",
    "amp_t4_homogeneous.csv": "MAE <= 15%, Spearman >= 0.9 (AMP itself: 48% MAE, 0.93)",
}


def _row_table(name: str, rows: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{name} (leave-one-out)")
    for col in ("run", "metric", "knobs", "predicted", "measured", "error %", "fits"):
        table.add_column(col, justify="left" if col in ("run", "metric", "knobs") else "right")
    for r in rows:
        knobs = f"mb={r['micro_batch']} v={r['virtual_stages']} rc={r['recompute']}"
        if r["searched"]:
            knobs += " (searched)"
        err = "OOM (measured)" if r["error_pct"] is None else f"{r['error_pct']:+.1f}"
        table.add_row(
            r["label"],
            r["metric"],
            knobs,
            f"{r['predicted']:.3f}",
            "-" if r["measured"] is None else f"{r['measured']:.3f}",
            err,
            "yes" if r["fits"] else "no",
        )
    return table


def main() -> None:
    """Fits on every shipped row, reports the leave-one-out error per file."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="write data/calibration.json")
    args = parser.parse_args()
    console = Console()
    start = time.perf_counter()
    runs = [run for path in shipped_files() for run in load_runs(path)]
    params, report = calibrate_runs(runs)
    for name, rep in report.items():
        console.print(_row_table(name, rep["rows"]))
    summary = Table(title="Summary (leave-one-out)")
    for col in ("file", "n", "MAE %", "max %", "Spearman", "OOM rows flagged", "target"):
        summary.add_column(col)
    for name, rep in report.items():
        oom = f"{rep['oom_rows_flagged']}/{rep['oom_rows']}"
        if rep["measured_rows_flagged"]:
            oom += f" (+{rep['measured_rows_flagged']} measured rows wrongly flagged)"
        summary.add_row(
            name,
            str(rep["n"]),
            f"{rep['mae_pct']:.1f}",
            f"{rep['max_pct']:.1f}",
            f"{rep['spearman']:.3f}",
            oom,
            TARGETS.get(name, ""),
        )
    console.print(summary)
    console.print(
        "Megatron rows leave micro-batch and virtual stages unspecified: hetplan's own "
        "homogeneous search chooses them, restricted to the row's TP/PP/DP "
        "(marked 'searched'). 2021 rows compare hardware TFLOP/s (full recomputation); "
        "Megatron-Core rows compare model TFLOP/s."
    )
    for gpu, eff in params.gpus.items():
        console.print(f"fitted {gpu}: {eff}")
    if args.write:
        out = Path(__file__).resolve().parents[1] / "src/hetplan/data/calibration.json"
        params.save(out)
        console.print(f"wrote {out}")
    console.print(f"took {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
