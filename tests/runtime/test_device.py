"""The device a run asks for, checked without a GPU: ``--device cuda`` where CUDA is absent
is refused before any process starts (one line, exit 2), and the plan's tf32 switch sets
the CUDA matmul flags (which exist without a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hetplan.runtime.launch import _env
from hetplan.runtime.precision import set_matmul_precision


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused_before_start(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", [(4, [(4, [0])]), (4, [(4, [1])])])
    root = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "hetplan", "launch", str(plan), "--model", str(inputs["gpt"]),
        "--cluster", str(inputs["cluster"]), "--device", "cuda", "--checkpoint-dir", str(root),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert res.stderr == "error: --device: cuda was asked for, but CUDA is not available here\n"
    assert res.stdout == "" and not root.exists()


def test_tf32_switch_sets_the_cuda_matmul_flags() -> None:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    before = (matmul.allow_tf32, cudnn.allow_tf32)
    try:
        set_matmul_precision("tf32", torch.device("cuda"))
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (True, True)
        for precision in ("fp32", "bf16", "fp16"):  # fp32 math stays fp32 under these
            set_matmul_precision(precision, torch.device("cuda"))
            assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
        set_matmul_precision("tf32", torch.device("cpu"))  # CPU: no such flag is touched
        assert (matmul.allow_tf32, cudnn.allow_tf32) == (False, False)
    finally:
        matmul.allow_tf32, cudnn.allow_tf32 = before


def test_a_plan_that_does_not_fit_is_refused_before_start(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    # the tiny GPT's 4 layers of 32 wide hold 12 x 32^2 x 4 = 49,152 weights, 16 bytes each
    # with Adam in mixed precision: 786 kB of state on a device of 100 kB
    cluster = tmp_path / "small.yaml"
    cluster.write_text(
        "gpu_types:\n  cpu: {fp32_tflops: 0.1, fp16_tflops: 0.2, memory_gb: 0.0001, "
        "hbm_gbyte_per_s: 10}\nnodes:\n  - {name: host, gpu: cpu, gpus: 4}\n"
    )
    plan = write_plan(tmp_path / "p.json", [(4, [(4, [0])]), (4, [(4, [1])])])
    root = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "hetplan", "launch", str(plan), "--model", str(inputs["gpt"]),
        "--cluster", str(cluster), "--device", "cpu", "--checkpoint-dir", str(root),
    ]  # fmt: skip
    res = subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert line.startswith("error: PLAN: does not fit in memory: host:0 (cpu, pipeline 0"), line
    assert line.endswith("of 0.0 GB") and res.stdout == "" and not root.exists()


@pytest.mark.skipif(not Path("/proc/meminfo").is_file(), reason="the host does not say")
def test_cpu_ranks_that_would_exhaust_the_host_are_refused_before_start(tmp_path: Path) -> None:
    # GPT-3 175B's state alone is 16 bytes x 175e9 = 2.8 TB a replica (mixed-precision
    # Adam): two CPU ranks of it exceed any host, though each "device" here holds 1 PB
    cluster = tmp_path / "big.yaml"
    cluster.write_text(
        "gpu_types:\n  cpu: {fp32_tflops: 0.1, fp16_tflops: 0.2, memory_gb: 1000000, "
        "hbm_gbyte_per_s: 10}\nnodes:\n  - {name: host, gpu: cpu, gpus: 2}\n"
    )
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({
        "global_batch_size": 2, "micro_batch_size": 1, "precision": "fp32",
        "pipelines": [{"batch_size": 1, "stages": [{"layers": 96, "devices": [f"host:{i}"]}]}
                      for i in range(2)],
    }))  # fmt: skip
    cmd = [sys.executable, "-m", "hetplan", "launch", str(plan), "--model", "gpt3-175b",
           "--cluster", str(cluster), "--device", "cpu", "--seq-len", "128"]  # fmt: skip
    res = subprocess.run(cmd, env=_env(1), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --device: cpu: the plan's 2 processes here would hold ")
    need = float(line.split("would hold ")[1].split(" GB")[0].replace(",", ""))
    assert need >= 2 * 16 * 175e9 / 1e9  # at least the two replicas' Adam state
