"""A day on the spot market: four policies replayed on availability traces, one table.

Rows: (1) Sailor's A100 trace (``sailor_a100_16.json``, 3.6 h, 7-14 GPUs) with GPT-3 1.3B on
an A100-80GB:2x8 pool, replanning by repair (as ``launch --elastic``) and by repair + search;
(2) a seeded synthetic 24-hour two-type trace (A100-80GB:4x8 + V100-32GB:4x8, Poisson
preemptions 0.6 per node-hour, 15-minute mean outages, about 200 changes), whose replay is
timed (wall and CPU); (3) with ``--cpu``, one change replayed on four one-CPU nodes against
what ``launch --elastic`` measures on a real CPU run of the same plan (a worker of the last
node killed): replan and recovery times.

Columns: hetplan's tokens per dollar and time to the token target over each other policy's
(> 1: hetplan better; "never" where the other policy does not reach the target in the trace).
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.spot.planner import Planner
from hetplan.spot.pool import pool_from_cluster
from hetplan.spot.report import ratios
from hetplan.spot.simulate import Result, Settings, simulate
from hetplan.spot.traces import PoolType, Trace, load_trace, synthesize

STORAGE = 10e9 / 8


def _replay(
    trace: Trace, cluster: str, precision: str, search: bool, target: float
) -> tuple[Result, float, float]:
    pool = pool_from_cluster(parse_inline_cluster(cluster))
    model = load_model("gpt3-1.3b")
    wall, cpu = time.perf_counter(), time.process_time()
    planner = Planner(model, pool, precision, 512, default_params(), STORAGE, replan_search=search)
    result = simulate(trace, planner, Settings(target_tokens=target))
    return result, time.perf_counter() - wall, time.process_time() - cpu


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return "never" if math.isinf(x) else f"{x:.2f}x"


def _row(label: str, result: Result, wall: float, cpu: float) -> None:
    r = ratios(result)
    by = {p["name"]: p for p in result.policies}
    cells = [_ratio(r[k]["tokens_per_dollar"]) for k in r]
    times = [_ratio(r[k]["time_to_target"]) for k in r]
    het = by["hetplan"]
    to_target = "-" if het["time_to_target_s"] is None else f"{het['time_to_target_s'] / 3600:.2f}"
    print(
        f"{label:<34} {result.changes:>4} {het['tokens'] / 1e9:>8.2f} "
        f"{het['usd_per_million_tokens']:>8.4f} {to_target:>7} "
        + " ".join(f"{c:>9}" for c in cells)
        + " "
        + " ".join(f"{t:>9}" for t in times)
        + f" {wall:>7.1f} {cpu:>6.1f}"
    )


def part_traces() -> None:
    """Prints one row per trace and replanning mode."""
    print(
        f"{'trace (GPT-3 1.3B)':<34} {'chg':>4} {'het Gtok':>8} {'$/Mtok':>8} {'het h':>7} "
        f"{'tpd/rst':>9} {'tpd/wait':>9} {'tpd/od':>9} {'time/rst':>9} {'time/wait':>9} "
        f"{'time/od':>9} {'wall s':>7} {'cpu s':>6}"
    )
    sailor = load_trace("sailor_a100_16.json").bind("A100-80GB")
    for search in (False, True):
        res, wall, cpu = _replay(sailor, "A100-80GB:2x8", "bf16", search, 1.5e9)
        _row(f"sailor_a100_16, {'search' if search else 'repair'}", res, wall, cpu)
    cluster = "A100-80GB:4x8,V100-32GB:4x8"
    pool = pool_from_cluster(parse_inline_cluster(cluster))
    synth = synthesize(
        [PoolType(g, t.template.gpus, t.max_gpus // t.template.gpus, 0.6, 900.0)
         for g, t in pool.types.items()],
        86400.0,
        seed=1,
    )  # fmt: skip
    res, wall, cpu = _replay(synth, cluster, "fp16", False, 2.0e10)
    _row("synthetic 24 h A100+V100, repair", res, wall, cpu)
    rt = res.replan_times_s
    print(
        f"\nsynthetic 24 h: {res.changes} changes replayed in {wall:.1f} s wall, {cpu:.1f} s CPU; "
        f"{len(rt)} distinct replans, {1e3 * sum(rt) / max(len(rt), 1):.0f} ms mean, "
        f"{1e3 * max(rt, default=0):.0f} ms max; checkpoint every {res.interval_s:.0f} s "
        f"(C {res.checkpoint_s:.1f} s, M {res.mtbf_s:.0f} s)"
    )


CPU_CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10,
        price_per_gpu_hour: 1.0}
storage_bandwidth: 100 MB/s
nodes:
""" + "".join(
    f"  - {{name: cpu-{i}, gpu: cpu, gpus: 1, network_bandwidth: 200 MB/s}}\n" for i in range(4)
)
GPT = {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 32}
PLAN = {
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "precision": "fp32",
    "pipelines": [
        {"batch_size": 4, "stages": [{"layers": 2, "devices": [f"cpu-{x}:0"]} for x in pair]}
        for pair in ((0, 1), (2, 3))
    ],
}  # fmt: skip
SUPERVISOR = """
import json, sys
from hetplan.runtime.config import RunConfig
from hetplan.elastic.elastic_run import run_elastic
cfg = RunConfig(**json.loads(sys.argv[1]))
rec = run_elastic(cfg, 100e6)
open(sys.argv[2], "w").write(json.dumps(rec))
"""


