"""Buy or rent: break-even from the same plans, the picture's lines crossing there, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.cost.money import HOURS_PER_YEAR
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.buy import compare_buy
from hetplan.search.provision import provision

OFFERS = [
    {"gpu": "A100-40GB", "gpus_per_node": 2, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 2.74,
     "purchase_usd_per_gpu": 20_000, "lifetime_years": 4, "board_power_w": 400,
     "power_factor": 1.0, "pue": 1.5, "usd_per_kwh": 0.1},
    {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 2, "on_demand_usd_per_gpu_hour": 0.53},
]  # fmt: skip


def test_break_even_per_gpu_type_from_the_cheapest_plan():
    model = load_model("gpt2")
    market = market_from_dict({"offers": OFFERS})
    rows, notes = compare_buy(model, market, 1e9, 16, "fp16", runs_per_year=100)
    assert [r.gpu for r in rows] == ["A100-40GB"]
    assert notes and notes[0][0] == "T4" and "purchase_usd_per_gpu" in notes[0][1]
    row = rows[0]
    # the same plan provisioning picks for cost on that offer alone
    alone = market_from_dict({"offers": OFFERS[:1]})
    best = provision(model, alone, 1e9, 16, "fp16", objective="cost").recommended
    assert row.gpus == sum(best.gpus.values())
    assert row.hours_per_run == pytest.approx(best.time_to_train_s / 3600, rel=1e-12)
    # by hand: energy 0.4 kW x 1.0 x 1.5 x 0.1 = 0.06 $/h; 20,000 / (4 x 8,760 x 2.68)
    assert row.break_even == pytest.approx(20_000 / (4 * 8760 * 2.68), abs=1e-9)
    assert row.utilisation == pytest.approx(100 * row.hours_per_run / HOURS_PER_YEAR)
    # the picture's two lines cross where the workload's utilisation is the break-even
    runs = row.break_even * 4 * HOURS_PER_YEAR / row.hours_per_run
    assert row.rent_usd(runs) == pytest.approx(row.own_usd(runs), rel=1e-9)
    assert row.verdict == ("buy" if row.utilisation >= row.break_even else "rent")


def test_compare_buy_cli(tmp_path):
    import yaml

    market = tmp_path / "m.yaml"
    market.write_text(yaml.safe_dump({"offers": OFFERS}))
    png = tmp_path / "buy.png"
    cmd = [sys.executable, "-m", "hetplan", "provision", "-m", "gpt2", "--tokens", "1e9",
           "-b", "16", "--market", str(market), "--compare-buy", "--runs-per-year", "1e6",
           "--json", "--plot", str(png)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["rows"][0]["verdict"] == "buy"  # a million runs a year: owning wins
    assert data["left_out"][0]["gpu"] == "T4"
    assert png.read_bytes()[:4] == b"\x89PNG"
    bad = [*cmd[:-3], "--runs-per-year", "0"]
    res = subprocess.run(bad, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--runs-per-year" in res.stderr


def test_compare_buy_with_nothing_to_compare_prints_no_empty_table():
    small = Path(__file__).parents[2] / "examples" / "markets" / "small.yaml"
    cmd = [sys.executable, "-m", "hetplan", "provision", "-m", "gpt2", "--tokens", "1e9",
           "-b", "16", "--market", str(small), "--compare-buy"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0] == "gpt2, buy or rent: no GPU type of the market can be compared"
    assert lines[1].startswith("left out (no shipped purchase_usd_per_gpu") and len(lines) == 2
