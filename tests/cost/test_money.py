"""Money as owners and renters pay it: parts by hand, owned nodes, break-even, bad inputs."""

import subprocess
import sys

import pytest

from hetplan.cluster import cluster_from_dict
from hetplan.cost.estimate import estimate
from hetplan.cost.money import Ownership, break_even_utilisation, ownership
from hetplan.errors import InputError
from hetplan.hardware import get_gpu
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.plan import Pipeline, Plan, Stage

OWN = Ownership(
    purchase_usd_per_gpu=30_000.0,
    lifetime_years=4.0,
    utilisation=0.5,
    board_power_w=700.0,
    power_factor=0.8,
    pue=1.25,
    usd_per_kwh=0.10,
)


def test_parts_by_hand():
    # 30,000 $ over 4 years x 8,760 h x 50% = 17,520 training hours
    assert OWN.amortisation_usd_per_hour() == pytest.approx(30_000 / 17_520, rel=1e-12)
    # 0.7 kW x 0.8 x 1.25 x 0.10 $/kWh = 0.07 $/h
    assert OWN.energy_usd_per_hour() == pytest.approx(0.07, rel=1e-12)
    parts = OWN.parts()
    assert parts.rental == 0.0
    assert parts.total == pytest.approx(1.712328767123288 + 0.07, rel=1e-12)


def test_break_even_utilisation_by_hand():
    own = Ownership(25_000.0, 5.0, 0.7, 400.0, 1.0, 1.5, 0.10)  # energy 0.4 x 1.5 x 0.1
    assert own.energy_usd_per_hour() == pytest.approx(0.06, rel=1e-12)
    # 25,000 / (5 x 8,760 x u) + 0.06 = 2.06  =>  u = 25,000 / 87,600
    assert break_even_utilisation(own, 2.06) == pytest.approx(0.285388127853881, abs=1e-9)
    assert break_even_utilisation(own, 0.05) == float("inf")  # rent below the energy bill


def test_defaults_come_from_the_shipped_files():
    own = ownership(get_gpu("H100-80GB"), {}, "x")
    assert own.board_power_w == 700.0  # gpu_specs.csv, SXM5
    assert own.purchase_usd_per_gpu == 33_750.0
    assert ownership(get_gpu("A100-80GB-PCIe"), {"purchase_usd_per_gpu": 1}, "x").board_power_w \
        == 300.0  # fmt: skip
    with pytest.raises(InputError) as info:
        ownership(get_gpu("T4"), {}, "nodes[0]")  # no shipped purchase price for T4
    assert info.value.field == "nodes[0].purchase_usd_per_gpu"


def _cluster(owned_price_key=False, **figures):
    node = {"gpu": "A100-40GB", "gpus": 2, "owned": True, **figures}
    if owned_price_key:
        node["price_per_gpu_hour"] = 1.0
    return cluster_from_dict(
        {"nodes": [node, {"gpu": "A100-40GB", "gpus": 2, "price_per_gpu_hour": 2.5}]}
    )


def test_owned_node_is_never_charged_rental_and_parts_add_up():
    fig = {"purchase_usd_per_gpu": 30_000, "lifetime_years": 4, "utilisation": 0.5,
           "board_power_w": 700, "power_factor": 0.8, "pue": 1.25, "usd_per_kwh": 0.1}  # fmt: skip
    cluster = _cluster(**fig)
    owned, rented = cluster.nodes
    assert owned.owned is not None and rented.owned is None
    model = load_model("gpt2")
    d = [f"{owned.name}:0", f"{owned.name}:1", f"{rented.name}:0", f"{rented.name}:1"]
    plan = Plan(8, 1, (Pipeline(4, (Stage(12, (d[0], d[1])),)),
                       Pipeline(4, (Stage(12, (d[2], d[3])),))), zero_stage=1)  # fmt: skip
    est = estimate(plan, model, cluster)
    parts = est.cost_parts
    assert parts is not None
    # 2 owned GPUs at 1.7123... + 0.07, 2 rented at 2.5: by hand
    assert parts.rental == pytest.approx(5.0, rel=1e-12)
    assert parts.amortisation == pytest.approx(2 * 30_000 / 17_520, rel=1e-12)
    assert parts.energy == pytest.approx(0.14, rel=1e-12)
    assert est.cost_usd_per_hour == pytest.approx(5.0 + 2 * 30_000 / 17_520 + 0.14, rel=1e-12)
    js = est.to_json()["cost_parts_usd_per_million_tokens"]
    assert js["total"] == pytest.approx(est.usd_per_million_tokens, rel=1e-12)
    # owned GPUs only: no rental at all
    only = Plan(4, 1, (Pipeline(4, (Stage(12, (d[0], d[1])),)),))
    assert estimate(only, model, cluster).cost_parts.rental == 0.0
    with pytest.raises(InputError) as info:
        _cluster(owned_price_key=True, **fig)
    assert info.value.field == "nodes[0].price_per_gpu_hour"


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("purchase_usd_per_gpu", -5, "nodes[0].purchase_usd_per_gpu"),
        ("lifetime_years", 0, "nodes[0].lifetime_years"),
        ("pue", 0.9, "nodes[0].pue"),
        ("utilisation", 1.5, "nodes[0].utilisation"),
        ("usd_per_kwh", "cheap", "nodes[0].usd_per_kwh"),
    ],
)
def test_bad_cost_inputs_name_the_field(key, value, field):
    with pytest.raises(InputError) as info:
        _cluster(**{key: value})
    assert info.value.field == field


def test_bad_cost_inputs_in_a_market_file():
    bad = {"gpu": "H100-80GB", "max_nodes": 1, "on_demand_usd_per_gpu_hour": 6.88, "pue": 0.5}
    with pytest.raises(InputError) as info:
        market_from_dict({"offers": [bad]})
    assert info.value.field == "offers[0].pue"
    offer = market_from_dict(
        {"offers": [{**bad, "pue": 1.1, "reserved_usd_per_gpu_hour": 4.0}]}
    ).offers[0]
    assert offer.ownership().pue == 1.1 and offer.reserved_usd_per_gpu_hour == 4.0


@pytest.mark.parametrize(
    "key,value",
    [("purchase_usd_per_gpu", -1), ("lifetime_years", 0), ("pue", 0.8)],
)
def test_cli_exits_2_with_one_line_naming_the_field(tmp_path, key, value):
    path = tmp_path / "c.yaml"
    path.write_text(f"nodes:\n  - {{gpu: A100-40GB, gpus: 2, owned: true, {key}: {value}}}\n")
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "--model", "gpt2", "--cluster", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"nodes[0].{key}" in lines[0], res.stderr
    assert "Traceback" not in res.stderr
