"""The profile's measurements beyond layers (embedding, head, optimizer, gloo links, TP
collectives, pipelining overhead): stored, returned, and used by estimate."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from hetplan.cluster import load_cluster
from hetplan.cost import comm
from hetplan.cost.compute import LayerTimes
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.measured.profile_db import ProfileDB
from hetplan.model import load_model
from hetplan.plan import load_plan
from hetplan.runtime.profile import profile_model
from hetplan.runtime.profile_links import fit_alpha_beta, ring_figures

PP2 = [(8, [(1, [0]), (3, [1])])]
DP2 = [(4, [(4, [0])]), (4, [(4, [1])])]
TP2 = [(8, [(4, [0, 1])])]


def test_db_stores_and_returns_measurements(inputs: dict[str, Path], tmp_path: Path) -> None:
    model = load_model(str(inputs["llama"]))
    gpu = load_cluster(str(inputs["cluster"])).nodes[0].gpu
    db = ProfileDB(tmp_path / "p.sqlite")
    assert db.part_times(gpu, model, "head", 1, 2, "fp32") is None
    assert db.optimizer_step_s(gpu, model, "layer", 1, "fp32") is None
    assert db.link_figures(gpu, "p2p") is None
    db.put_part("cpu", model, "head", 1, 2, "fp32", LayerTimes(0.5, 1.5, 0.0))
    db.put_part("cpu", model, "tp_comm", 2, 2, "fp32", LayerTimes(0.25, 0.75, 0.0))
    db.put_optimizer("cpu", model, "layer", 2, "fp32", 0.125, 1000)
    db.put_link("cpu", "p2p", 1e-4, 2e9)
    again = ProfileDB(tmp_path / "p.sqlite")  # a new connection reads what was stored
    assert again.part_times(gpu, model, "head", 1, 2, "fp32") == LayerTimes(0.5, 1.5, 0.0)
    assert again.part_times(gpu, model, "tp_comm", 2, 2, "fp32") == LayerTimes(0.25, 0.75, 0.0)
    assert again.part_times(gpu, model, "head", 1, 4, "fp32") is None
    assert again.optimizer_step_s(gpu, model, "layer", 2, "fp32") == 0.125
    assert again.optimizer_step_s(gpu, model, "layer", 1, "fp32") is None
    assert again.link_figures(gpu, "p2p") == (1e-4, 2e9)
    # the head depends on the vocabulary, a layer's collectives do not
    other = replace(model, vocab=model.vocab * 2)
    assert again.part_times(gpu, other, "head", 1, 2, "fp32") is None
    assert again.part_times(gpu, other, "tp_comm", 2, 2, "fp32") is not None
    with pytest.raises(ValueError):
        db.put_link("cpu", "nvlink", 1.0, 1.0)
    with pytest.raises(ValueError):
        db.put_part("cpu", model, "layer", 1, 2, "fp32", LayerTimes(1.0, 1.0, 0.0))


def test_fit_alpha_beta_recovers_a_line() -> None:
    sizes = [1e3, 1e4, 1e5, 1e6]
    lat, rate = fit_alpha_beta(sizes, [2e-5 + s / 5e8 for s in sizes])
    assert lat == pytest.approx(2e-5, rel=1e-6)
    assert rate == pytest.approx(5e8, rel=1e-6)


@pytest.fixture(scope="module")
def profiled(inputs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Returns a database with this CPU's single-process profile of the tiny Llama."""
    path = tmp_path_factory.mktemp("prof") / "p.sqlite"
    model = load_model(str(inputs["llama"]))
    profile_model(ProfileDB(path), "cpu", model, [2], [1, 2], torch.device("cpu"), reps=5)
    return path


