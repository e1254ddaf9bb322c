"""Fitting the cost model's efficiency parameters to measured runs, and its honest error.

Three CSV formats are read (the format is recognised from the header):

- ``megatron``: the columns of ``megatron_homogeneous.csv`` (published Megatron runs);
- ``amp``: the columns of ``amp_t4_homogeneous.csv`` (AMP's timed T4 trials, with the
  30-unit ``layer_partition``; blank ``measured_iter_s`` = the plan ran out of memory);
- ``generic`` (for users): ``layers, hidden, heads, ffn, vocab, seq, gpu, nodes,
  gpus_per_node, tp, pp, dp, micro_batch, global_batch`` and one measured column,
  ``iter_time_s`` or ``tflops_per_gpu`` (model FLOPs); optional ``kv_heads`` (= heads),
  ``family`` (gpt), ``precision`` (bf16), ``recompute`` (none), ``schedule`` (1F1B),
  ``virtual_stages`` (1), ``flash_attention`` (true), ``sequence_parallel`` (false),
  ``zero_stage`` (0), ``network_gbit_s`` (the GPU type's default), ``label``. A blank
  ``micro_batch`` leaves it to the search (and, with a blank ``schedule``, plain or
  interleaved 1F1B), for sources that do not state them.

Each row becomes a :class:`Run`: model, cluster, a plan (or the knobs the search must
choose, when the source leaves them out) and the measured value. Parameters are fitted
with bounded ``scipy.optimize.least_squares`` on log(predicted / measured), with a weak
pull towards physically plausible priors so that few rows cannot drive them to a bound.

The parts, one job each: ``calibrate_data`` (the runs as the fit reads them: shipped files,
plans completed by the search, GPU types and jobs), ``calibrate_terms`` (the fitted terms:
units, bounds, priors, packing, report), ``calibrate_fit`` (the fit and the memory
reserve) and ``calibrate_report`` (in-sample and cold leave-one-out errors). This module
fits and reports in one call (``calibrate_runs``) and keeps their public names importable
from ``hetplan.cost.calibrate``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hetplan.cost.calibrate_data import predict, resolve, shipped_files
from hetplan.cost.calibrate_fit import fit, fit_reserve_bytes, memory_slack_bytes
from hetplan.cost.calibrate_report import first_pick, in_sample, leave_one_out
from hetplan.cost.calibrate_terms import MEASURED_BOUNDS, TERMS, Term, terms_report
from hetplan.cost.params import CostParams
from hetplan.cost.runs import METRICS, Knobs, Run, load_runs

__all__ = [
    "MEASURED_BOUNDS",
    "METRICS",
    "TERMS",
    "Knobs",
    "Run",
    "Term",
    "calibrate_runs",
    "first_pick",
    "fit",
    "fit_reserve_bytes",
    "in_sample",
    "leave_one_out",
    "load_runs",
    "memory_slack_bytes",
    "predict",
    "resolve",
    "shipped_files",
    "terms_report",
]


def calibrate_runs(
    runs: list[Run], start: CostParams | None = None, workers: int | None = None
) -> tuple[CostParams, dict[str, Any]]:
    """Returns parameters fitted to ``runs`` (their ``fit_report`` set: fitted terms and the
    cold leave-one-out summary per file) and the LOO report."""
    params = fit(runs, start)
    report = leave_one_out(runs, params, workers, start)
    summary = {src: {k: v for k, v in r.items() if k != "rows"} for src, r in report.items()}
    return replace(params, fit_report={**params.fit_report, "loo": summary}), report
