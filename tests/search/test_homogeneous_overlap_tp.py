"""``--overlap-tp-comm`` for the searches: plans that overlap TP collectives with the matmuls.

The hidden share is checked by hand arithmetic on a one-node, two-GPU case; the searches'
best plans under the flag against an enumeration written here from the homogeneous search's
documented space (not its enumerator), every plan scored by ``estimate`` with the flag."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from typer.testing import CliRunner

from hetplan.cli import app
from hetplan.cluster import Cluster, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage, validate_plan
from hetplan.search.constraints import (
    PlanConstraints,
    constraints_from_options,
    homogeneous_space,
)
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.homogeneous_candidates import SearchSpace

TINY = ModelSpec("gpt-2L-1024", "gpt", 2, 1024, 16, 16, 4096, 50257, 2048)


def _tp2_plan(sp: bool, overlap: bool) -> Plan:
    """TP 2 on one node of two A100s, one stage, one replica, micro-batch 1, 4 micro-batches."""
    return Plan(
        global_batch_size=4,
        micro_batch_size=1,
        pipelines=(Pipeline(4, (Stage(2, ("a100-80gb-0:0", "a100-80gb-0:1")),)),),
        precision="bf16",
        sequence_parallel=sp,
        overlap_tp_comm=overlap,
    )


def test_overlap_hides_the_fitted_share_of_tp_collectives_by_hand():
    cluster = parse_inline_cluster("A100-80GB:1x2")
    params = default_params()
    node = cluster.nodes[0]
    share = params.gpu("A100-80GB").tp_overlap
    assert 0 < share < 1  # the case exercises a partial overlap
    # by hand: one micro-batch's activations, 1 x 2048 x 1024 x 2 bytes; a ring all-reduce
    # of two GPUs sends 2 (n-1)/n = 1 times the message and takes 2 (n-1) = 2 latency steps;
    # per micro-batch 4 all-reduces a layer (2 forward, 2 backward) x 2 layers, plus the
    # embedding's and the head's: 10
    message = 1 * 2048 * 1024 * 2
    one = message / (node.intra_node_bytes_per_s * params.link_efficiency_of("A100-80GB"))
    one += 2 * params.intra_latency_of("A100-80GB")
    tp_comm = 10 * one
    off = estimate(_tp2_plan(True, False), TINY, cluster, params)
    on = estimate(_tp2_plan(True, True), TINY, cluster, params)
    st_off, st_on = off.distinct_stages[0], on.distinct_stages[0]
    assert math.isclose(st_off.tp_comm_s, tp_comm, rel_tol=1e-9)
    compute = st_off.forward_s + st_off.backward_s + st_off.recompute_s
    assert share * tp_comm < compute  # hidden under compute: the cap does not bind
    # one stage, one replica: the iteration is 4 micro-batches back to back, then the
    # optimizer step; overlap hides share x tp_comm of each micro-batch
    hidden = 4 * share * tp_comm
    assert math.isclose(off.iteration_time_s - on.iteration_time_s, hidden, rel_tol=1e-9)
    assert math.isclose(st_on.tp_comm_s, (1 - share) * tp_comm, rel_tol=1e-9)
    # without sequence parallelism nothing is hidden (Megatron-Core requires it)
    plain_off = estimate(_tp2_plan(False, False), TINY, cluster, params)
    plain_on = estimate(_tp2_plan(False, True), TINY, cluster, params)
    assert plain_on.iteration_time_s == plain_off.iteration_time_s


# ------------------------------------------------------------------ independent enumeration


def _megatron(cluster: Cluster, tp: int, pp: int, dp: int, mb: int, batch: int,
              **knobs: object) -> Plan:  # fmt: skip
    """Rank (stage x dp + replica) x tp + t is the rank-th device in node order; layers
    split evenly (the tiny models below divide)."""
    devs = [f"{n.name}:{i}" for n in cluster.nodes for i in range(n.gpus)]
    per = TINY8.layers // pp
    pipes = []
    for r in range(dp):
        stages = tuple(
            Stage(per, tuple(devs[(s * dp + r) * tp + t] for t in range(tp))) for s in range(pp)
        )
        pipes.append(Pipeline(batch // dp, stages))
    return Plan(global_batch_size=batch, micro_batch_size=mb, pipelines=tuple(pipes),
                **knobs)  # type: ignore[arg-type]  # fmt: skip


TINY8 = ModelSpec("gpt-8L-2048", "gpt", 8, 2048, 16, 16, 8192, 50257, 2048)
"""Eight layers: every PP degree of four GPUs splits them evenly, and into two equal chunks
(no lightened layouts, whose chunks this enumeration does not build)."""


def _brute(cluster: Cluster, batch: int, overlap: bool) -> tuple[float, Plan | None]:
    """Returns the least estimate() time, with the flag, of every plan of the homogeneous
    space (SearchSpace docs: TP in the node, PP, DP, micro-batch, recomputation, ZeRO 0-3,
    ZeRO only with two replicas, ZeRO-2/3 only without pipelining, 1F1B and interleaving
    with 2 chunks where micro-batches are a multiple of PP, SP only with TP > 1)."""
    params = default_params()
    n = cluster.num_gpus
    best_s, best = math.inf, None
    for tp in (1, 2, 4):
        for pp in (1, 2, 4):
            if n % (tp * pp):
                continue
            dp = n // (tp * pp)
            for mb in (d for d in range(1, batch // dp + 1) if (batch // dp) % d == 0):
                m = batch // dp // mb
                scheds = [("1F1B", 1)] + ([("Interleaved1F1B", 2)] if pp > 1 and m % pp == 0
                                          else [])  # fmt: skip
                for rc in ("none", "selective", "full"):
                    for z in (0, 1, 2, 3):
                        if (z and dp == 1) or (z >= 2 and pp > 1):
                            continue
                        for sched, v in scheds:
                            for sp in (False, True):
                                if sp and tp == 1:
                                    continue
                                plan = _megatron(
                                    cluster, tp, pp, dp, mb, batch, precision="bf16",
                                    recompute=rc, zero_stage=z, schedule=sched,
                                    virtual_stages=v, sequence_parallel=sp,
                                    overlap_tp_comm=overlap,
                                )  # fmt: skip
                                try:
                                    validate_plan(plan, TINY8, cluster)
                                except InputError:
                                    continue
                                est = estimate(plan, TINY8, cluster, params, validate=False)
                                if est.fits and est.iteration_time_s < best_s:
                                    best_s, best = est.iteration_time_s, plan
    return best_s, best


def test_homogeneous_search_with_overlap_is_the_exhaustive_best():
    cluster = parse_inline_cluster("A100-80GB:1x4")
    space = SearchSpace(max_virtual_stages=2, overlap_tp_comm=True)
    res = search_homogeneous(TINY8, cluster, 2, "bf16", 1, space=space)
    plan, est = res.ranked[0]
    assert plan.overlap_tp_comm
    brute_s, brute = _brute(cluster, 2, True)
    assert brute is not None
    assert math.isclose(est.iteration_time_s, brute_s, rel_tol=1e-9)
    assert brute.pipelines[0].stages[0].tp == 2 and brute.sequence_parallel
    # the flag matters here: the exhaustive best without it is slower
    off_s, _ = _brute(cluster, 2, False)
    assert off_s > brute_s


def test_constraints_carry_the_flag_to_every_search():
    limits = constraints_from_options(overlap_tp_comm=True)
    assert limits.described() == ["--overlap-tp-comm"]
    assert limits.violation(_tp2_plan(True, False)) == "--overlap-tp-comm"
    assert PlanConstraints().violation(_tp2_plan(True, True)) == "--overlap-tp-comm"
    # homogeneous and provisioning searches take it through their search space
    assert homogeneous_space(limits).overlap_tp_comm
    # heterogeneous: two GPU types; its best under the flag is no slower than the best it
    # finds without the flag, re-estimated with it (that plan is in its space)
    cluster = parse_inline_cluster("A100-80GB:1x2,A100-40GB:1x2")
    params = default_params()
    on = search_heterogeneous(TINY8, cluster, 8, "bf16", 3, params, True, limits)
    off = search_heterogeneous(TINY8, cluster, 8, "bf16", 1, params, True, PlanConstraints())
    assert on.ranked and off.ranked
    for plan, est in on.ranked:
        assert plan.overlap_tp_comm
        assert estimate(plan, TINY8, cluster, params).iteration_time_s == est.iteration_time_s
    moved = estimate(replace(off.ranked[0][0], overlap_tp_comm=True), TINY8, cluster, params)
    assert on.ranked[0][1].iteration_time_s <= moved.iteration_time_s * (1 + 1e-9)


def test_plan_cli_writes_the_flag_and_says_it(tmp_path):
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(app, ["plan", "--model", "gpt3-1.3b", "--cluster",
                                   "A100-80GB:1x8", "--global-batch-size", "32",
                                   "--overlap-tp-comm", "--json", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["constraints"] == ["--overlap-tp-comm"]
    assert all(p["plan"]["overlap_tp_comm"] for p in data["plans"])
    assert json.loads(out.read_text())["overlap_tp_comm"] is True
    base = ["plan", "--model", "gpt3-1.3b", "--cluster", "A100-80GB:1x8"]
    res = CliRunner().invoke(app, [*base, "--global-batch-size", "32", "--json"])
    data = json.loads(res.output)
    assert data["constraints"] == []
    assert not any(p["plan"]["overlap_tp_comm"] for p in data["plans"])
