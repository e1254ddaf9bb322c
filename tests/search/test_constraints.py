"""Constraints on the search: parsing, and their semantics against brute force (the best
plan under a constraint is the best of the unconstrained candidates that satisfy it; the
predicates here are written out, not taken from ``PlanConstraints``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.errors import InputError
from hetplan.model import ModelSpec, load_model
from hetplan.search.constraints import (
    PlanConstraints,
    constraints_from_options,
    homogeneous_space,
    parse_ints,
)
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous


def test_parse_values_lists_and_ranges():
    assert parse_ints("--tp", "8") == (8,)
    assert parse_ints("--tp", "4,1,2,4") == (1, 2, 4)
    assert parse_ints("--pp", "2..5") == (2, 3, 4, 5)
    assert parse_ints("--pp", "1,4..6") == (1, 4, 5, 6)
    assert parse_ints("--zero-stage", "0..1", lowest=0) == (0, 1)
    assert parse_ints("--tp", None) is None
    for bad in ("x", "4..2", "0", "2..", ""):
        with pytest.raises(InputError) as info:
            parse_ints("--tp", bad)
        assert info.value.field == "--tp"


def test_named_options_and_headroom_are_checked():
    c = constraints_from_options(recompute="Full,none", schedule="interleaved1f1b")
    assert c.recompute == ("full", "none") and c.schedule == ("Interleaved1F1B",)
    with pytest.raises(InputError) as info:
        constraints_from_options(recompute="some")
    assert info.value.field == "--recompute"
    with pytest.raises(InputError) as info:
        constraints_from_options(memory_headroom=1.5)
    assert info.value.field == "--memory-headroom"
    with pytest.raises(InputError) as info:
        constraints_from_options(zero_stage="4")
    assert info.value.field == "--zero-stage"
    assert constraints_from_options(tp="2..8", sequence_parallel=False).described() == [
        "--tp 2..8",
        "--no-sequence-parallel",
    ]


def test_gpu_types_and_headroom_cut_the_cluster():
    cl = parse_inline_cluster("A100-80GB:2x8,T4:1x4")
    cut = PlanConstraints(gpu_types=("t4",), memory_headroom=0.25).apply_to_cluster(cl)
    assert [n.gpu.name for n in cut.nodes] == ["T4"]
    assert cut.nodes[0].gpu.memory_bytes == pytest.approx(0.75 * cl.nodes[-1].gpu.memory_bytes)
    with pytest.raises(InputError) as info:
        PlanConstraints(gpu_types=("H100-80GB",)).apply_to_cluster(cl)
    assert info.value.field == "--gpu-types" and "A100-80GB" in info.value.reason


HOMOGENEOUS = [
    # (constraints, the same constraint written out as a predicate on a plan)
    (PlanConstraints(tp=(2,)), lambda p: all(s.tp == 2 for q in p.pipelines for s in q.stages)),
    (PlanConstraints(pp=(2, 4)), lambda p: len(p.pipelines[0].stages) in (2, 4)),
    (PlanConstraints(dp=(1,)), lambda p: len(p.pipelines) == 1),
    (PlanConstraints(micro_batch=(1,)), lambda p: p.micro_batch_size == 1),
    (PlanConstraints(recompute=("full",)), lambda p: p.recompute == "full"),
    (PlanConstraints(zero_stage=(0,)), lambda p: p.zero_stage == 0),
    (PlanConstraints(schedule=("Interleaved1F1B",)), lambda p: p.schedule == "Interleaved1F1B"),
    (PlanConstraints(virtual_stages=(2,)), lambda p: p.virtual_stages == 2),
    (
        PlanConstraints(tp=(2,), sequence_parallel=False),
        lambda p: p.pipelines[0].stages[0].tp == 2 and not p.sequence_parallel,
    ),
    (
        PlanConstraints(tp=(1, 2), pp=(2,), recompute=("selective", "full")),
        lambda p: (
            p.pipelines[0].stages[0].tp in (1, 2)
            and len(p.pipelines[0].stages) == 2
            and p.recompute != "none"
        ),
    ),
]


@pytest.mark.parametrize(("limits", "holds"), HOMOGENEOUS)
def test_homogeneous_best_under_a_constraint_is_the_filtered_best(limits, holds):
    model = load_model("gpt3-1.3b", None)
    cl = parse_inline_cluster("V100-32GB:2x4")
    params = default_params()
    every = search_homogeneous(model, cl, 32, "fp16", 100_000, params)
    assert every.ranked and len(every.ranked) == every.fitting  # the whole space, ranked
    allowed = [(p, e) for p, e in every.ranked if holds(p)]
    assert allowed, "the case must leave some plans"
    assert not holds(every.ranked[0][0]), "the constraint must rule out the free best"
    got = search_homogeneous(model, cl, 32, "fp16", 1, params, space=homogeneous_space(limits))
    assert got.ranked
    plan, est = got.ranked[0]
    assert holds(plan)
    assert est.iteration_time_s == pytest.approx(allowed[0][1].iteration_time_s, rel=1e-12)


def test_gpipe_is_searched_when_asked():
    """GPipe holds every micro-batch's activations for 1F1B's bubble, so the searches try it
    only when --schedule names it (it was never tried: 'no plan satisfies --schedule
    GPipe'). Brute force: any GPipe plan that fits has a 1F1B twin that fits (it holds fewer
    activations), so the best GPipe plan is the best fitting GPipe twin of the whole
    ranked 1F1B space, each estimated."""
    from dataclasses import replace

    model = load_model("gpt3-1.3b", None)
    cl = parse_inline_cluster("V100-32GB:2x4")
    params = default_params()
    every = search_homogeneous(model, cl, 32, "fp16", 100_000, params)
    twins = []
    for plan, _ in every.ranked:
        if plan.schedule == "1F1B":
            est = estimate(replace(plan, schedule="GPipe"), model, cl, params)
            if est.fits:
                twins.append(est.iteration_time_s)
    assert twins
    space = homogeneous_space(PlanConstraints(schedule=("GPipe",)))
    got = search_homogeneous(model, cl, 32, "fp16", 1, params, space=space)
    assert got.ranked and got.ranked[0][0].schedule == "GPipe"
    assert got.ranked[0][1].iteration_time_s == pytest.approx(min(twins), rel=1e-12)
    # the heterogeneous search does not cover it: refused, not answered
    with pytest.raises(InputError) as info:
        search_heterogeneous(model, parse_inline_cluster("V100-32GB:1x4,T4:1x4"), 32, "fp16",
                             constraints=PlanConstraints(schedule=("GPipe",)))  # fmt: skip
    assert info.value.field == "--schedule"


def _exhaustive_module():
    path = Path(__file__).with_name("test_het_exhaustive.py")
    spec = importlib.util.spec_from_file_location("het_exhaustive", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


HETEROGENEOUS = [
    # (layers, hidden, seq, cluster, batch, constraints, predicate)
    (4, 4096, 1024, "L4:1x1,T4:2x1", 4, PlanConstraints(pp=(3,)),
     lambda p: all(len(q.stages) == 3 for q in p.pipelines)),
    (4, 1024, 512, "A100-40GB:1x2,V100-16GB:1x2", 4, PlanConstraints(micro_batch=(2,)),
     lambda p: p.micro_batch_size == 2),
    (4, 1024, 512, "A100-40GB:1x2,V100-16GB:1x2", 4,
     PlanConstraints(recompute=("full",), dp=(1,)),
     lambda p: p.recompute == "full" and len(p.pipelines) == 1),
]  # fmt: skip


@pytest.mark.parametrize(("layers", "hidden", "seq", "spec", "batch", "limits", "holds"),
                         HETEROGENEOUS)  # fmt: skip
def test_heterogeneous_best_under_a_constraint_is_the_exhaustive_filtered_best(
    layers, hidden, seq, spec, batch, limits, holds
):
    ex = _exhaustive_module()
    model = ModelSpec("tiny", "gpt", layers, hidden, 16, 16, 4 * hidden, 32000, seq)
    cluster = parse_inline_cluster(spec)
    params = default_params()
    best = ex.exhaustive(model, cluster, batch, "fp16", params, keep=holds).time_s
    assert best < float("inf")
    free = search_heterogeneous(model, cluster, batch, "fp16", 1, params)
    assert not holds(free.ranked[0][0]), "the constraint must rule out the free best"
    res = search_heterogeneous(model, cluster, batch, "fp16", 1, params, constraints=limits)
    assert res.ranked, res.notes
    plan, est = res.ranked[0]
    assert holds(plan)
    assert est.iteration_time_s <= best * (1 + 1e-9)
    # and it is one of the constrained plans, so it cannot beat their best either
    assert est.iteration_time_s >= best * (1 - 1e-9)


def test_cli_names_the_constraint_that_makes_a_request_infeasible():
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "-m", "gpt3-1.3b", "-c", "A100-80GB:2x8",
         "--tp", "3", "--recompute", "full"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp" in lines[0] and "Traceback" not in res.stderr
    # limits that cut the cluster (headroom, GPU types, GPU count) are relaxed on the whole
    # cluster: the headroom alone was once 'nor any of them relaxed alone'
    for extra, option in ((["--memory-headroom", "0.95"], "--memory-headroom"),
                          (["--max-gpus", "8", "--memory-headroom", "0.95"],
                           "--memory-headroom")):  # fmt: skip
        res = subprocess.run(
            [sys.executable, "-m", "hetplan", "plan", "-m", "gpt3-6.7b", "-c", "A100-80GB:2x8",
             *extra], capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == 2, res.stderr
        line = res.stderr.strip()
        assert line.startswith(f"error: {option}: no plan satisfies"), line
        assert "without it the best plan is" in line


def test_an_impossible_tensor_parallel_degree_says_why():
    # gpt3-6.7b: 32 heads, 32 key-value heads, an MLP of 16,384 (models.yaml); 3 divides
    # none of them, and a group of 16 needs more GPUs than a node of 8 holds
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "-m", "gpt3-6.7b", "-c", "A100-80GB:4x8",
         "--tp", "3,16"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().startswith(
        "error: --tp: no plan satisfies --tp 3,16 with the other constraints: TP 3 does not "
        "divide gpt3-6.7b's 32 attention heads or 32 key-value heads or 16,384 MLP width; "
        "TP 16 needs 16 GPUs in one node, and the largest has 8; without it the best plan is "
    ), res.stderr
    # a degree that could be, were it not for another limit, gets no such reason
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "plan", "-m", "gpt3-6.7b", "-c", "A100-80GB:4x8",
         "--tp", "8", "--pp", "64"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert ": TP" not in res.stderr and "no plan satisfies" in res.stderr


def test_impossible_pipeline_and_replica_counts_say_why():
    base = [sys.executable, "-m", "hetplan", "plan", "-m", "gpt3-6.7b", "-c", "A100-80GB:4x8"]
    for extra, expected in (
        (["--pp", "33"], "error: --pp: no plan satisfies --pp 33 with the other constraints: "
         "every stage the searches make holds a layer and a GPU, and gpt3-6.7b has 32 layers "
         "on 32 GPUs; without it"),
        (["--dp", "64"], "error: --dp: no plan satisfies --dp 64 with the other constraints: "
         "every replica needs a GPU, and there are 32 GPUs; without it"),
        # gpt3-6.7b's batch is 1024 sequences: neither 3 nor 5 divides it
        (["--micro-batch-size", "3,5"], "error: --micro-batch-size: no plan satisfies "
         "--micro-batch-size 3,5 with the other constraints: every replica runs whole "
         "micro-batches and the replicas' shares add up to the batch of 1024 sequences, which "
         "3 or 5 does not divide; without it"),
    ):  # fmt: skip
        res = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and res.stderr.startswith(expected), res.stderr


def test_provision_names_why_a_tensor_parallel_limit_is_impossible():
    # the small market's largest node has 8 GPUs (examples/markets/small.yaml)
    small = Path(__file__).parents[2] / "examples" / "markets" / "small.yaml"
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "provision", "-m", "gpt3-6.7b", "--tokens", "1e9",
         "--market", str(small), "--tp", "16"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "error: --tp: no configuration of the market has a plan that satisfies --tp 16: "
        "TP 16 needs 16 GPUs in one node, and the largest has 8"
    )