def test_estimate_uses_embedding_head_and_optimizer(
    inputs: dict[str, Path], profiled: Path, tmp_path: Path, write_plan: Any
) -> None:
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    gpu = cluster.nodes[0].gpu
    db = ProfileDB(profiled)
    layer = db.lookup("cpu", model, 1, 2, "fp32")
    embed = db.part_times(gpu, model, "embed", 1, 2, "fp32")
    head = db.part_times(gpu, model, "head", 1, 2, "fp32")
    opt = {p: db.optimizer_step_s(gpu, model, p, 1, "fp32") for p in ("layer", "embed", "head")}
    assert layer and embed and head and all(t is not None and t > 0 for t in opt.values())
    assert head.forward_s > 0 and head.backward_s > 0 and embed.backward_s > 0
    est = estimate(load_plan(write_plan(tmp_path / "p.json", PP2)), model, cluster, profile=db)
    assert est.compute_source == "measured"
    first, last = est.stages
    # each action also carries half the fitted fixed cost per micro-batch (overhead_s)
    assert first.forward_s - first.overhead_s / 2 == pytest.approx(
        layer.forward_s + embed.forward_s
    )
    assert last.backward_s - last.overhead_s / 2 == pytest.approx(
        3 * layer.backward_s + head.backward_s
    )
    assert first.optimizer_s == pytest.approx(opt["layer"] + opt["embed"])  # type: ignore[operator]
    assert last.optimizer_s == pytest.approx(3 * opt["layer"] + opt["head"])  # type: ignore[operator]


def test_estimate_uses_links_and_pipeline_overhead(
    inputs: dict[str, Path], profiled: Path, tmp_path: Path, write_plan: Any
) -> None:
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    node = cluster.nodes[0]
    shutil.copy(profiled, tmp_path / "p.sqlite")
    db = ProfileDB(tmp_path / "p.sqlite")
    pp_plan = load_plan(write_plan(tmp_path / "pp.json", PP2))
    before = estimate(pp_plan, model, cluster, profile=db)
    analytical_send = comm.p2p_s(2 * model.seq * model.hidden * 4, node, node, default_params())
    assert before.stages[0].send_s == pytest.approx(analytical_send)
    db.put_link("cpu", "p2p", 0.01, 1e8)
    db.put_link("cpu", "allreduce", 0.002, 5e7)
    db.put_link("cpu", "pipeline", 0.003, 0.0)
    db.put_link("cpu", "scalar", 0.0005, 0.0)
    db.put_part("cpu", model, "tp_comm", 2, 2, "fp32", LayerTimes(0.004, 0.006, 0.0))
    pp = estimate(pp_plan, model, cluster, profile=db)
    act = 2 * model.seq * model.hidden * 4
    assert pp.stages[0].send_s == pytest.approx(0.01 + act / 1e8)
    assert pp.stages[0].forward_s == pytest.approx(before.stages[0].forward_s + 0.003)
    assert pp.stages[1].backward_s == pytest.approx(before.stages[1].backward_s + 0.003)
    dp = estimate(load_plan(write_plan(tmp_path / "dp.json", DP2)), model, cluster, profile=db)
    grads = model.total_params() * 4.0  # untied: every parameter's gradient, summed once
    assert dp.stages[0].grad_sync_s == pytest.approx(grads / 5e7 + 2 * 0.002)
    # gradient norm and loss: two all-reduces of one number, 2 tree steps each among 2
    assert dp.breakdown["step_collectives_s"] == pytest.approx(2 * 2 * 0.0005)
    tp = estimate(load_plan(write_plan(tmp_path / "tp.json", TP2)), model, cluster, profile=db)
    assert tp.stages[0].tp_comm_s == pytest.approx(4 * (0.004 + 0.006))
    assert tp.compute_source == "measured"
    # sequence parallelism: its own measured collectives where profiled, else the plain ones
    sp_plan = load_plan(write_plan(tmp_path / "sp.json", TP2, sequence_parallel=True))
    sp = estimate(sp_plan, model, cluster, profile=db)
    assert sp.stages[0].tp_comm_s == pytest.approx(4 * (0.004 + 0.006))
    db.put_part("cpu", model, "tp_comm_sp", 2, 2, "fp32", LayerTimes(0.007, 0.008, 0.0))
    sp = estimate(sp_plan, model, cluster, profile=ProfileDB(tmp_path / "p.sqlite"))
    assert sp.stages[0].tp_comm_s == pytest.approx(4 * (0.007 + 0.008))


