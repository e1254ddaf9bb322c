"""Elastic recovery: replan time and recovery plans on a 64-GPU, 3-type cluster losing 1, 2
and 4 nodes; then a real recovery on CPU processes, measured against its prediction.

Part 1 plans gpt2-xl on examples/clusters/mixed64.yaml with the heterogeneous search, then
for each loss replans (warm start) and optimises the recovery: bytes from each source and
the predicted time against every node downloading all it needs from storage.
Part 2 trains a small GPT on 4 one-CPU nodes with node-local checkpoints and uploads,
drops node n3 (its disk too), replans, and executes the recovery with copies throttled to
the cluster file's bandwidths, then the download-everything baseline on a fresh copy.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from hetplan.cluster import Cluster, load_cluster
from hetplan.elastic.placement import node_shards, shard_bytes
from hetplan.elastic.recovery import (
    STORAGE,
    RecoveryPlan,
    RecoveryProblem,
    Transfer,
    plan_recovery,
    problem_from_plans,
)
from hetplan.elastic.replan import replan, split_layers
from hetplan.elastic.storage import ShardStore
from hetplan.elastic.transfer import (
    Throttle,
    execute,
    measured_file_latency_s,
    measured_hash_bytes_per_s,
    survey,
)
from hetplan.model import ModelSpec, load_model
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.search.heterogeneous import search_heterogeneous

ROOT = Path(__file__).resolve().parents[1]
STORAGE_BYTES_PER_S = 10e9 / 8  # 10 Gbit/s: an assumption for one job's object-store reads
LOSSES = [["t4-3"], ["t4-3", "v100-32gb-1"], ["t4-2", "t4-3", "v100-32gb-1", "a100-80gb-1"]]


def part_64_gpus() -> None:
    """Prints replan and recovery figures for 1, 2 and 4 lost nodes."""
    cluster = load_cluster(str(ROOT / "examples/clusters/mixed64.yaml"))
    model = load_model("gpt2-xl")
    res = search_heterogeneous(model, cluster, 512, "fp16", top_k=1)
    print(f"gpt2-xl on mixed64 (initial search {res.search_time_s:.1f} s; storage 10 Gbit/s)")
    nodes = [n.name for n in cluster.nodes]
    per = [3.0 if "t4" in n else 1.5 if "v100" in n else 1.0 for n in nodes]
    layers = split_layers(model.layers, per)
    across = Plan(
        512,
        2,
        tuple(
            Pipeline(64, tuple(Stage(n, (f"{m}:{i}",)) for n, m in zip(layers, nodes, strict=True)))
            for i in range(8)
        ),
        precision="fp16",
    )
    for label, old in (
        ("searched plan", res.ranked[0][0]),
        ("8 pipelines across all nodes", across),
    ):
        _table(label, old, model, cluster)


def part_1024_gpus() -> None:
    """Prints replan and recovery figures of GPT-3 175B's best plan on 1,024 A100 (128 nodes)
    losing 1, 2 and 4 nodes, and of Llama 3 405B's on 16,384 H100 losing 1 and 2: recovery
    problems of over a thousand missing shards, each with dozens to hundreds of surviving
    holders (solve s: the balanced choice, or the LP and MILP where it misses its bound)."""
    from hetplan.cluster import parse_inline_cluster
    from hetplan.search.homogeneous import search_homogeneous

    cluster = parse_inline_cluster("A100-80GB:128x8")
    model = load_model("gpt3-175b")
    old = search_homogeneous(model, cluster, 1536, "bf16", 1).ranked[0][0]
    losses = [["a100-80gb-5"], ["a100-80gb-5", "a100-80gb-77"],
              ["a100-80gb-5", "a100-80gb-77", "a100-80gb-100", "a100-80gb-127"]]  # fmt: skip
    _table("\ngpt3-175b on 1,024 A100-80GB, best plan", old, model, cluster, losses)
    cluster = parse_inline_cluster("H100-80GB:2048x8")
    model = load_model("llama3-405b")
    old = search_homogeneous(model, cluster, model.default_global_batch, "bf16", 1).ranked[0][0]
    losses = [["h100-80gb-7"], ["h100-80gb-7", "h100-80gb-1000"]]
    _table("\nllama3-405b on 16,384 H100-80GB, best plan", old, model, cluster, losses)


def _table(
    label: str, old: Plan, model: ModelSpec, cluster: Cluster, losses: list[list[str]] = LOSSES
) -> None:
    print(f"\n{label}: {old.dp} pipelines")
    print(
        f"{'lost':>5} {'replan s':>9} {'iter s':>7} {'local GB':>9} {'peers GB':>9} "
        f"{'storage GB':>10} {'pred s':>7} {'base s':>7} {'ratio':>6} {'solve s':>7}"
    )
    for lost in losses:
        r = replan(old, model, cluster, lost)
        prob = problem_from_plans(old, r.plan, model, cluster, r.cluster, STORAGE_BYTES_PER_S)
        rec = plan_recovery(prob)
        print(
            f"{len(lost):>5} {r.replan_time_s:>9.3f} {r.estimate.iteration_time_s:>7.3f} "
            f"{rec.bytes_local / 1e9:>9.2f} {rec.bytes_from_peers / 1e9:>9.2f} "
            f"{rec.bytes_from_storage / 1e9:>10.2f} {rec.predicted_recovery_s:>7.2f} "
            f"{rec.baseline_recovery_s:>7.2f} {rec.speedup:>5.2f}x {rec.solve_time_s:>7.3f}"
        )


CPU_CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
storage_bandwidth: 100 MB/s
nodes:
""" + "".join(
    f"  - {{name: n{i}, gpu: cpu, gpus: 1, network_bandwidth: 200 MB/s}}\n" for i in range(4)
)
GPT = {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 256, "n_positions": 32}
PLAN = {
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "precision": "fp32",
    "pipelines": [
        {"batch_size": 4, "stages": [{"layers": 2, "devices": [f"n{x}:0"]} for x in pair]}
        for pair in ((0, 1), (2, 3))
    ],
}  # fmt: skip


