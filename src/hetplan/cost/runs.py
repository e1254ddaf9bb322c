"""Measured training runs read from CSV: the shipped Megatron and AMP formats and a generic
one for users' own measurements (see ``hetplan.cost.calibrate`` for the formats)."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster, cluster_from_dict
from hetplan.cost.estimate_result import Estimate
from hetplan.errors import InputError, invalid_yaml, shown
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage
from hetplan.search.layout import uniform_plan

METRICS = ("iter_time_s", "tflops_per_gpu", "hardware_tflops_per_gpu")


@dataclass(frozen=True)
class Knobs:
    """What a row fixes and what it leaves to the search (micro-batch, virtual stages)."""

    tp: int
    pp: int
    dp: int
    global_batch: int
    precision: str
    flash_attention: bool
    recompute: tuple[str, ...]
    zero_stages: tuple[int, ...]
    sequence_parallel: bool
    schedules: tuple[str, ...]
    overlap_grad_reduce: bool
    """Megatron-Core's communication overlap (gradient reduction and TP collectives)."""


@dataclass(frozen=True)
class Run:
    """One measured training run: what ran, where, and what was measured."""

    source: str
    """The file (or set) the row came from; reports are grouped by it."""
    label: str
    model: ModelSpec
    cluster: Cluster
    metric: str
    """Which estimate field ``measured`` is: one of METRICS."""
    measured: float | None
    """None when the run did not fit in memory."""
    plan: Plan | None = None
    knobs: Knobs | None = None
    """Set when the plan is to be completed by the search (``plan`` is then None)."""
    measured_peak_bytes: float | None = None
    """The peak memory one GPU of the run measured, where the source gives it."""

    def predict(self, est: Estimate) -> float:
        """Returns the estimate's value of this run's metric."""
        if self.metric == "iter_time_s":
            return est.iteration_time_s
        if self.metric == "tflops_per_gpu":
            return est.tflops_per_gpu
        return est.hardware_tflops_per_gpu


# ---- reading ---------------------------------------------------------------------------


class _Row:
    """One CSV row with typed, column-naming accessors."""

    def __init__(self, data: dict[str, str], where: str) -> None:
        self.data = data
        self.where = where

    def text(self, column: str, default: str | None = None) -> str:
        value = (self.data.get(column) or "").strip()
        if not value:
            if default is None:
                raise InputError(column, f"{self.where}: required, but blank")
            return default
        return value

    def integer(self, column: str, default: int | None = None) -> int:
        raw = self.text(column, None if default is None else str(default))
        try:
            value = int(raw)
        except ValueError:
            raise InputError(
                column, f"{self.where}: expected an integer, got {shown(raw)}"
            ) from None
        if value <= 0:
            raise InputError(column, f"{self.where}: must be positive, got {value}")
        return value

    def count(self, column: str, default: int) -> int:
        """Returns a column's integer that may be 0 (a ZeRO stage), ``default`` if blank."""
        raw = self.text(column, str(default))
        if not raw.isdigit():
            raise InputError(column, f"{self.where}: expected a whole number, got {shown(raw)}")
        return int(raw)

    def number(self, column: str, required: bool = True) -> float | None:
        raw = (self.data.get(column) or "").strip()
        if not raw:
            if required:
                raise InputError(column, f"{self.where}: required, but blank")
            return None
        try:
            value = float(raw)
        except ValueError:
            raise InputError(column, f"{self.where}: expected a number, got {shown(raw)}") from None
        if not value > 0:
            raise InputError(column, f"{self.where}: must be positive, got {value}")
        return value

    def flag(self, column: str, default: bool) -> bool:
        raw = self.text(column, "true" if default else "false").lower()
        if raw not in ("true", "false", "1", "0", "yes", "no"):
            raise InputError(column, f"{self.where}: expected true or false, got {shown(raw)}")
        return raw in ("true", "1", "yes")


def _cluster(
    gpu: str, nodes: int, gpus_per_node: int, network: str | None = None, intra: str | None = None
) -> Cluster:
    entry: dict[str, Any] = {"gpu": gpu, "gpus": gpus_per_node, "count": nodes}
    if network is not None:
        entry["network_bandwidth"] = network
    if intra is not None:
        entry["intra_node_bandwidth"] = intra
    return cluster_from_dict({"nodes": [entry]})


