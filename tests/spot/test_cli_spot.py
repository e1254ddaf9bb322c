"""``hetplan spot simulate --json`` and ``spot synth`` end to end, in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str, cwd=None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetplan", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_simulate_json_on_a_shipped_trace(tmp_path):
    png = tmp_path / "spot.png"
    res = run(
        "spot", "simulate", "--trace", "sailor_a100_original.json", "--model", "gpt3-1.3b",
        "--cluster", "A100-80GB:2x8", "--tokens", "1e9", "--json", "--plot", str(png),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    names = [p["name"] for p in data["policies"]]
    assert names == ["hetplan", "restart", "wait", "on-demand"]
    for p in data["policies"]:
        assert p["tokens"] > 0 and p["dollars"] > 0
        assert p["usd_per_million_tokens"] == pytest.approx(p["dollars"] / (p["tokens"] / 1e6))
    od = data["policies"][3]
    # on-demand: 16 GPUs at the catalog's on-demand price until the target, no losses
    assert od["reached_target"] and od["redone_s"] == 0 and od["preemptions"] == 0
    assert od["gpu_hours"] == pytest.approx(16 * od["time_to_target_s"] / 3600)
    assert od["time_to_target_s"] == pytest.approx(1e9 / data["first_tokens_per_s"])
    # the catalog's on-demand A100-80GB price (AWS p4de.24xlarge, per GPU-hour)
    assert od["dollars"] == pytest.approx(16 * 3.4309 * od["time_to_target_s"] / 3600)
    assert data["changes"] == 11 and data["preemption_points"] == 5
    c, m = data["checkpoint_s"], data["mtbf_s"]
    assert m == pytest.approx(5229 / 5)
    assert data["checkpoint_interval_s"] == pytest.approx((2 * c * m) ** 0.5)
    assert png.stat().st_size > 0


def test_synth_writes_a_trace_simulate_reads(tmp_path):
    out = tmp_path / "day.csv"
    res = run(
        "spot", "synth", "--cluster", "T4:3x4", "--preemption-rate", "1",
        "--mean-outage", "10m", "--duration", "3h", "--seed", "5", "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "time_s,gpu_type,count" and lines[1] == "0.000,T4,12"
    assert lines[-1].startswith("10800.000,T4,")
    before = out.read_text()
    for rate in ("-1", "inf", "nan"):  # inf once wrote negative counts, nan no changes
        bad = run("spot", "synth", "--cluster", "T4:3x4", "--preemption-rate", rate,
                  "--out", str(out))  # fmt: skip
        assert bad.returncode == 2 and "--preemption-rate" in bad.stderr
    assert out.read_text() == before


@pytest.mark.slow
def test_simulate_without_a_pool_prices_the_built_in_market():
    """A trace of named GPU types needs no --cluster: the built-in market (provision's
    default) prices it, as --market with the shipped file does; both options at once are
    refused naming --market (neither was refused before)."""
    from importlib import resources

    args = ("spot", "simulate", "--trace", "sailor_a100_v100_pools.csv", "--model", "gpt3-1.3b",
            "--tokens", "1e9", "--json")  # fmt: skip
    bare = run(*args)
    assert bare.returncode == 0, bare.stderr
    shipped = resources.files("hetplan.data").joinpath("market.yaml")
    with resources.as_file(shipped) as path:
        named = run(*args, "--market", str(path))
    assert named.returncode == 0, named.stderr
    a, b = json.loads(bare.stdout), json.loads(named.stdout)
    assert a["policies"] == b["policies"] and a["first_tokens_per_s"] > 0
    both = run(*args, "--market", "x.yaml", "--cluster", "A100-40GB:1x8")
    assert both.returncode == 2 and both.stderr.startswith("error: --market: give --cluster or")