def part_cpu(tmp: Path) -> None:
    """Trains on 4 CPU processes, loses n3, and measures the recovery against its prediction."""
    (tmp / "gpt").mkdir()
    (tmp / "gpt" / "config.json").write_text(json.dumps(GPT))
    (tmp / "cluster.yaml").write_text(CPU_CLUSTER)
    (tmp / "plan.json").write_text(json.dumps(PLAN))
    cfg = RunConfig(
        plan=str(tmp / "plan.json"),
        model=str(tmp / "gpt" / "config.json"),
        cluster=str(tmp / "cluster.yaml"),
        steps=4,
        checkpoint_every=2,
        threads=1,
        local_dir=str(tmp / "local"),
        storage=str(tmp / "store"),
    )
    run_local(cfg, timeout_s=300)
    model, cluster = load_model(cfg.model), load_cluster(cfg.cluster)
    from hetplan.plan import load_plan

    old = load_plan(tmp / "plan.json")
    storage_bw = 100e6
    shutil.copytree(tmp / "local", tmp / "local_copy")
    r = replan(old, model, cluster, ["n3"])
    shutil.rmtree(tmp / "local" / "n3")
    store = ShardStore(str(tmp / "store"))
    alive = [n.name for n in r.cluster.nodes]
    found = survey(tmp / "local", alive, store, list(shard_bytes(model)))
    nic = {n.name: n.network_bytes_per_s for n in cluster.nodes}
    prob = RecoveryProblem(
        {k.removesuffix(".pt"): v for k, v in found.sizes_bytes.items()},
        node_shards(r.plan, model),
        found.held,
        nic,
        storage_bw,
        found.in_storage,
        hash_bytes_per_s=measured_hash_bytes_per_s(),
        file_latency_s=measured_file_latency_s(str(tmp)),
    )
    rec = plan_recovery(prob)
    measured, _ = execute(rec, found, tmp / "local", store, model, 0, Throttle(nic, storage_bw))
    base = RecoveryPlan(
        [Transfer(t.node, t.shard, STORAGE, t.bytes) for t in rec.transfers],
        0,
        0,
        sum(t.bytes for t in rec.transfers),
        rec.baseline_recovery_s,
        rec.baseline_recovery_s,
        0.0,
        True,
        0.0,
    )
    shutil.rmtree(tmp / "local_copy" / "n3")
    base_s, _ = execute(base, found, tmp / "local_copy", store, model, 0, Throttle(nic, storage_bw))
    print(
        f"\nCPU run: 4 nodes, lose n3 at step {found.step}; "
        f"{found.sizes_bytes['layer_0000.pt'] / 1e6:.1f} MB per layer shard"
    )
    print("links 200 MB/s per node, storage 100 MB/s (emulated by throttled copies)")
    print(f"{'':>10} {'predicted s':>12} {'measured s':>11}")
    print(f"{'recovery':>10} {rec.predicted_recovery_s:>12.3f} {measured:>11.3f}")
    print(f"{'baseline':>10} {rec.baseline_recovery_s:>12.3f} {base_s:>11.3f}")
    print(
        f"bytes: local {rec.bytes_local / 1e6:.1f} MB, peers {rec.bytes_from_peers / 1e6:.1f} MB,"
        f" storage {rec.bytes_from_storage / 1e6:.1f} MB; measured ratio {base_s / measured:.2f}x"
        f" (predicted {rec.speedup:.2f}x)"
    )


def main() -> None:
    """Runs both parts."""
    part_64_gpus()
    part_1024_gpus()
    if "--no-cpu" not in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            part_cpu(Path(tmp))


if __name__ == "__main__":
    main()
