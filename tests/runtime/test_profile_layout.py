"""Profile database and estimate hook; plan-to-rank layout (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hetplan.cluster import load_cluster
from hetplan.cost.estimate import estimate
from hetplan.measured.profile_db import ProfileDB
from hetplan.model import load_model
from hetplan.plan import load_plan
from hetplan.runtime.layout import EMBED_TOK, build_layout, layer_unit
from hetplan.runtime.profile import profile_model

ASYMMETRIC = [(2, [(4, [0])]), (6, [(1, [1]), (3, [2])])]


def test_profile_feeds_estimate(inputs: dict[str, Path], tmp_path: Path, write_plan: Any) -> None:
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    plan = load_plan(write_plan(tmp_path / "p.json", ASYMMETRIC))
    db = ProfileDB(tmp_path / "prof.sqlite")
    assert estimate(plan, model, cluster, profile=db).compute_source == "analytical"
    recs = profile_model(db, "cpu", model, [2], [1, 2], torch.device("cpu"), reps=5)
    assert [(r.tp, r.micro_batch) for r in recs] == [(1, 2), (2, 2)]
    assert all(r.times.forward_s > 0 and r.times.backward_s > 0 for r in recs)
    assert recs[0].activation_bytes > recs[1].activation_bytes > 0
    est = estimate(plan, model, cluster, profile=ProfileDB(tmp_path / "prof.sqlite"))
    assert est.compute_source == "measured"
    one = db.lookup("cpu", model, 1, 2, "fp32")
    assert one is not None
    stage = next(s for s in est.stages if s.pipeline == 0)
    assert stage.forward_s >= 4 * one.forward_s  # 4 measured layers plus embedding and head
    assert db.lookup("cpu", model, 1, 4, "fp32") is None  # not profiled: analytical
    assert db.lookup("cpu", model, 1, 2, "bf16") is None


def test_layout_of_asymmetric_plan(
    inputs: dict[str, Path], tmp_path: Path, write_plan: Any
) -> None:
    model = load_model(str(inputs["gpt"]))  # tied embeddings
    cluster = load_cluster(str(inputs["cluster"]))
    plan = load_plan(write_plan(tmp_path / "p.json", ASYMMETRIC))
    lay = build_layout(plan, model, cluster)
    assert [p.device for p in lay.places] == ["host:0", "host:1", "host:2"]
    assert [(p.replica, p.stage, p.batch_offset, p.micro_batches) for p in lay.places] == [
        (0, 0, 0, 1),
        (1, 0, 2, 3),
        (1, 1, 2, 3),
    ]
    assert lay.places[2].chunks[0].start == 1 and lay.places[2].chunks[0].end == 4
    groups = {g.ranks: set(g.units) for g in lay.sync_groups}
    assert groups[(0, 1)] >= {layer_unit(0)}
    assert groups[(0, 2)] >= {layer_unit(1), layer_unit(3), "head"}
    # the tied token table is summed over replica 0 and both ends of replica 1
    assert EMBED_TOK in groups[(0, 1, 2)]
    assert json.dumps([list(g) for g in lay.all_groups()])