def test_zero1_sync_is_a_reduce_scatter_and_an_all_gather(
    inputs: dict[str, Path], profiled: Path, tmp_path: Path, write_plan: Any
) -> None:
    """ZeRO-1's step: a reduce-scatter of fp32 gradients and an all-gather of fp16
    parameters, each half a ring all-reduce of its bytes (2 members: one ring step each),
    or the profile's own figures of each kind where it has them."""
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    shutil.copy(profiled, tmp_path / "p.sqlite")
    db = ProfileDB(tmp_path / "p.sqlite")
    db.put_link("cpu", "allreduce", 0.002, 5e7)
    path = write_plan(tmp_path / "z1.json", DP2, zero_stage=1, precision="fp16")
    plan = load_plan(path)
    p = model.total_params()  # untied: every parameter once
    est = estimate(plan, model, cluster, profile=ProfileDB(tmp_path / "p.sqlite"))
    # reduce-scatter: 4p/2 bytes sent; all-gather: 2p/2; a 0.002 s ring step each
    assert est.stages[0].grad_sync_s == pytest.approx(2 * p / 5e7 + p / 5e7 + 2 * 0.002)
    db.put_link("cpu", "reduce_scatter", 0.003, 4e7)
    db.put_link("cpu", "allgather", 0.001, 1e8)
    est = estimate(plan, model, cluster, profile=ProfileDB(tmp_path / "p.sqlite"))
    assert est.stages[0].grad_sync_s == pytest.approx(0.003 + 2 * p / 4e7 + 0.001 + p / 1e8)


def test_estimate_uses_measured_zero3_layers(
    inputs: dict[str, Path], profiled: Path, tmp_path: Path, write_plan: Any
) -> None:
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    shutil.copy(profiled, tmp_path / "p.sqlite")
    plan = load_plan(write_plan(tmp_path / "z3.json", DP2, zero_stage=3))
    per_mb = []
    for f, b in ((0.001, 0.002), (0.003, 0.006)):
        db = ProfileDB(tmp_path / "p.sqlite")
        db.put_part("cpu", model, "zero3_comm_dp2", 1, 2, "fp32", LayerTimes(f, b, 0.0))
        est = estimate(plan, model, cluster, profile=ProfileDB(tmp_path / "p.sqlite"))
        per_mb.append(est.stages[0].zero_comm_s)
    # 4 layers, each micro-batch: their measured gathers and reduce-scatters as they ran
    assert per_mb[1] - per_mb[0] == pytest.approx(4 * (0.009 - 0.003))
    assert per_mb[0] >= 4 * 0.003


def test_deferred_zero3_syncs_each_measured_layer_once_a_step(
    inputs: dict[str, Path], profiled: Path, tmp_path: Path, write_plan: Any
) -> None:
    """Replicas of 1 and 3 micro-batches run ZeRO-3 deferred (``deferred_sync``): each layer
    gathered and reduce-scattered once a step by FSDP, as the measured layer's backward
    runs them (one gather, one reduce-scatter); embedding and head as ZeRO-1."""
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    shutil.copy(profiled, tmp_path / "p.sqlite")
    db = ProfileDB(tmp_path / "p.sqlite")
    db.put_link("cpu", "reduce_scatter", 0.003, 4e7)
    db.put_link("cpu", "allgather", 0.001, 1e8)
    db.put_part("cpu", model, "zero3_comm_dp2", 1, 2, "fp32", LayerTimes(0.001, 0.002, 0.0))
    uneven = [(2, [(4, [0])]), (6, [(4, [1])])]
    plan = load_plan(write_plan(tmp_path / "z3.json", uneven, zero_stage=3))
    est = estimate(plan, model, cluster, profile=ProfileDB(tmp_path / "p.sqlite"))
    edge = model.embedding_params() + model.head_params()
    # 2 members: one ring step each, half the bytes; fp32 gradients and parameters
    want = 4 * 0.002 + (0.003 + 4 * edge / 2 / 4e7) + (0.001 + 4 * edge / 2 / 1e8)
    for st in est.stages:
        assert st.zero_comm_s == 0.0
        assert st.grad_sync_s == pytest.approx(want)


