"""Compact plans (a pipeline template repeated over a node range): reading against a plan
written out by hand, writing, round trips, estimate() costing each distinct pipeline once
against costing every pipeline on its own, and malformed entries naming their field."""

import copy
import json
import subprocess
import sys

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.cost.pipeline_classes import pipeline_classes
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.plan import load_plan, plan_from_dict, validate_plan
from hetplan.search.layout import uniform_plan

CLUSTER = "A100-80GB:2x8,T4:2x8"
MODEL = "gpt2-medium"  # 24 layers, 16 heads


def _devs(node, lo, hi):
    return [f"{node}:{k}" for k in range(lo, hi)]


def _knobs():
    return {"global_batch_size": 40, "micro_batch_size": 2, "precision": "fp16"}


def _explicit():
    """Two templates, written out by hand: four one-stage TP4 replicas on the A100 nodes
    (Megatron order: TP innermost, then replicas), and two two-stage TP4 pipelines on the
    T4 nodes (stage 0 of both replicas on t4-0, stage 1 of both on t4-1)."""
    a100 = [
        {
            "batch_size": 8,
            "stages": [{"layers": 24, "devices": _devs(f"a100-80gb-{n}", lo, lo + 4)}],
        }
        for n in (0, 1)
        for lo in (0, 4)
    ]
    t4 = [
        {
            "batch_size": 4,
            "stages": [
                {"layers": 16, "devices": _devs("t4-0", lo, lo + 4)},
                {"layers": 8, "devices": _devs("t4-1", lo, lo + 4)},
            ],
        }
        for lo in (0, 4)
    ]
    return {**_knobs(), "pipelines": a100 + t4}


def _compact():
    return {
        **_knobs(),
        "pipelines": [
            {
                "count": 4,
                "batch_size": 8,
                "nodes": "a100-80gb-0..a100-80gb-1",
                "rank_order": "tp-dp-pp",
                "stages": [{"layers": 24, "tp": 4}],
            },
            {
                "count": 2,
                "batch_size": 4,
                "nodes": ["t4-0", "t4-1"],
                "stages": [{"layers": 16, "tp": 4}, {"layers": 8, "tp": 4}],
            },
        ],
    }


def test_compact_entries_expand_to_the_hand_written_devices():
    assert plan_from_dict(_compact()) == plan_from_dict(_explicit())


def test_replica_major_order_places_each_pipeline_on_consecutive_devices():
    data = _compact()
    data["pipelines"][1]["rank_order"] = "tp-pp-dp"
    plan = plan_from_dict(data)
    # replica 0: t4-0:0-3 then t4-0:4-7; replica 1: the whole of t4-1
    assert [s.devices for s in plan.pipelines[4].stages] == [
        tuple(_devs("t4-0", 0, 4)),
        tuple(_devs("t4-0", 4, 8)),
    ]
    assert [s.devices for s in plan.pipelines[5].stages] == [
        tuple(_devs("t4-1", 0, 4)),
        tuple(_devs("t4-1", 4, 8)),
    ]


def test_writer_finds_the_repeats_and_round_trips(tmp_path):
    plan = plan_from_dict(_explicit())
    compact = plan.to_dict(compact=True)
    expected = _compact()["pipelines"]
    expected[1].update(nodes="t4-0..t4-1", rank_order="tp-dp-pp")  # the writer's range form
    assert compact["pipelines"] == expected
    path = tmp_path / "p.json"
    plan.save(path)
    assert json.loads(path.read_text())["pipelines"][0]["count"] == 4
    again = load_plan(path, parse_inline_cluster(CLUSTER))
    assert again == plan
    assert again.to_dict() == plan.to_dict(compact=False) == plan_from_dict(_explicit()).to_dict()
    plan.save(path, compact=False)
    assert json.loads(path.read_text()) == {**_explicit(), **_rest(plan)}


def _rest(plan):
    """The knob fields the writer adds to the hand-written explicit plan."""
    out = plan.to_dict()
    out.pop("pipelines")
    return out


