"""Inputs of the elastic runtime tests: a tiny GPT and four one-CPU nodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
storage_bandwidth: 20 MB/s
nodes:
  - {name: n0, gpu: cpu, gpus: 1, network_bandwidth: 40 MB/s}
  - {name: n1, gpu: cpu, gpus: 1, network_bandwidth: 40 MB/s}
  - {name: n2, gpu: cpu, gpus: 1, network_bandwidth: 40 MB/s}
  - {name: n3, gpu: cpu, gpus: 1, network_bandwidth: 40 MB/s}
"""
GPT = {"n_embd": 32, "n_layer": 4, "n_head": 4, "vocab_size": 64, "n_positions": 16}
PLAN = {
    "global_batch_size": 8,
    "micro_batch_size": 2,
    "precision": "fp32",
    "schedule": "1F1B",
    "pipelines": [
        {"batch_size": 4, "stages": [{"layers": 2, "devices": [f"n{x}:0"]} for x in pair]}
        for pair in ((0, 1), (2, 3))
    ],
}  # fmt: skip


@pytest.fixture()
def elastic_inputs(tmp_path: Path) -> dict[str, Path]:
    """Returns paths of the model config, cluster file and a 2x2 plan."""
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(GPT))
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    (tmp_path / "plan.json").write_text(json.dumps(PLAN))
    return {
        "model": tmp_path / "gpt" / "config.json",
        "cluster": tmp_path / "cluster.yaml",
        "plan": tmp_path / "plan.json",
    }
