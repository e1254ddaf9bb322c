"""A plan predicted from an imported profile equals the hand-computed replay of its measured
layer times plus the modelled transfer between its two stages."""

import json
from pathlib import Path

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.measured.csv_import import read_profile_csv
from hetplan.measured.importers import parse_bindings, write_db
from hetplan.model import load_model
from hetplan.search.layout import uniform_plan

PROFILE = """gpu,model,tp,micro_batch,precision,part,forward_s,backward_s,step_s
A100-80GB,tiny,1,1,bf16,layer,0.010,0.020,0.0005
A100-80GB,tiny,1,1,bf16,embed,0.001,0.002,0.0001
A100-80GB,tiny,1,1,bf16,head,0.003,0.004,0.0002
"""


def test_two_stage_pipeline_from_an_imported_csv(tmp_path: Path) -> None:
    config = tmp_path / "tiny" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128,
                                  "n_positions": 32}))  # fmt: skip
    csv = tmp_path / "profile.csv"
    csv.write_text(PROFILE)
    db = write_db(tmp_path / "p.sqlite", read_profile_csv(csv, parse_bindings([f"tiny={config}"])))
    model = load_model(str(config))
    cluster = parse_inline_cluster("A100-80GB:1x2")
    # no fitted overheads: the times are the profile's and the link's, nothing else
    params = CostParams(gpus={"A100-80GB": GPUEfficiency(microbatch_overhead_s=0.0,
                                                         p2p_exposed=0.0)})  # fmt: skip
    plan = uniform_plan(cluster, 2, 1, 2, 1, 1, 2, precision="bf16")  # pp 2, 2 micro-batches
    est = estimate(plan, model, cluster, params.with_profile(db))

    # by hand: stage 0 = embedding + 1 layer, stage 1 = 1 layer + head
    f0, b0 = 0.010 + 0.001, 0.020 + 0.002
    f1, b1 = 0.010 + 0.003, 0.020 + 0.004
    # one micro-batch's activations (1 x 32 tokens x 64 x 2 bytes) over NVLink (300 GB/s at
    # the default link efficiency 0.8) plus the intra-node latency (10 us)
    s = 1 * 32 * 64 * 2 / (300e9 * 0.8) + 10e-6
    # 1F1B, p = 2, m = 2: stage 0 runs F0 F1 B0 B1, stage 1 runs F0 B0 F1 B1
    s0_f0 = f0
    s0_f1 = 2 * f0
    s1_f0 = s0_f0 + s + f1
    s1_b0 = s1_f0 + b1
    s0_b0 = max(s0_f1, s1_b0 + s) + b0
    s1_f1 = max(s1_b0, s0_f1 + s) + f1
    s1_b1 = s1_f1 + b1
    s0_b1 = max(s0_b0, s1_b1 + s) + b0
    # optimizer steps as measured, per piece; no data parallelism, so no gradient sync
    # each step all-reduces the gradient norm and the loss over both devices: two steps of
    # a tree at the intra-node latency each
    scalars = 2 * 2 * 10e-6
    end0 = s0_b1 + 0.0005 + 0.0001 + scalars
    end1 = s1_b1 + 0.0005 + 0.0002 + scalars
    assert est.iteration_time_s == pytest.approx(max(end0, end1), rel=1e-9)
    assert est.compute_source == "measured"
    assert [st.compute_source for st in est.stages] == ["measured", "measured"]
