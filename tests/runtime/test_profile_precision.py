"""``hetplan profile --precision``: each precision timed as the runtime runs it, stored
under its name, and taken by the cost model for plans of that precision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hetplan.cluster import load_cluster  # noqa: E402
from hetplan.cost.estimate import estimate  # noqa: E402
from hetplan.measured.profile_db import ProfileDB  # noqa: E402
from hetplan.model import load_model  # noqa: E402
from hetplan.plan import load_plan  # noqa: E402
from hetplan.runtime.profile import profile_model  # noqa: E402

CLUSTER = """\
gpu_types:
  cpu: {fp32_tflops: 0.1, bf16_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
nodes:
  - {name: host, gpu: cpu, gpus: 1}
"""


def _plan(path: Path, precision: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "global_batch_size": 2,
                "micro_batch_size": 2,
                "precision": precision,
                "pipelines": [{"batch_size": 2, "stages": [{"layers": 4, "devices": ["host:0"]}]}],
            }
        )
    )
    return path


def test_bf16_profile_is_stored_and_used(tmp_path: Path, inputs: dict[str, Path]) -> None:
    model = load_model(str(inputs["gpt"]))
    db = ProfileDB(tmp_path / "p.sqlite")
    rates: dict[str, float] = {}
    records = profile_model(
        db, "cpu", model, [2], [1], torch.device("cpu"), reps=1, precisions=("fp32", "bf16"),
        rates=rates,
    )  # fmt: skip
    assert set(rates) == {"fp32", "bf16"} and all(r > 0 for r in rates.values())
    by = {r.precision: r for r in records}
    assert set(by) == {"fp32", "bf16"}
    # bf16 runs on 2-byte parameters and activations: what a layer saves for its backward
    # about halves (norm statistics and masks stay as they are)
    assert by["bf16"].activation_bytes < 0.7 * by["fp32"].activation_bytes
    cluster_path = tmp_path / "c.yaml"
    cluster_path.write_text(CLUSTER)
    cluster = load_cluster(str(cluster_path))
    bf16 = load_plan(_plan(tmp_path / "bf16.json", "bf16"))
    assert estimate(bf16, model, cluster, profile=db).compute_source == "measured"
    only_fp32 = ProfileDB(tmp_path / "q.sqlite")
    profile_model(only_fp32, "cpu", model, [2], [1], torch.device("cpu"), reps=1)
    assert estimate(bf16, model, cluster, profile=only_fp32).compute_source != "measured"


def test_unknown_precision_is_a_usage_error(inputs: dict[str, Path]) -> None:
    args = ["profile", "--model", str(inputs["gpt"]), "--precision", "fp64"]
    out = subprocess.run(
        [sys.executable, "-m", "hetplan", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--precision" in out.stderr and "fp64" in out.stderr
    assert "Traceback" not in out.stderr


def test_cluster_entry_hint_gives_the_measured_low_precision_rate() -> None:
    """The entry ``profile`` prints is a valid cluster-file GPU type carrying the bf16 rate
    it measured, never the fp32 figure under the fp16 name; without a low-precision
    measurement it says what to run instead."""
    import yaml

    from hetplan.hardware import gpu_from_mapping
    from hetplan.runtime.cli import cluster_entry_hint

    text = cluster_entry_hint("cpu", (0.25, 12.0), {"fp32": 0.25, "bf16": 0.125})
    entry = yaml.safe_load(text.removeprefix("cluster file entry: "))["gpu_types"]["cpu"]
    gpu = gpu_from_mapping("cpu", entry, "gpu_types.cpu")
    assert gpu.fp32_flops == pytest.approx(0.25e12) and gpu.fp16_flops == pytest.approx(0.125e12)
    assert gpu.bf16_flops == pytest.approx(0.125e12) and "fp16_tflops" not in entry
    bare = cluster_entry_hint("cpu", (0.25, 12.0), {"fp32": 0.25})
    assert "fp16_tflops" not in bare.splitlines()[0] and "--precision" in bare.splitlines()[1]
