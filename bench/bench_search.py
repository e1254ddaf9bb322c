"""Whole `hetplan plan` commands, timed from process start to exit (issue 14's targets).

Each command runs as a subprocess (the installed console script's module, ``python -m
hetplan``) with ``--json --out <plan file>``; the table shows the best wall time of
``--runs`` runs against the target, the CPU time (user + sys) of that run, the plan file's
and the JSON's sizes, the child's peak RSS (``os.wait4``'s rusage), and the first plan.

Run: .venv/bin/python bench/bench_search.py [--runs 3] [--skip-large] [--case 6.7B]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent

CASES = [
    # (label, plan arguments, wall target s, plan-file target kB, RSS target MB)
    ("GPT-3 175B, 1,024 A100", ["--model", "gpt3-175b", "--cluster", "A100-80GB:128x8"],
     1.0, None, None),
    ("Llama 3 405B, 16,384 H100", ["--model", "llama3-405b", "--cluster", "H100-80GB:2048x8"],
     2.5, 100, 500),
    ("GPT-3 6.7B, 16 A100 + 16 V100 + 32 T4",
     ["--model", "gpt3-6.7b", "--cluster", "examples/clusters/mixed64.yaml",
      "--global-batch-size", "1024", "--precision", "fp16"], 3.0, None, None),
    # single-GPU nodes of a small model: the enumeration's selections multiply (200 s before
    # its budget charged each step)
    ("GPT-2, 12 RTX 3090 + 4 L4, single-GPU nodes",
     ["--model", "gpt2", "--cluster", "RTX 3090:12x1,L4:4x1", "--global-batch-size", "16",
      "--precision", "fp16"], 5.0, None, None),
    # small nodes of two types: every placement of a selection's stages on the nodes (30 s
    # before placements of copies were listed once and bounded by their own reductions)
    ("GPT-2, 3 A100 nodes of 4 + 1 T4 node of 2",
     ["--model", "gpt2", "--cluster", "A100-80GB:3x4,T4:1x2", "--global-batch-size", "16",
      "--precision", "fp16"], 5.0, None, None),
    ("GPT-3 6.7B, 512 GPUs of three types",
     ["--model", "gpt3-6.7b", "--cluster", "A100-80GB:16x8,V100-32GB:16x8,T4:32x8",
      "--global-batch-size", "2048", "--precision", "fp16"], 20.0, None, None),
]  # fmt: skip


def run_once(args: list[str], plan_file: Path) -> dict[str, float | str]:
    """Runs one command; returns its wall and CPU seconds, peak RSS, output sizes, plan."""
    cmd = [sys.executable, "-m", "hetplan", "plan", *args, "--json", "--out", str(plan_file)]
    start = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read()
        err.seek(0)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {err.read().decode()[-500:]}")
    best = json.loads(stdout)["plans"][0]
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "rss_mb": usage.ru_maxrss / 1024,
        "json_kb": len(stdout) / 1e3,
        "plan_kb": plan_file.stat().st_size / 1e3,
        "iter_s": best["iteration_time_s"],
        "plan": _describe(best["plan"]),
    }


def _describe(plan: dict) -> str:
    """Returns a short label of a plan file mapping: its entries and knobs."""
    parts = []
    for entry in plan["pipelines"][:3]:
        stages = entry["stages"]
        tps = "/".join(str(s.get("tp", len(s.get("devices", [])))) for s in stages)
        parts.append(f"{entry.get('count', 1)}x(pp{len(stages)} tp{tps})")
    more = len(plan["pipelines"]) - 3
    knobs = f"mb{plan['micro_batch_size']} {plan['recompute']} z{plan['zero_stage']}"
    return " ".join(parts) + (f" +{more} entries" if more > 0 else "") + " " + knobs


def main() -> None:
    """Prints one table: every case's best wall time against its target."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3, help="runs per case (the best is shown)")
    ap.add_argument("--skip-large", action="store_true", help="leave out the 512-GPU case")
    ap.add_argument(
        "--case",
        action="append",
        default=[],
        help="run only the cases whose label contains this text (repeatable), e.g. '16 A100'",
    )
    args = ap.parse_args()
    table = Table(title=f"hetplan plan, whole command (best of {args.runs} runs)")
    for col in ("case", "wall s", "target s", "CPU s", "plan kB", "JSON kB", "RSS MB",
                "verdict", "iter s", "first plan"):  # fmt: skip
        table.add_column(col, justify="left" if col in ("case", "first plan") else "right")
    cases = CASES[:-1] if args.skip_large else CASES
    if args.case:
        cases = [c for c in cases if any(text in c[0] for text in args.case)]
        if not cases:
            raise SystemExit(f"--case: no case label contains {' or '.join(args.case)}")
    with tempfile.TemporaryDirectory() as tmp:
        for label, cmd, target, plan_kb, rss_mb in cases:
            runs = [run_once(cmd, Path(tmp) / "plan.json") for _ in range(args.runs)]
            best = min(runs, key=lambda r: float(r["wall"]))
            peak_rss = max(float(r["rss_mb"]) for r in runs)
            sizes_ok = plan_kb is None or float(best["plan_kb"]) < plan_kb
            sizes_ok = sizes_ok and (rss_mb is None or peak_rss < rss_mb)
            if not sizes_ok:
                verdict = "MISSED"
            elif float(best["wall"]) < target:
                verdict = "ok"
            elif float(best["cpu"]) < target:  # other processes held the cores
                verdict = "CPU ok, wall over"
            else:
                verdict = "MISSED"
            table.add_row(
                label,
                f"{best['wall']:.2f}",
                f"<{target:g}",
                f"{best['cpu']:.2f}",
                f"{best['plan_kb']:.1f}" + (f" (<{plan_kb})" if plan_kb else ""),
                f"{best['json_kb']:.0f}",
                f"{peak_rss:.0f}" + (f" (<{rss_mb})" if rss_mb else ""),
                verdict,
                f"{best['iter_s']:.3f}",
                str(best["plan"]),
            )
    Console(width=200).print(table)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{os.cpu_count()} CPUs, load average {load}: on a shared machine wall times vary; "
        "CPU s (user + sys of the command) is the steadier"
    )


if __name__ == "__main__":
    main()