def test_pipelines_that_do_not_repeat_stay_explicit():
    data = _explicit()
    data["pipelines"][1]["stages"][0]["devices"] = _devs("a100-80gb-1", 4, 8)
    data["pipelines"][3]["stages"][0]["devices"] = _devs("a100-80gb-0", 4, 8)
    plan = plan_from_dict(data)
    entries = plan.to_dict(compact=True)["pipelines"]
    assert entries[:4] == data["pipelines"][:4]  # devices out of rank order: as they were
    assert entries[4]["count"] == 2
    assert plan_from_dict({**_knobs(), "pipelines": entries}) == plan


def _same(shared, own):
    assert shared.iteration_time_s == pytest.approx(own.iteration_time_s, rel=1e-9, abs=0)
    assert shared.breakdown.keys() == own.breakdown.keys()
    for k, v in own.breakdown.items():
        assert shared.breakdown[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    a, b = shared.peak_memory_bytes, own.peak_memory_bytes
    assert a.keys() == b.keys()
    for d, v in b.items():
        assert a[d] == pytest.approx(v, rel=1e-9, abs=0), d
    assert shared.pipeline_times_s == pytest.approx(own.pipeline_times_s, rel=1e-9, abs=0)
    assert shared.mfu == pytest.approx(own.mfu, rel=1e-9)
    assert shared.cost_usd_per_hour == pytest.approx(own.cost_usd_per_hour, rel=1e-9)
    assert [(s.pipeline, s.stage, s.devices) for s in shared.stages] == [
        (s.pipeline, s.stage, s.devices) for s in own.stages
    ]
    for s, o in zip(shared.stages, own.stages, strict=True):
        assert s.end_s == pytest.approx(o.end_s, rel=1e-9, abs=0)
        assert s.grad_sync_s == pytest.approx(o.grad_sync_s, rel=1e-9, abs=1e-15)


def test_two_templates_cost_once_each_and_match_every_pipeline_costed_alone():
    model, cluster = load_model(MODEL), parse_inline_cluster(CLUSTER)
    compact = plan_from_dict(_compact(), cluster)
    explicit = plan_from_dict(_explicit())
    validate_plan(compact, model, cluster)
    shared = estimate(compact, model, cluster, default_params())
    own = estimate(explicit, model, cluster, default_params(), dedupe=False)
    _same(shared, own)
    # 6 pipelines, 8 stages; two distinct pipelines, 3 distinct stages
    assert len(shared.distinct_stages) == 3 and len(own.distinct_stages) == 8
    assert shared.replicas == {0: 4, 4: 2}


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_homogeneous_plan_costs_one_pipeline(zero):
    model, cluster = load_model("gpt3-1.3b"), parse_inline_cluster("A100-80GB:4x8")
    pp = 1 if zero == 3 else 2
    plan = uniform_plan(cluster, model.layers, 2, pp, 32 // (2 * pp), 2, 64,
                        precision="bf16", zero_stage=zero)  # fmt: skip
    loaded = plan_from_dict(json.loads(json.dumps(plan.to_dict(compact=True))), cluster)
    assert loaded == plan
    shared = estimate(loaded, model, cluster, default_params())
    own = estimate(plan, model, cluster, default_params(), dedupe=False)
    _same(shared, own)
    assert len(shared.distinct_stages) == pp


def test_same_template_on_other_hardware_is_another_class():
    cluster = parse_inline_cluster("A100-80GB:1x8,A100-40GB:1x8")
    model = load_model(MODEL)
    data = {
        **_knobs(),
        "global_batch_size": 16,
        "pipelines": [
            {"count": 1, "batch_size": 8, "nodes": n, "stages": [{"layers": 24, "tp": 8}]}
            for n in ("a100-80gb-0", "a100-40gb-0")
        ],
    }
    plan = plan_from_dict(data, cluster)
    classes = pipeline_classes(plan, cluster.device_node, {}, {})
    assert classes == [0, 1]
    est = estimate(plan, model, cluster, default_params())
    assert len(est.distinct_stages) == 2


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["pipelines"][1].update(count=0), "pipelines[1].count"),
        (lambda d: d["pipelines"][1].update(nodes="t4-1..t4-2"), "pipelines[1].nodes"),
        (lambda d: d["pipelines"][1].update(nodes="t4-0..a100-80gb-1"), "pipelines[1].nodes"),
        (lambda d: d["pipelines"][1].update(nodes=["a100-80gb-1"]), "pipelines[1].nodes"),
        (lambda d: d["pipelines"][1].update(nodes="t4-0"), "pipelines[1].nodes"),
        (lambda d: d["pipelines"][1].update(rank_order="pp-dp-tp"), "pipelines[1].rank_order"),
        (lambda d: d["pipelines"][1]["stages"][0].update(tp=0), "pipelines[1].stages[0].tp"),
        (lambda d: d["pipelines"][1].update(batch_size=0), "pipelines[1].batch_size"),
        (lambda d: d["pipelines"][0].update(devices=["a:0"]), "pipelines[0].devices"),
    ],
)
def test_malformed_compact_entries_name_the_field(mutate, field):
    data = copy.deepcopy(_compact())
    mutate(data)
    with pytest.raises(InputError) as info:
        validate_plan(plan_from_dict(data, parse_inline_cluster(CLUSTER)), load_model(MODEL),
                      parse_inline_cluster(CLUSTER))  # fmt: skip
    assert info.value.field == field


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["pipelines"][1].update(count=0), "pipelines[1].count"),
        (lambda d: d["pipelines"][1].update(nodes="t4-0..t4-3"), "pipelines[1].nodes"),
        (lambda d: d["pipelines"][1].update(nodes="a100-80gb-1..t4-0"), "pipelines[1].nodes"),
    ],
)
def test_cli_exits_2_naming_the_field(tmp_path, mutate, field):
    data = copy.deepcopy(_compact())
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "hetplan",
            "predict",
            "--plan",
            str(path),
            "--model",
            MODEL,
            "--cluster",
            CLUSTER,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 2, res.stderr
    assert field in res.stderr and "Traceback" not in res.stderr


