"""V100 from published measurements: Megatron-LM v1.0's weak model-parallel scaling on a
DGX-2H (NVIDIA ADLR, 2020, Table 1), the 1.2B and 4.2B rows
(data/calibration/megatron_v100_published.csv, shapes from Shoeybi et al. 2019, Table 1)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from hetplan.cost.calibrate_data import predict, shipped_files
from hetplan.cost.calibrate_fit import fit
from hetplan.cost.params import CostParams, load_params
from hetplan.cost.runs import load_runs

CSV = next(p for p in shipped_files() if p.name == "megatron_v100_published.csv")

# the blog's table, transcribed a second time: billions of parameters -> (GPUs, ms)
TABLE_1 = {1.2: (1, 1288), 4.2: (4, 1357)}


def test_rows_match_the_table_and_the_shapes_give_the_sizes_named():
    with Path(CSV).open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(TABLE_1)
    for row in rows:
        layers, h, v, s = (int(row[k]) for k in ("layers", "hidden", "vocab", "seq"))
        # weights: 12 l h^2 (attention 4 h^2, MLP 8 h^2) plus the token and position tables
        billions = (12 * layers * h * h + v * h + s * h) / 1e9
        gpus, ms = TABLE_1[round(billions, 1)]
        assert int(row["tp"]) == gpus and int(row["gpus_per_node"]) == gpus
        assert float(row["iter_time_s"]) == ms / 1000
        assert int(row["global_batch"]) == 8 and int(row["heads"]) * 96 == h  # 96 a head
        assert float(row["tokens_per_s_per_gpu"]) == pytest.approx(8 * 1024 / (ms / 1000) / gpus,
                                                                  abs=0.05)  # fmt: skip


def test_shipped_terms_predict_both_rows_within_five_percent():
    runs = load_runs(Path(CSV))
    params = load_params(None)
    for run in runs:
        value, fits = predict(run, params)
        assert fits
        assert value == pytest.approx(run.measured, rel=0.05)


def test_tensor_parallel_row_held_out_of_a_one_gpu_fit():
    """Fitted on the one-GPU row alone (the other terms at their priors), the 4-way tensor
    parallel row is predicted within 10%: its TP collectives and smaller matmuls are not
    in the fit."""
    one, four = load_runs(Path(CSV))
    params = fit([one], CostParams())
    value, _ = predict(four, params)
    assert value == pytest.approx(four.measured, rel=0.10)


def test_the_16gb_v100_takes_the_32gb_fit():
    """Same chip at the same clocks (SXM2 GV100): the 16 GB V100 takes the 32 GB one's fitted
    efficiencies, so one plan on either predicts the same time, and no warning says it runs on
    defaults; an unfitted type of another chip still does."""
    from hetplan.cluster import parse_inline_cluster
    from hetplan.cost.estimate import estimate
    from hetplan.cost.trust import warnings_for
    from hetplan.model import ModelSpec
    from hetplan.search.layout import uniform_plan

    params = load_params(None)
    assert params.fitted("V100-16GB") and params.gpu("V100-16GB") == params.gpu("V100-32GB")
    assert not params.fitted("L4") and params.gpu("L4") == params.default
    model = ModelSpec("m", "gpt", 8, 1024, 16, 16, 4096, 51200, 1024)
    times = {}
    for gpu in ("V100-16GB", "V100-32GB", "L4"):
        cluster = parse_inline_cluster(f"{gpu}:1x4")
        plan = uniform_plan(cluster, model.layers, 1, 1, 4, 2, 16, precision="fp16")
        est = estimate(plan, model, cluster, params)
        times[gpu] = est.iteration_time_s
        default = any("no fitted parameters" in w for w in warnings_for(plan, est, cluster, params))
        assert default == (gpu == "L4")
    assert times["V100-16GB"] == pytest.approx(times["V100-32GB"], rel=1e-9)
