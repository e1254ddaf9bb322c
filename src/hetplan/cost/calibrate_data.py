"""The measured runs as the fit reads them: the shipped calibration files, each run's plan
completed by the homogeneous search where its source leaves knobs out (``resolve``), its
prediction, the GPU types a run uses, the groups of GPU types that mixed-cluster runs link,
and the job a run is an alternative for."""

from __future__ import annotations

from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams
from hetplan.cost.runs import Run
from hetplan.errors import InputError


def resolve(run: Run, params: CostParams) -> Run:
    """Returns ``run`` with its plan completed by the homogeneous search (if it had knobs)."""
    if run.knobs is None:
        return run
    from hetplan.search.homogeneous import search_homogeneous
    from hetplan.search.homogeneous_candidates import SearchSpace

    k = run.knobs
    space = SearchSpace(
        recompute=k.recompute, zero_stages=k.zero_stages, sequence_parallel=(k.sequence_parallel,),
        tp=(k.tp,), pp=(k.pp,), dp=(k.dp,), schedules=k.schedules,
        # Megatron-Core overlaps both the gradient reduction and the TP collectives
        overlap_grad_reduce=k.overlap_grad_reduce, overlap_tp_comm=k.overlap_grad_reduce,
    )  # fmt: skip
    found = search_homogeneous(run.model, run.cluster, k.global_batch, k.precision, top_k=1,
                               params=params, space=space,
                               flash_attention=k.flash_attention)  # fmt: skip
    if not found.ranked:
        raise InputError(
            "tp", f"{run.label}: no plan with tp={k.tp} pp={k.pp} dp={k.dp} fits in memory"
        )
    return replace(run, plan=found.ranked[0][0], knobs=None)


def predict(run: Run, params: CostParams) -> tuple[float, bool]:
    """Returns the predicted value of the run's metric and whether the plan fits in memory."""
    run = resolve(run, params)
    assert run.plan is not None
    est = estimate(run.plan, run.model, run.cluster, params, validate=False)
    return run.predict(est), est.fits


def gpus_of(run: Run) -> frozenset[str]:
    """Returns the GPU types a run uses (its plan's devices; its cluster's without a plan)."""
    if run.plan is not None:
        return frozenset(run.cluster.device_node(d).gpu.name for d in run.plan.devices())
    return frozenset(n.gpu.name for n in run.cluster.nodes)


def components(runs: list[Run]) -> list[tuple[tuple[str, ...], list[Run]]]:
    """Returns groups of GPU types linked by runs that use several of them (a mixed
    cluster's run constrains every type it uses), each with the runs touching it."""
    groups: list[set[str]] = []
    for run in runs:
        gpus = set(gpus_of(run))
        linked = [g for g in groups if g & gpus]
        for g in linked:
            groups.remove(g)
            gpus |= g
        groups.append(gpus)
    out = []
    for g in sorted(groups, key=sorted):
        out.append((tuple(sorted(g)), [r for r in runs if gpus_of(r) & g]))
    return out


def group_key(run: Run) -> tuple[Any, ...]:
    """Runs that are alternatives for one job: same model, GPUs, batch and metric."""
    k = run.knobs
    batch = run.plan.global_batch_size if run.plan is not None else k.global_batch if k else 0
    return (run.model.name, run.cluster.num_gpus, batch, run.metric)


def shipped_files() -> list[Path]:
    """Returns the paths of the calibration CSVs shipped with the package."""
    root = Path(str(resources.files("hetplan.data").joinpath("calibration")))
    names = (
        "megatron_homogeneous.csv",
        "megatron_selective_published.csv",
        "amp_t4_homogeneous.csv",
        "sharded_dp_published.csv",
        "bloom_published.csv",
        "nemo_gpt3_175b_published.csv",
        "megatron_v100_published.csv",
    )
    return [root / name for name in names]
