"""Every file under examples/ loads with the loader that reads its format, and the example
plans estimate (and fit) on the model and cluster they are written for.

A file under examples/ that no loader here claims fails the test: a new format gets its
loader (and its page in docs/inputs.md) before its example lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hetplan.cluster import load_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.cost.runs import load_runs
from hetplan.market import load_market
from hetplan.measured.csv_import import read_profile_csv
from hetplan.model import load_model
from hetplan.plan import load_plan, validate_plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FILES = sorted(p for p in EXAMPLES.rglob("*") if p.is_file())

# the model and cluster each example plan is written for (a plan file states neither)
PLAN_TARGETS = {
    "plans/gpt2-medium-amp-hetero.json": ("gpt2-medium", "clusters/amp_hetero.yaml"),
    "plans/gpt3-6.7b-a100x32.json": ("gpt3-6.7b", "clusters/a100x32.yaml"),
    "plans/tiny-gpt-cpu2.json": ("models/tiny-gpt/config.json", "clusters/cpu2.yaml"),
    "runs/plans/opt350m-gh200-tp4-gbs1.json": ("opt-350m", "GH200-96GB:1x4"),
    "runs/plans/opt350m-gh200-tp4-gbs32.json": ("opt-350m", "GH200-96GB:1x4"),
}


def _where(spec: str) -> str:
    return str(EXAMPLES / spec) if (EXAMPLES / spec).exists() else spec


def _load(path: Path) -> object:
    rel = path.relative_to(EXAMPLES).as_posix()
    top = rel.split("/")[0]
    if top == "clusters" and path.suffix == ".yaml":
        cluster = load_cluster(str(path))
        assert cluster.num_gpus > 0
        return cluster
    if top == "markets" and path.suffix == ".yaml":
        market = load_market(str(path))
        assert market.offers
        return market
    if top == "models" and path.name == "config.json":
        return load_model(str(path))
    if top == "profiles" and path.suffix == ".csv":
        batch = read_profile_csv(path, {})
        assert batch.layers, f"{rel}: no layer rows"
        return batch
    if path.suffix == ".json" and (top == "plans" or rel.startswith("runs/plans/")):
        if rel not in PLAN_TARGETS:
            pytest.fail(f"{rel}: add the model and cluster it is for to PLAN_TARGETS")
        model_spec, cluster_spec = PLAN_TARGETS[rel]
        cluster = load_cluster(_where(cluster_spec))
        model = load_model(_where(model_spec))
        plan = load_plan(path, cluster)
        validate_plan(plan, model, cluster)
        est = estimate(plan, model, cluster, default_params())
        assert est.fits and est.iteration_time_s > 0, f"{rel}: does not fit"
        return plan
    if top == "traces" and path.suffix in (".csv", ".json"):
        from hetplan.spot.traces import load_trace

        return load_trace(str(path))
    if top == "runs" and path.suffix in (".csv", ".yaml"):
        runs = load_runs(path)
        assert runs
        return runs
    pytest.fail(f"no loader for examples/{rel}: document its format in docs/ and load it here")


def test_there_are_examples_of_every_format() -> None:
    tops = {p.relative_to(EXAMPLES).parts[0] for p in FILES}
    assert {"clusters", "markets", "runs", "profiles", "plans", "models", "traces"} <= tops
    runs = {p.name for p in FILES if p.parent.name == "runs"}
    assert {"generic.csv", "megatron.csv", "amp.csv", "sailor.csv", "manifest.yaml"} <= runs


@pytest.mark.parametrize("path", FILES, ids=[p.relative_to(EXAMPLES).as_posix() for p in FILES])
def test_example_loads(path: Path) -> None:
    assert _load(path) is not None


def test_every_plan_target_exists() -> None:
    for rel in PLAN_TARGETS:
        assert (EXAMPLES / rel).is_file(), rel