def _megatron_run(row: _Row, source: str) -> Run:
    hidden = row.integer("hidden")
    layers = row.integer("layers")
    heads = row.integer("heads", hidden // 128)  # the paper's usual head width, 128
    model = ModelSpec(
        row.text("model"), "gpt", layers, hidden, heads, heads, 4 * hidden,
        row.integer("vocab"), row.integer("seq_len"),
    )  # fmt: skip
    n_gpus = row.integer("n_gpus")
    tp, pp, dp = row.integer("tp"), row.integer("pp"), row.integer("dp")
    if tp * pp * dp != n_gpus:
        raise InputError("n_gpus", f"{row.where}: tp*pp*dp = {tp * pp * dp}, not {n_gpus}")
    gpu = row.text("gpu").split()[0]
    gpn = 8  # DGX nodes
    cluster = _cluster(gpu, max(1, math.ceil(n_gpus / gpn)), min(gpn, n_gpus))
    precision = "bf16" if "bf16" in row.text("precision").lower() else "fp16"
    interleaved = ("Interleaved1F1B",) if pp > 1 else ("1F1B",)
    if row.text("system").startswith("Megatron-LM"):
        # SC'21: full recomputation, fp16, no flash attention; FLOPs count the recompute
        metric = "hardware_tflops_per_gpu"
        knobs = Knobs(tp, pp, dp, row.integer("global_batch_seqs"), precision, False,
                      ("full",), (0,), False, interleaved, False)  # fmt: skip
    else:
        # Megatron-Core: flash attention (TE), distributed optimizer, sequence parallel;
        # no recomputation unless the memory model says it does not fit without it
        metric = "tflops_per_gpu"
        knobs = Knobs(tp, pp, dp, row.integer("global_batch_seqs"), precision, True,
                      ("none", "selective"), (1,) if dp > 1 else (0,), tp > 1,
                      ("1F1B", "Interleaved1F1B"), True)  # fmt: skip
    mb = row.data.get("micro_batch", "").strip()
    plan = None
    if mb:
        plan = uniform_plan(cluster, layers, tp, pp, dp, row.integer("micro_batch"),
                            knobs.global_batch, precision=precision,
                            recompute=knobs.recompute[0], zero_stage=knobs.zero_stages[0],
                            schedule="1F1B", flash_attention=knobs.flash_attention,
                            sequence_parallel=knobs.sequence_parallel,
                            overlap_grad_reduce=metric == "tflops_per_gpu")  # fmt: skip
    value = row.number("tflops_per_gpu")
    return Run(source, model.name, model, cluster, metric, value, plan, None if plan else knobs)


_AMP_UNITS = 30  # 0 embedding, 1 no-op, 2..25 the 24 layers, 26..29 norm, no-ops, head


def _amp_stage_layers(row: _Row, layers: int) -> list[int]:
    raw = row.text("layer_partition")
    try:
        cuts = [int(x) for x in raw.split(";")]
    except ValueError:
        raise InputError(
            "layer_partition", f"{row.where}: expected 0;..;30, got {shown(raw)}"
        ) from None
    if cuts[0] != 0 or cuts[-1] != _AMP_UNITS or cuts != sorted(cuts) or layers != 24:
        raise InputError("layer_partition", f"{row.where}: not a 30-unit partition: {shown(raw)}")
    return [len(set(range(a, b)) & set(range(2, 26))) for a, b in pairwise(cuts)]


def _amp_run(row: _Row, source: str) -> Run:
    import re

    text = row.text("model")
    shape = {k: int(v) for v, k in re.findall(r"(\d+)\s*(layers|hidden|seq|vocab)", text)}
    shape.update({k: int(v) for k, v in re.findall(r"(hidden|seq|vocab)\s+(\d+)", text)})
    if set(shape) != {"layers", "hidden", "seq", "vocab"}:
        raise InputError(
            "model", f"{row.where}: cannot read layers/hidden/seq/vocab in {shown(text)}"
        )
    h = shape["hidden"]
    model = ModelSpec("GPT-2 (AMP)", "gpt", shape["layers"], h, h // 64, h // 64, 4 * h,
                      shape["vocab"], shape["seq"], tie_embeddings=True)  # fmt: skip
    tp, pp, dp = row.integer("tp"), row.integer("pp"), row.integer("dp")
    split = _amp_stage_layers(row, model.layers)
    if len(split) != pp:
        raise InputError("layer_partition", f"{row.where}: {len(split)} stages, but pp = {pp}")
    # the links as the source describes its cluster ("50 Gbps PCIe intra, 50 Gbps inter")
    links = dict((k, v) for v, k in re.findall(r"(\d+)\s*Gbps\s*(?:PCIe\s*)?(intra|inter)",
                                               row.text("cluster")))  # fmt: skip
    cluster = _cluster("T4", 4, 4, f"{links.get('inter', '50')} Gbit/s",
                       f"{links['intra']} Gbit/s" if "intra" in links else None)  # fmt: skip
    gb, mb = row.integer("global_batch"), row.integer("micro_batch")
    base = uniform_plan(cluster, model.layers, tp, pp, dp, mb, gb, precision="fp16",
                        recompute="none", schedule="1F1B", flash_attention=False,
                        overlap_grad_reduce=False)  # fmt: skip
    pipes = tuple(
        Pipeline(
            p.batch_size, tuple(Stage(n, s.devices) for n, s in zip(split, p.stages, strict=True))
        )
        for p in base.pipelines
    )
    plan = replace(base, pipelines=pipes)
    label = f"mb{mb} tp{tp} dp{dp} pp{pp}"
    return Run(source, label, model, cluster, "iter_time_s",
               row.number("measured_iter_s", required=False), plan)  # fmt: skip


def _generic_run(row: _Row, source: str) -> Run:
    h, heads = row.integer("hidden"), row.integer("heads")
    family = row.text("family", "gpt")
    model = ModelSpec(
        row.text("label", "model"), family, row.integer("layers"), h, heads,  # type: ignore[arg-type]
        row.integer("kv_heads", heads), row.integer("ffn"), row.integer("vocab"),
        row.integer("seq"), uses_dropout=row.flag("dropout", family == "gpt"),
    )  # fmt: skip
    net = row.data.get("network_gbit_s", "").strip()
    cluster = _cluster(row.text("gpu"), row.integer("nodes"), row.integer("gpus_per_node"),
                       f"{net} Gbit/s" if net else None)  # fmt: skip
    zero = row.count("zero_stage", 0)
    tp, pp, dp = row.integer("tp"), row.integer("pp"), row.integer("dp")
    if tp * pp * dp != cluster.num_gpus:
        raise InputError(
            "dp",
            f"{row.where}: tp x pp x dp = {tp * pp * dp}, but the run's nodes x "
            f"gpus_per_node = {cluster.num_gpus} (a run uses all its GPUs)",
        )
    precision, recompute = row.text("precision", "bf16"), row.text("recompute", "none")
    flash, sp = row.flag("flash_attention", True), row.flag("sequence_parallel", False)
    schedule = (row.data.get("schedule") or "").strip()
    plan, knobs = None, None
    if (row.data.get("micro_batch") or "").strip():
        plan = uniform_plan(
            cluster, model.layers, tp, pp, dp, row.integer("micro_batch"),
            row.integer("global_batch"), precision=precision, recompute=recompute,
            schedule=schedule or "1F1B", virtual_stages=row.integer("virtual_stages", 1),
            flash_attention=flash, zero_stage=zero, sequence_parallel=sp,
        )  # fmt: skip
    else:
        # the source does not say: the search picks the micro-batch (and, with no schedule
        # given, plain or interleaved 1F1B and the chunk count), as for the Megatron rows
        if schedule:
            schedules: tuple[str, ...] = (schedule,)
        else:
            schedules = ("1F1B", "Interleaved1F1B") if pp > 1 else ("1F1B",)
        knobs = Knobs(tp, pp, dp, row.integer("global_batch"), precision, flash, (recompute,),
                      (zero,), sp, schedules, False)  # fmt: skip
    if (row.data.get("iter_time_s") or "").strip():
        metric, value = "iter_time_s", row.number("iter_time_s")
    elif (row.data.get("tflops_per_gpu") or "").strip():
        metric, value = "tflops_per_gpu", row.number("tflops_per_gpu")
    else:
        raise InputError("iter_time_s", f"{row.where}: give iter_time_s or tflops_per_gpu")
    return Run(source, model.name, model, cluster, metric, value, plan, knobs)


_SAILOR_MODEL = "opt-350m"
"""The catalog model of Sailor's OPT-350 runs (24 x 1024, 16 heads, seq 2048, ReLU MLP)."""


def _sailor_run(row: _Row, source: str) -> Run:
    from hetplan.model import load_model

    # Sailor's OPT layers (Megatron-DeepSpeed megatron/model/opt_model.py at the data's
    # commit) apply no dropout: the attention probabilities go to the value matmul as the
    # softmax leaves them, the residual dropouts are commented out, the embedding adds none
    model = replace(load_model(_SAILOR_MODEL), uses_dropout=False)
    nodes, gpn = row.integer("nodes"), row.integer("gpus_per_node")
    tp, pp, dp = row.integer("tp"), row.integer("pp"), row.integer("dp")
    raw = row.text("layers_per_stage")
    try:
        split = [int(x) for x in raw.split("/")]
    except ValueError:
        raise InputError(
            "layers_per_stage", f"{row.where}: expected 4/7/7/6, got {shown(raw)}"
        ) from None
    if len(split) != pp or sum(split) != model.layers:
        raise InputError("layers_per_stage", f"{row.where}: {shown(raw)} is not {pp} stages of "
                         f"{model.layers} layers")  # fmt: skip
    cluster = _cluster(row.text("gpu_type"), nodes, gpn)
    # fp32 training in an NGC container: matmuls on TF32 tensor cores (see the data README);
    # DeepSpeed's engine reduces gradients after the backward pass, without overlap
    base = uniform_plan(cluster, model.layers, tp, pp, dp, row.integer("mbs"), row.integer("gbs"),
                        precision=row.text("precision", "tf32"), recompute="none",
                        schedule="1F1B", flash_attention=False,
                        overlap_grad_reduce=False)  # fmt: skip
    pipes = tuple(
        Pipeline(
            p.batch_size, tuple(Stage(n, s.devices) for n, s in zip(split, p.stages, strict=True))
        )
        for p in base.pipelines
    )
    return Run(source, row.text("plan"), model, cluster, "iter_time_s",
               row.number("measured_s"), replace(base, pipelines=pipes),
               measured_peak_bytes=row.number("max_mem_bytes", required=False))  # fmt: skip


def _manifest_runs(path: Path) -> list[Run]:
    """Returns the runs of a YAML/JSON manifest: plan files (any asymmetric plan) with the
    model, the cluster and the measured iteration time."""
    import yaml

    from hetplan.cluster import load_cluster
    from hetplan.model import load_model
    from hetplan.plan import load_plan, model_for_plan, validate_plan

    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise InputError("--runs", f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise InputError("--runs", invalid_yaml(path.name, exc)) from None
    items = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(items, list) or not items:
        raise InputError("runs", f"{path.name}: expected a non-empty list under 'runs'")
    out = []
    for i, item in enumerate(items):
        where = f"runs[{i}]"
        if not isinstance(item, dict):
            raise InputError(where, "must be a mapping")
        for key in ("plan", "model", "cluster", "measured_iter_s"):
            if key not in item:
                raise InputError(f"{where}.{key}", "required")
        model = load_model(str(item["model"]), item.get("seq_len"))
        cl_spec = str(item["cluster"])
        cl_path = path.parent / cl_spec
        cluster = load_cluster(str(cl_path) if cl_path.exists() else cl_spec)
        plan_path = path.parent / str(item["plan"])
        plan = load_plan(plan_path, option=f"{where}.plan")
        model = model_for_plan(plan, model, item.get("seq_len"))
        validate_plan(plan, model, cluster)
        value = item["measured_iter_s"]
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise InputError(
                f"{where}.measured_iter_s", f"must be a positive number: {shown(value)}"
            )
        out.append(Run(path.name, str(item.get("label", plan_path.stem)), model, cluster,
                       "iter_time_s", None if value is None else float(value), plan))  # fmt: skip
    return out


_ROW_COLUMNS = {
    "nodes[0].gpu": "gpu",
    "nodes[0].count": "nodes",
    "nodes[0].gpus": "gpus_per_node",
    "nodes[0].network_bandwidth": "network_gbit_s",
}
"""The cluster-file fields a row's columns become, back to the columns."""


def _parsed(parse: Callable[[_Row, str], Run], row: _Row, source: str) -> Run:
    """Returns ``parse(row)``; an error raised where the row's values were checked as a
    model, a cluster or a plan (fields such as ``model.heads``) names the column and line."""
    try:
        return parse(row, source)
    except InputError as exc:
        if row.where in exc.reason:
            raise
        column = _ROW_COLUMNS.get(exc.field, exc.field.removeprefix("model."))
        raise InputError(column, f"{row.where}: {exc.reason}") from None


def load_runs(path: Path) -> list[Run]:
    """Returns the runs of a file: a CSV in any of the formats of the module doc (Megatron,
    AMP, Sailor's measured plans, generic), or a YAML/JSON manifest of plan files."""
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        return _manifest_runs(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InputError("--runs", f"cannot read {path}: {exc.strerror}") from None
    reader = csv.DictReader(text.splitlines())
    header = set(reader.fieldnames or [])
    if {"system", "tflops_per_gpu", "n_gpus"} <= header:
        parse = _megatron_run
    elif {"layer_partition", "measured_iter_s"} <= header:
        parse = _amp_run
    elif {"layers_per_stage", "measured_s", "gpu_type"} <= header:
        parse = _sailor_run
    else:
        # micro_batch may be left out as it may be left blank: the search picks it
        need = ["layers", "hidden", "heads", "ffn", "vocab", "seq", "gpu", "nodes",
                "gpus_per_node", "tp", "pp", "dp", "global_batch"]  # fmt: skip
        missing = [c for c in need if c not in header]
        if missing:
            raise InputError(missing[0], f"{path.name}: missing column (generic format)")
        parse = _generic_run
    runs = [_parsed(parse, _Row(r, f"{path.name} line {i + 2}"), path.name)
            for i, r in enumerate(reader)]  # fmt: skip
    if not runs:
        raise InputError("--runs", f"{path} has no rows")
    return runs


# ---- predicting ------------------------------------------------------------------------
