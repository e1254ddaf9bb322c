"""Runs over several nodes: every worker option reaches the worker through torchrun's own
parser, and two nodes (two launches on this machine) train one plan."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import WORKER, _env, worker_args


def _every_field_set() -> RunConfig:
    """Returns a configuration with every field away from its default."""
    values: dict[str, Any] = {}
    defaults = RunConfig("p", "m", "c")
    for f in fields(RunConfig):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            values[f.name] = not default
        elif isinstance(default, int):
            values[f.name] = default + 3
        elif isinstance(default, float):
            values[f.name] = default + 0.25
        else:
            values[f.name] = f"{f.name}-value"
    return RunConfig(**values)


def test_every_worker_option_survives_torchruns_parser() -> None:
    """torchrun's parser reads the worker's options too: one that is a prefix of two of its
    own stops the launch ("ambiguous option"; the worker's ``--node`` did, on every
    multi-node run), and one that is a prefix of exactly one is taken by torchrun."""
    from torch.distributed.run import parse_args

    from hetplan.runtime.worker import _parse

    cfg = _every_field_set()
    args = worker_args(cfg)
    head = ["--nnodes=2", "--node-rank=1", "--master-addr=h", "--master-port=7",
            "--nproc-per-node=2"]  # fmt: skip
    parsed = parse_args([*head, "-m", WORKER, *args])
    assert parsed.module and parsed.training_script == WORKER
    assert parsed.training_script_args == args
    assert _parse(parsed.training_script_args) == cfg


CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
nodes:
  - {name: n0, gpu: cpu, gpus: 1, intra_node_bandwidth: 5 GB/s, network_bandwidth: 1 GB/s}
  - {name: n1, gpu: cpu, gpus: 1, intra_node_bandwidth: 5 GB/s, network_bandwidth: 1 GB/s}
"""


@pytest.mark.distributed
@pytest.mark.slow
def test_two_nodes_train_one_plan(tmp_path: Path, inputs: dict[str, Path]) -> None:
    """Both nodes' commands at once, on this machine: node rank 0 reports the run (its
    rank 0 writes the record), node rank 1 says that it finished and who reports."""
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    stages = [{"layers": 2, "devices": ["n0:0"]}, {"layers": 2, "devices": ["n1:0"]}]
    plan = {"global_batch_size": 4, "micro_batch_size": 2, "precision": "fp32",
            "schedule": "1F1B", "pipelines": [{"batch_size": 4, "stages": stages}]}  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = [sys.executable, "-m", "hetplan", "launch", str(tmp_path / "plan.json"),
            "--model", str(inputs["gpt"]), "--cluster", str(tmp_path / "cluster.yaml"),
            "--steps", "2", "--device", "cpu", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--json"]  # fmt: skip
    pipe = subprocess.PIPE
    procs = [
        subprocess.Popen(
            [*base, "--node-rank", str(r)], env=_env(1), stdout=pipe, stderr=pipe, text=True
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    first, second = (json.loads(out) for out, _ in outs)
    assert [s["step"] for s in first["steps"]] == [1, 2]
    assert set(first["peak_memory_bytes"]) == {"n0:0", "n1:0"}
    assert first["world_size"] == 2
    assert second == {"node_rank": 1, "ranks": 1, "reported_by": "n0"}
