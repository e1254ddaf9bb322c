"""Shared inputs of the runtime tests: tiny models and a 4-device CPU cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
nodes:
  - {name: host, gpu: cpu, gpus: 4, intra_node_bandwidth: 5 GB/s}
"""

GPT = {"n_embd": 32, "n_layer": 4, "n_head": 4, "vocab_size": 64, "n_positions": 16}
LLAMA = {
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 64,
    "max_position_embeddings": 16,
}


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Returns paths of the tiny GPT and Llama configs and the cluster file."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "gpt").mkdir()
    (root / "llama").mkdir()
    (root / "gpt" / "config.json").write_text(json.dumps(GPT))
    (root / "llama" / "config.json").write_text(json.dumps(LLAMA))
    # heads of 16 on a hidden size of 32: queries 64 wide (Qwen3's and Gemma's shape)
    (root / "llama_wide").mkdir()
    (root / "llama_wide" / "config.json").write_text(json.dumps({**LLAMA, "head_dim": 16}))
    (root / "cluster.yaml").write_text(CLUSTER)
    return {
        "gpt": root / "gpt" / "config.json",
        "llama": root / "llama" / "config.json",
        "llama_wide": root / "llama_wide" / "config.json",
        "cluster": root / "cluster.yaml",
    }


def _write_plan(
    path: Path, pipelines: list[tuple[int, list[tuple[int, list[int]]]]], **kw: Any
) -> Path:
    """Writes a plan: pipelines as (batch, [(layers, [device indices on host])])."""
    data = {
        "global_batch_size": sum(b for b, _ in pipelines),
        "micro_batch_size": kw.pop("micro_batch_size", 2),
        "precision": "fp32",
        "schedule": kw.pop("schedule", "1F1B"),
        **kw,
        "pipelines": [
            {
                "batch_size": b,
                "stages": [
                    {"layers": n, "devices": [f"host:{d}" for d in devs]} for n, devs in stages
                ],
            }
            for b, stages in pipelines
        ],
    }
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="session")
def write_plan() -> Any:
    """Returns the plan-writing helper."""
    return _write_plan
