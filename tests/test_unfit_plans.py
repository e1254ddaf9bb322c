"""A plan that does not fit in memory is bad input: ``predict`` and ``explain`` show it and
exit 2 with one line naming the stage and its need, ``replan`` refuses to write one, and a
search that finds none never names a per-GPU need the GPUs could hold.

Expected figures come from mixed-precision Adam's 16 bytes per parameter (weights and
gradients in 16 bits, fp32 master weights and two moments: the ZeRO paper's 2 + 2 + 12)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ADAM_BYTES = 16  # per parameter, mixed precision (ZeRO paper, section 3.1)
GPT3_175B = 175e9
GPT3_13B = 13e9


def _hetplan(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetplan", *args], capture_output=True, text=True, timeout=300,
        cwd=cwd,
    )  # fmt: skip


def _one_node_plan(path: Path) -> Path:
    """GPT-3 175B on one node of 8 A100-80GB, TP 8: 16 x 175e9 / 8 = 350 GB a GPU."""
    devices = [f"a100-80gb-0:{i}" for i in range(8)]
    path.write_text(json.dumps({
        "global_batch_size": 8, "micro_batch_size": 1, "precision": "bf16",
        "pipelines": [{"batch_size": 8, "stages": [{"layers": 96, "devices": devices}]}],
    }))  # fmt: skip
    return path


def _need_gb(line: str) -> tuple[float, float]:
    m = re.search(r"needs ([\d.]+) GB of ([\d.]+) GB", line)
    assert m, line
    return float(m.group(1)), float(m.group(2))


def test_predict_shows_an_unfit_plan_then_exits_2(tmp_path: Path) -> None:
    plan = _one_node_plan(tmp_path / "p.json")
    base = ["--model", "gpt3-175b", "--cluster", "A100-80GB:1x8"]
    res = _hetplan("predict", "--plan", str(plan), *base, "--json")
    assert res.returncode == 2, res.stderr
    assert json.loads(res.stdout)["fits"] is False  # the prediction is still printed
    line = res.stderr.strip()
    assert "\n" not in line and "Traceback" not in res.stderr
    assert line.startswith("error: --plan: does not fit in memory: a100-80gb-0:")
    assert "(A100-80GB, pipeline 0 stage 0, 96 layers)" in line
    need, has = _need_gb(line)
    assert has == 80.0 and need >= ADAM_BYTES * GPT3_175B / 8 / 1e9  # 350 GB
    # the same plan from degrees names the plan itself; its pictures are not written
    trace = tmp_path / "t.json"
    res = _hetplan("predict", *base, "--tp", "8", "--pp", "1", "--dp", "1",
                   "--micro-batch-size", "1", "--trace", str(trace))  # fmt: skip
    assert res.returncode == 2 and res.stderr.startswith("error: plan: does not fit in memory")
    assert "Iteration breakdown" in res.stdout and not trace.exists()


def test_explain_shows_an_unfit_plan_then_exits_2(tmp_path: Path) -> None:
    plan = _one_node_plan(tmp_path / "p.json")
    res = _hetplan("explain", str(plan), "--model", "gpt3-175b", "--cluster", "A100-80GB:1x8")
    assert res.returncode == 2, res.stderr
    assert "Stages" in res.stdout  # the explanation (negative headroom) comes first
    assert res.stderr.startswith("error: PLAN: does not fit in memory: a100-80gb-0:")
    res = _hetplan("explain", str(plan), "--model", "gpt3-175b", "--cluster",
                   "A100-80GB:1x8", "--json")  # fmt: skip
    assert res.returncode == 2
    info = json.loads(res.stdout)
    assert info["fits"] is False and info["memory_shortfall"] in res.stderr


def test_a_fitting_plan_still_predicts_with_exit_0(tmp_path: Path) -> None:
    res = _hetplan("predict", "--model", "gpt3-175b", "--cluster", "A100-80GB:128x8", "--tp",
                   "8", "--pp", "16", "--dp", "8", "--micro-batch-size", "1",
                   "--recompute", "full", "--zero-stage", "1", "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["fits"] is True


def test_replan_where_nothing_fits_writes_nothing(tmp_path: Path) -> None:
    # 16 V100-16GB hold GPT-3 13B; 8 cannot: 16 x 13e9 = 208 GB of state > 8 x 16 GB
    assert ADAM_BYTES * GPT3_13B > 8 * 16e9
    base = ["--model", "gpt3-13b", "--cluster", "V100-16GB:2x8"]
    plan = tmp_path / "p.json"
    res = _hetplan("plan", *base, "--global-batch-size", "64", "--out", str(plan))
    assert res.returncode == 0, res.stderr
    out = tmp_path / "new.json"
    for extra in ([], ["--json"]):
        res = _hetplan("replan", "--plan", str(plan), *base, "--lost", "v100-16gb-1",
                       "--out", str(out), *extra)  # fmt: skip
        assert res.returncode == 2, res.stdout
        assert res.stdout == "" and not out.exists()
        line = res.stderr.strip()
        assert line.startswith("error: --lost: without v100-16gb-1, no plan fits in memory: "), line
        m = re.search(r"need of any plan is ([\d.]+) GB, the largest GPU has ([\d.]+) GB", line)
        assert m, line
        assert float(m.group(1)) > float(m.group(2)) == 16.0


def test_a_failed_search_never_names_a_need_the_gpus_hold() -> None:
    # the heterogeneous search weighed no plan here; it once reported one layer's stage
    # ("the smallest per-GPU need of any plan is 2.1 GB, the largest GPU has 16.0 GB")
    for cluster in ("V100-16GB:1x8", "V100-16GB:1x8,T4:1x4"):
        res = _hetplan("plan", "--model", "gpt3-13b", "--cluster", cluster,
                       "--global-batch-size", "64", "--heterogeneous")  # fmt: skip
        assert res.returncode == 2
        line = res.stderr.strip()
        assert line.startswith("error: plan: no plan fits in memory"), line
        for need in re.findall(r"(?:is|at least) ([\d.]+) GB", line):
            assert float(need) > 16.0, line
    # GPT-3 175B on 16 GPUs of 16 GB: the state's floor is named, above 16 GB and no more
    # than the 16 x 175e9 / 16 = 175 GB a GPU that sharding everything over all would give
    res = _hetplan("plan", "--model", "gpt3-175b", "--cluster", "T4:1x8,V100-16GB:1x8")
    assert res.returncode == 2
    m = re.search(r"need at least ([\d.]+) GB per GPU", res.stderr)
    assert m, res.stderr
    assert 16.0 < float(m.group(1)) <= ADAM_BYTES * GPT3_175B / 16 / 1e9
