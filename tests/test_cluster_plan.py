import json

import pytest

from hetplan.cluster import cluster_from_dict, load_cluster, parse_inline_cluster
from hetplan.errors import InputError
from hetplan.hardware import catalog_gpus, get_gpu
from hetplan.model import load_model
from hetplan.plan import load_plan, plan_from_dict, validate_plan
from hetplan.units import parse_bandwidth_bytes_per_s


def test_catalog_has_required_gpus():
    names = {g.name for g in catalog_gpus()}
    for required in (
        "A100-40GB",
        "A100-80GB",
        "H100-80GB",
        "H200-141GB",
        "V100-16GB",
        "V100-32GB",
        "T4",
        "L4",
        "L40S",
        "A10",
        "RTX 3090",
        "RTX 4090",
        "MI300X",
    ):
        assert required in names
    assert get_gpu("a100").name == "A100-40GB"
    assert get_gpu("V100-16GB").bf16_flops is None
    assert get_gpu("h100-80gb").peak_flops("bf16") == pytest.approx(989e12)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10 Gbit/s", 1.25e9),
        ("25Gbps", 3.125e9),
        ("600 GB/s", 600e9),
        ("400 MB/s", 400e6),
    ],
)
def test_bandwidth_units(text, expected):
    assert parse_bandwidth_bytes_per_s(text, "f") == pytest.approx(expected)


def test_cluster_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("""
gpu_types:
  MyGPU: {bf16_tflops: 200, fp16_tflops: 200, memory_gb: 48, hbm_gbyte_per_s: 1000}
nodes:
  - name: v100-0
    gpu: V100-16GB
    gpus: 4
    intra_node_bandwidth: 170 Gbit/s
    network_bandwidth: 10 Gbit/s
    price_per_gpu_hour: 3.06
  - {name: a100, gpu: A100-80GB, gpus: 8, count: 4}
  - {name: mine, gpu: MyGPU, gpus: 2}
""")
    c = load_cluster(str(path))
    assert [n.name for n in c.nodes] == ["v100-0", "a100-0", "a100-1", "a100-2", "a100-3", "mine"]
    assert c.num_gpus == 4 + 32 + 2
    v = c.node("v100-0")
    assert v.intra_node_bytes_per_s == pytest.approx(170e9 / 8)
    assert v.usd_per_gpu_hour == 3.06
    assert c.node("mine").gpu.memory_bytes == 48e9
    assert c.device_node("a100-2:7").gpu.name == "A100-80GB"


def test_inline_cluster():
    c = parse_inline_cluster("A100-80GB:2x8,V100-32GB:1x4")
    assert [n.name for n in c.nodes] == ["a100-80gb-0", "a100-80gb-1", "v100-32gb-0"]
    assert not c.is_homogeneous()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"nodes": []}, "nodes"),
        ({"nodes": [{"gpu": "B9000", "gpus": 8}]}, "nodes[0].gpu"),
        ({"nodes": [{"gpu": "T4", "gpus": -1}]}, "nodes[0].gpus"),
        ({"nodes": [{"gpu": "T4", "network_bandwidth": "fast"}]}, "nodes[0].network_bandwidth"),
        ({"nodes": [{"gpu": "T4", "colour": "red"}]}, "nodes[0].colour"),
        (
            {"gpu_types": {"X": {"fp16_tflops": 1}}, "nodes": [{"gpu": "X"}]},
            "gpu_types.X.memory_gb",
        ),
    ],
)
def test_bad_clusters_name_the_field(data, field):
    with pytest.raises(InputError) as info:
        cluster_from_dict(data)
    assert info.value.field == field


def _plan_dict():
    return {
        "global_batch_size": 32,
        "micro_batch_size": 1,
        "precision": "fp16",
        "recompute": "none",
        "zero_stage": 0,
        "schedule": "1F1B",
        "pipelines": [
            {
                "batch_size": 16,
                "stages": [
                    {"layers": 5, "devices": ["v100-0:0"]},
                    {"layers": 19, "devices": ["t4:0", "t4:1"]},
                ],
            },
            {"batch_size": 16, "stages": [{"layers": 24, "devices": ["v100-0:1", "v100-0:2"]}]},
        ],
    }


def _cluster():
    return cluster_from_dict(
        {
            "nodes": [
                {"name": "v100-0", "gpu": "V100-16GB", "gpus": 4},
                {"name": "t4", "gpu": "T4", "gpus": 4},
            ]
        }
    )


def test_asymmetric_plan_roundtrip(tmp_path):
    plan = plan_from_dict(_plan_dict())
    validate_plan(plan, load_model("gpt2-medium"), _cluster())
    path = tmp_path / "p.json"
    plan.save(path)
    assert load_plan(path) == plan
    assert not plan.is_uniform()


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["pipelines"][0].update(batch_size=15), "pipelines.batch_size"),
        (lambda d: d["pipelines"][1]["stages"][0].update(layers=23), "pipelines[1].stages"),
        (lambda d: d["pipelines"][1]["stages"][0].update(devices=["v100-0:0"]), "devices"),
        (lambda d: d["pipelines"][1]["stages"][0].update(devices=["gone:0"]), "devices"),
        (lambda d: d["pipelines"][1]["stages"][0].update(devices=["v100-0:9"]), "devices"),
        (
            lambda d: d["pipelines"][1]["stages"][0].update(devices=["v100-0:1", "t4:3"]),
            "pipelines[1].stages[0].devices",
        ),
        (lambda d: d.update(schedule="ZB"), "schedule"),
        (lambda d: d.update(micro_batch_size=3), "pipelines[0].batch_size"),
    ],
)
def test_bad_plans_name_the_field(mutate, field):
    data = _plan_dict()
    mutate(data)
    with pytest.raises(InputError) as info:
        validate_plan(plan_from_dict(data), load_model("gpt2-medium"), _cluster())
    assert info.value.field == field


def test_malformed_plan_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(InputError, match="not valid JSON"):
        load_plan(path)
    path.write_text(json.dumps({"global_batch_size": 2}))
    with pytest.raises(InputError, match="pipelines"):
        load_plan(path)


def test_node_hash_is_the_fields_and_survives_pickling_into_another_process():
    # a node keeps its hash (the searches' caches hash tuples of nodes many times); equal
    # nodes hash alike, and a pickled node hashes afresh: string hashes differ by process
    import pickle
    import subprocess
    import sys
    from dataclasses import replace

    node = load_cluster("A100-80GB:1x8").nodes[0]
    twin = load_cluster("A100-80GB:1x8").nodes[0]
    assert node == twin and hash(node) == hash(twin) and node is not twin
    assert replace(node, gpus=4) != node
    assert {node: 1}[twin] == 1
    blob = pickle.dumps(node)  # after hashing: the kept hash must not travel
    code = (
        "import pickle, sys; from hetplan.cluster import load_cluster; "
        "n = pickle.loads(sys.stdin.buffer.read()); m = load_cluster('A100-80GB:1x8').nodes[0]; "
        "print(n == m, hash(n) == hash(m), {m: 1}.get(n))"
    )
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": ""}, check=True)  # fmt: skip
    assert out.stdout.decode().split() == ["True", "True", "1"]
    devices = node.devices()
    devices.append("x")  # a copy: the node's own names are untouched
    assert node.devices() == [f"{node.name}:{i}" for i in range(8)]
