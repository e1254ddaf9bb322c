"""``explain`` lists identical pipelines once with their count; ``expand`` lists them all."""

from __future__ import annotations

import json
import subprocess
import sys

from hetplan.cluster import parse_inline_cluster
from hetplan.model import ModelSpec, load_model
from hetplan.report.explain import explain, explain_table
from hetplan.search.layout import uniform_plan

TINY = ModelSpec("tiny", "gpt", 8, 512, 8, 8, 2048, 8192, 512)


def _plan():
    # 2 nodes of 8: tp 2, pp 2, dp 4 -> 4 identical pipelines of 2 stages (16 GPUs)
    cluster = parse_inline_cluster("A100-80GB:2x8")
    return cluster, uniform_plan(cluster, TINY.layers, 2, 2, 4, 1, 16)


def test_identical_pipelines_are_listed_once_with_their_count():
    cluster, plan = _plan()
    ex = explain(plan, TINY, cluster)
    assert ex["pipelines"] == 4
    assert [(s["stage"], s["count"], s["layers"]) for s in ex["stages"]] == [(0, 4, 4), (1, 4, 4)]
    assert [(r["count"], r["batch_size"]) for r in ex["replicas"]] == [(4, 4)]
    # every layer of every replica is accounted for once: 8 layers x 4 replicas
    assert sum(s["layers"] * s["count"] for s in ex["stages"]) == 32
    assert sum(r["batch_size"] * r["count"] for r in ex["replicas"]) == 16
    assert len(explain_table(ex)) == 3


def test_expand_lists_every_stage_with_the_same_figures():
    cluster, plan = _plan()
    short = explain(plan, TINY, cluster)
    full = explain(plan, TINY, cluster, expand=True)
    assert len(full["stages"]) == 8 and len(full["replicas"]) == 4
    assert all(s["count"] == 1 for s in full["stages"])
    assert {tuple(s["devices"]) for s in full["stages"]} == {
        tuple(st.devices) for pipe in plan.pipelines for st in pipe.stages
    }
    assert full["iteration_time_s"] == short["iteration_time_s"]
    assert full["bottleneck"] == short["bottleneck"]


def test_explain_command_is_compact_unless_expanded(tmp_path):
    cluster = parse_inline_cluster("A100-80GB:2x8")
    plan = uniform_plan(cluster, load_model("gpt3-350m").layers, 2, 2, 4, 1, 16)
    path = tmp_path / "plan.json"
    plan.save(path)
    base = [sys.executable, "-m", "hetplan", "explain", str(path), "--model", "gpt3-350m"]
    base += ["--cluster", "A100-80GB:2x8", "--json"]
    short = json.loads(subprocess.run(base, capture_output=True, text=True, check=True).stdout)
    full = json.loads(
        subprocess.run([*base, "--expand"], capture_output=True, text=True, check=True).stdout
    )
    assert len(short["stages"]) < len(full["stages"])
    assert sum(s["count"] for s in short["stages"]) == len(full["stages"])


def test_provisioning_json_writes_repeated_pipelines_once():
    from hetplan.plan import plan_from_dict
    from hetplan.report.pareto import point_json
    from hetplan.search.provision_points import Point

    cluster = parse_inline_cluster("A100-80GB:16x8")
    plan = uniform_plan(cluster, 8, 2, 2, 32, 1, 64)  # 32 identical pipelines
    point = Point({"A100-80GB": 128}, False, 1.0, 1.0, 1.0, plan=plan, cluster=cluster)
    written = point_json(point)["plan"]
    assert len(written["pipelines"]) == 1 and written["pipelines"][0]["count"] == 32
    assert plan_from_dict(written, cluster) == plan


def test_the_bottleneck_table_adds_up_to_the_iteration():
    """Its rows were every breakdown key, raw, so a reader adding them counted the total
    gradient sync and the per-micro-batch send twice. Now the summed rows come first and
    their sum row is the estimate's iteration; the parts inside them follow, marked."""
    from rich.console import Console

    cluster, plan = _plan()
    ex = explain(plan, TINY, cluster)
    table = explain_table(ex)[2]
    con = Console(width=200, record=True)
    con.print(table)
    lines = con.export_text().splitlines()
    rows = [ln.strip("│ ").split("│") for ln in lines if ln.startswith("│")]
    rows = [(a.strip(), float(b)) for a, b in rows]
    names = [n for n, _ in rows]
    cut = names.index("iteration (the sum)")
    assert abs(sum(v for _, v in rows[:cut]) - rows[cut][1]) < 1e-3 * cut
    assert abs(rows[cut][1] - ex["iteration_time_s"]) < 1e-4
    assert all("inside the above" in n or "not in the sum" in n for n in names[cut + 1 :])
    assert "data parallel sync total (inside the above)" in names
    assert not any("_" in n for n in names)
