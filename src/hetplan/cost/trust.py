"""Trust signals: what the measured runs behind the fitted terms cover, and the warnings
an estimate carries when it leaves that ground (never silent).

Coverage is recorded per GPU type by ``calibrate`` (``CostParams.fit_report["coverage"]``)
from the measured runs it fitted: the parallel degrees, ZeRO stages, precisions and
scale they span, and the MFU each reached (with its GPU count and precision), so a
prediction is held to the best measured at its own scale and precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetplan.cluster import Cluster
    from hetplan.cost.estimate_result import Estimate
    from hetplan.cost.params import CostParams
    from hetplan.plan import Plan


MFU_SLACK = 1.02
"""An MFU this much above the best measured one is flagged (2%: the spread of repeated
measurements of one run)."""


def plan_regime(plan: Plan) -> dict[str, Any]:
    """Returns the regime of a plan: its largest TP and PP, ZeRO stage, precision, GPUs."""
    return {
        "tp": max(s.tp for p in plan.pipelines for s in p.stages),
        "pp": max(len(p.stages) for p in plan.pipelines),
        "zero": plan.zero_stage,
        "precision": plan.precision,
        "gpus": len(plan.devices()),
    }


def add_coverage(cov: dict[str, Any], plan: Plan, measured_mfu: float) -> dict[str, Any]:
    """Returns ``cov`` (one GPU type's coverage) extended by a measured run of ``plan``."""
    r = plan_regime(plan)
    return {
        "tp": sorted(set(cov.get("tp", [])) | {r["tp"]}),
        "pp": sorted(set(cov.get("pp", [])) | {r["pp"]}),
        "zero": sorted(set(cov.get("zero", [])) | {r["zero"]}),
        "precision": sorted(set(cov.get("precision", [])) | {r["precision"]}),
        "max_gpus": max(cov.get("max_gpus", 0), r["gpus"]),
        "best_mfu": max(cov.get("best_mfu", 0.0), measured_mfu),
        "best_mfu_by_precision": {
            **cov.get("best_mfu_by_precision", {}),
            r["precision"]: max(
                cov.get("best_mfu_by_precision", {}).get(r["precision"], 0.0), measured_mfu
            ),
        },
        "mfu_points": sorted(
            [*cov.get("mfu_points", []), [r["gpus"], r["precision"], round(measured_mfu, 4)]]
        ),
        "runs": cov.get("runs", 0) + 1,
    }


def warnings_for(plan: Plan, est: Estimate, cluster: Cluster, params: CostParams) -> list[str]:
    """Returns why ``est`` deserves less trust: uncalibrated GPU types, a regime no measured
    run covers, an MFU above the best measured."""
    out: list[str] = []
    coverage: dict[str, Any] = params.fit_report.get("coverage", {})
    regime = plan_regime(plan)
    distinct = est.distinct_stages  # every stage's GPU and source, repeated pipelines once
    gpus = {s.gpu for s in distinct}
    measured_gpus = {s.gpu for s in distinct if s.compute_source in ("measured", "interpolated")}
    best_any = max((c.get("best_mfu", 0.0) for c in coverage.values()), default=0.0)
    # a type taking another's fitted terms (the same chip: SAME_SILICON) is held to that
    # type's measured regime and MFU
    sources = {name: params.fitted_as(name) for name in gpus}
    held_to = {name: source or name for name, source in sources.items()}
    for name in sorted(gpus):
        source = sources[name]
        cov = coverage.get(name, coverage.get(held_to[name]))
        if name not in measured_gpus and source is None:
            out.append(
                f"{name} has no fitted parameters and no profile: default efficiencies "
                "(use hetplan calibrate or --profile)"
            )
        elif name not in measured_gpus and source != name and name not in coverage:
            out.append(
                f"{name} takes the fitted efficiencies of {source} (the same chip at the same "
                f"clocks); no measured run on {name} itself"
            )
        if cov is None:
            continue
        gaps = []
        if regime["tp"] > max(cov["tp"]):
            gaps.append(f"TP {regime['tp']} (runs reach TP {max(cov['tp'])})")
        if regime["pp"] > max(cov["pp"]):
            gaps.append(f"PP {regime['pp']} (runs reach PP {max(cov['pp'])})")
        if regime["zero"] not in cov["zero"]:
            stages = ", ".join(str(z) for z in cov["zero"])
            gaps.append(f"ZeRO-{regime['zero']} (runs use ZeRO {stages})")
        if _peak_class(regime["precision"]) not in {_peak_class(x) for x in cov["precision"]}:
            gaps.append(f"{regime['precision']} (runs use {', '.join(cov['precision'])})")
        if regime["gpus"] > 2 * cov["max_gpus"]:
            gaps.append(f"{regime['gpus']} GPUs (runs reach {cov['max_gpus']})")
        if gaps:
            out.append(f"outside the calibrated regime of {name}: " + "; ".join(gaps))
    # the best measured at the plan's precision where runs used it, else at any precision;
    # at the plan's scale where runs reached it (small jobs run at MFUs large ones never do)
    prec, n = plan.precision, regime["gpus"]
    best = max((_best_mfu(coverage[held_to[g]], prec, n) for g in gpus
                if held_to[g] in coverage), default=best_any)  # fmt: skip
    if best > 0 and est.mfu > best * MFU_SLACK:
        out.append(
            f"predicted MFU {est.mfu:.2f} is above the best measured on these GPUs at this "
            f"scale and precision ({best:.2f}): treat as optimistic"
        )
    return out


SCALE_FACTOR = 4
"""Measured runs with at least 1/SCALE_FACTOR of a plan's GPUs count as its scale."""


def _best_mfu(cov: dict[str, Any], precision: str, gpus: int) -> float:
    """Returns the best measured MFU a plan of ``gpus`` GPUs at ``precision`` is held to."""
    points = [(g, p, m) for g, p, m in cov.get("mfu_points", []) if g * SCALE_FACTOR >= gpus]
    if points:
        same = [m for _, p, m in points if _peak_class(p) == _peak_class(precision)]
        return max(same or [m for _, _, m in points])
    by_precision: dict[str, float] = cov.get("best_mfu_by_precision", {})
    pooled = [m for p, m in by_precision.items() if _peak_class(p) == _peak_class(precision)]
    return max(pooled) if pooled else cov.get("best_mfu", 0.0)


def _peak_class(precision: str) -> str:
    """fp16 and bf16 run on the same tensor cores at the same peak: one class for MFU."""
    return "16-bit" if precision in ("fp16", "bf16") else precision