def part_cpu(tmp: Path) -> None:
    """Replays a 4 -> 3 node change and measures the same change under launch --elastic."""
    from hetplan.cluster import load_cluster
    from hetplan.elastic.transfer import measured_file_latency_s, measured_hash_bytes_per_s
    from hetplan.plan import load_plan
    from hetplan.runtime.config import RunConfig
    from hetplan.runtime.launch import _env
    from hetplan.spot.pool import key_of, layout
    from hetplan.spot.traces import parse_trace

    (tmp / "gpt").mkdir()
    (tmp / "gpt" / "config.json").write_text(json.dumps(GPT))
    (tmp / "cluster.yaml").write_text(CPU_CLUSTER)
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    local, store = tmp / "local", tmp / "store"
    cfg = RunConfig(
        plan=str(tmp / "plan.json"), model=str(tmp / "gpt" / "config.json"),
        cluster=str(tmp / "cluster.yaml"), steps=40, checkpoint_every=2, threads=1,
        local_dir=str(local), storage=str(store),
    )  # fmt: skip
    out = tmp / "record.json"
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, json.dumps(cfg.__dict__), str(out)],
        env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (local / "cpu-3" / "latest").exists() or not glob.glob(
        str(local / "cpu-3" / "worker-*.pid")
    ):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the CPU run ended before a checkpoint")
        time.sleep(0.01)
    time.sleep(0.5)
    pid = int(Path(glob.glob(str(local / "cpu-3" / "worker-*.pid"))[0]).read_text())
    os.kill(pid, signal.SIGKILL)
    text, _ = proc.communicate(timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(text.decode()[-2000:])
    (measured,) = json.loads(out.read_text())["recoveries"]

    cluster = load_cluster(str(tmp / "cluster.yaml"))
    pool = pool_from_cluster(cluster)
    model = load_model(str(tmp / "gpt" / "config.json"))
    planner = Planner(
        model, pool, "fp32", 8, default_params(), 100e6,
        hash_bytes_per_s=measured_hash_bytes_per_s(),
        file_latency_s=measured_file_latency_s(str(tmp)),
    )  # fmt: skip
    nodes = layout(pool, {"cpu": 4})
    planner.given(load_plan(tmp / "plan.json"), nodes)
    trace = parse_trace("time_s,gpu_type,count\n0,cpu,4\n600,cpu,3\n1200,cpu,3\n", "cpu.csv",
                        dict(cluster.gpu_types))  # fmt: skip
    simulate(trace, planner, Settings(restart_s=0.0, interval_s=60.0, checkpoint_s=0.0))
    new = planner.plans[key_of(layout(pool, {"cpu": 3}))]
    assert new is not None
    rec = planner.recovery(
        planner.plans[key_of(nodes)], new, frozenset({"cpu-0", "cpu-1", "cpu-2"})
    )
    print("\none change on 4 one-CPU nodes (lose cpu-3): replay against launch --elastic")
    print(f"{'':>10} {'replay s':>9} {'run s':>9} {'ratio':>6}")
    for label, ours, theirs in (
        ("replan CPU", new.replan_time_s, measured["replan_cpu_s"]),
        ("recovery", rec.predicted_recovery_s, measured["measured_recovery_s"]),
    ):
        print(f"{label:>10} {ours:>9.4f} {theirs:>9.4f} {ours / theirs:>6.2f}")
    print(
        f"(the run's replan wall {measured['replan_time_s']:.4f} s; "
        f"the run predicted {measured['predicted_recovery_s']:.4f} s; peers "
        f"{measured['bytes_from_peers'] / 1e6:.1f} MB, storage "
        f"{measured['bytes_from_storage'] / 1e6:.1f} MB; replay peers "
        f"{rec.bytes_from_peers / 1e6:.1f} MB, storage {rec.bytes_from_storage / 1e6:.1f} MB)"
    )


def main() -> None:
    """Runs the trace rows, and the CPU comparison with ``--cpu`` (only it: ``--cpu-only``)."""
    if "--cpu-only" not in sys.argv:
        part_traces()
    if "--cpu" in sys.argv or "--cpu-only" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            part_cpu(Path(tmp))


if __name__ == "__main__":
    main()