def test_same_stages_with_another_batch_share_are_costed_apart():
    cluster, model = parse_inline_cluster("A100-80GB:2x8"), load_model(MODEL)
    data = {
        **_knobs(),
        "global_batch_size": 24,
        "pipelines": [
            {
                "count": 1,
                "batch_size": b,
                "nodes": f"a100-80gb-{n}",
                "stages": [{"layers": 24, "tp": 8}],
            }
            for n, b in ((0, 8), (1, 16))
        ],
    }
    plan = plan_from_dict(data, cluster)
    shared = estimate(plan, model, cluster, default_params())
    _same(shared, estimate(plan, model, cluster, default_params(), dedupe=False))
    assert shared.pipeline_times_s[1] > shared.pipeline_times_s[0]


def test_plan_out_writes_compact_and_expand_writes_every_device(tmp_path):
    def plan_cmd(*extra):
        return subprocess.run(
            [
                *(sys.executable, "-m", "hetplan", "plan", "--model", "gpt3-1.3b"),
                *("--cluster", "A100-80GB:4x8", "--top", "1", "--json", *extra),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )

    compact, full = tmp_path / "compact.json", tmp_path / "full.json"
    a = plan_cmd("--out", str(compact))
    b = plan_cmd("--out", str(full), "--expand")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    entries = json.loads(compact.read_text())["pipelines"]
    assert len(entries) == 1 and entries[0]["count"] > 1 and "devices" not in str(entries)
    explicit = json.loads(full.read_text())["pipelines"]
    assert len(explicit) == entries[0]["count"]
    devices = [d for p in explicit for s in p["stages"] for d in s["devices"]]
    assert sorted(devices) == sorted(f"a100-80gb-{n}:{k}" for n in range(4) for k in range(8))
    cluster = parse_inline_cluster("A100-80GB:4x8")
    assert load_plan(compact, cluster) == load_plan(full, cluster)
    # --json: per distinct stage with its replicas; every device's memory only with --expand
    first, expanded = json.loads(a.stdout)["plans"][0], json.loads(b.stdout)["plans"][0]
    assert "peak_memory_gb" not in first and len(expanded["peak_memory_gb"]) == 32
    assert sum(s["replicas"] * s["tp"] for s in first["stages"]) == 32
    assert first["max_peak_memory_gb"] == max(expanded["peak_memory_gb"].values())