@pytest.mark.slow
def test_profile_with_links_measures_gloo(
    inputs: dict[str, Path], tmp_path: Path, write_plan: Any
) -> None:
    model = load_model(str(inputs["llama"]))
    cluster = load_cluster(str(inputs["cluster"]))
    gpu = cluster.nodes[0].gpu
    db = ProfileDB(tmp_path / "p.sqlite")
    recs = profile_model(db, "cpu", model, [2], [1, 2], torch.device("cpu"), reps=3, links=True)
    assert [(r.tp, r.micro_batch) for r in recs] == [(1, 2), (2, 2)]
    assert all(r.times.forward_s > 0 and r.times.backward_s > 0 for r in recs)
    for kind in ("p2p", "allreduce"):
        figures = db.link_figures(gpu, kind)
        assert figures is not None and figures[0] >= 0 and figures[1] > 0
    over = db.link_figures(gpu, "pipeline")
    assert over is not None and over[0] >= 0
    for kind in ("allgather", "reduce_scatter"):  # ZeRO's collectives as the runtime runs them
        figures = db.link_figures(gpu, kind)
        assert figures is not None and figures[0] >= 0 and figures[1] > 0
    assert db.part_times(gpu, model, "tp_comm", 2, 2, "fp32") is not None
    assert db.part_times(gpu, model, "tp_comm", 1, 2, "fp32") is None  # no collectives
    assert db.part_times(gpu, model, "tp_comm_sp", 2, 2, "fp32") is not None
    zero3 = db.part_times(gpu, model, "zero3_comm_dp2", 1, 2, "fp32")
    assert zero3 is not None and zero3.forward_s + zero3.backward_s > 0
    assert db.optimizer_step_s(gpu, model, "layer", 2, "fp32") is not None
    est = estimate(load_plan(write_plan(tmp_path / "dp.json", DP2)), model, cluster, profile=db)
    ring = db.link_figures(gpu, "allreduce")
    assert ring is not None
    grads = model.total_params() * 4.0
    assert est.stages[0].grad_sync_s == pytest.approx(grads / ring[1] + 2 * ring[0])
    # the all-reduce of one number, per tree step: 2 processes take 2 steps, twice a step
    one = db.link_figures(gpu, "scalar")
    assert one is not None and one[0] > 0 and one[1] == 0.0
    assert est.breakdown["step_collectives_s"] == pytest.approx(2 * 2 * one[0])


def test_stored_ring_figures_price_the_measured_line(inputs: dict[str, Path], tmp_path: Path):
    """A collective measured among the profile's ranks as latency + bytes / rate is priced
    at exactly that again for a group of that size (4 devices here)."""
    node = load_cluster(str(inputs["cluster"])).nodes[0]
    db = ProfileDB(tmp_path / "p.sqlite")
    # 4 ranks: all-reduce 2*3 steps moving 6/4 of the buffer; all-gather 3 steps, 3/4
    db.put_link("cpu", "allreduce", *ring_figures(1e-3, 1e8, 6, 1.5))
    db.put_link("cpu", "allgather", *ring_figures(2e-3, 5e7, 3, 0.75))
    db.put_link("cpu", "reduce_scatter", *ring_figures(4e-3, 2e7, 3, 0.75))
    params = default_params().with_profile(db)
    size = 4e6
    assert comm.intra_node_allreduce_s(size, 4, node, params) == pytest.approx(1e-3 + 0.04)
    assert comm.group_allgather_s(size, [node] * 4, params) == pytest.approx(2e-3 + 0.08)
    assert comm.group_reduce_scatter_s(size, [node] * 4, params) == pytest.approx(4e-3 + 0.2)
