"""Plans: data-parallel pipelines, each with its own stages, batch share and devices.

A plan is asymmetric by construction; a Megatron-style plan is the special case where
every pipeline has the same stages on the same kind of devices.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster
from hetplan.cost.schedule import interleave_fits
from hetplan.errors import InputError, shown
from hetplan.model import ModelSpec

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
RECOMPUTE = ("none", "selective", "full")
PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
"""Precisions as the hardware runs them: fp32 (strict, CUDA cores), tf32 (fp32 storage, matmuls on
TF32 tensor cores), bf16 and fp16 (mixed precision: fp32 master weights and Adam states)."""


def element_bytes(precision: str) -> int:
    """Returns the bytes of one stored weight, activation or gradient element at ``precision``."""
    return 4 if precision in ("fp32", "tf32") else 2


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: ``layers`` transformer layers on a tensor-parallel group."""

    layers: int
    devices: tuple[str, ...]
    """The tensor-parallel group: devices of one node (one GPU type)."""
    chunks: tuple[int, ...] | None = None
    """Layers of each model chunk (Interleaved1F1B), in chunk order, summing to ``layers``;
    None: ``layers`` split evenly over the plan's virtual stages."""

    @property
    def tp(self) -> int:
        """Returns the stage's tensor-parallel degree."""
        return len(self.devices)

    def chunk_layers(self, v: int) -> tuple[int, ...]:
        """Returns the layers of each of the stage's ``v`` model chunks."""
        if self.chunks is not None:
            return self.chunks
        return (self.layers // v,) * v


@dataclass(frozen=True)
class Pipeline:
    """One data-parallel replica: its batch share and its stages, first to last."""

    batch_size: int
    stages: tuple[Stage, ...]

    def layer_ranges(self) -> list[tuple[int, int]]:
        """Returns [start, end) transformer-layer ranges per stage."""
        out, start = [], 0
        for stage in self.stages:
            out.append((start, start + stage.layers))
            start += stage.layers
        return out


@dataclass(frozen=True)
class Plan:
    """A full parallel plan for one training iteration."""

    global_batch_size: int
    micro_batch_size: int
    pipelines: tuple[Pipeline, ...]
    precision: str = "bf16"
    recompute: str = "none"
    zero_stage: int = 0
    schedule: str = "1F1B"
    virtual_stages: int = 1
    """Model chunks per stage (Interleaved1F1B); 1 otherwise."""
    sequence_parallel: bool = False
    flash_attention: bool = True
    overlap_grad_reduce: bool = True
    """Overlap the data-parallel gradient reduction with the last backward passes."""
    overlap_tp_comm: bool = False
    """Overlap tensor-parallel collectives with the neighbouring matmuls (Megatron-Core with
    Transformer Engine's userbuffers); only what exceeds the compute stays exposed."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    model: ModelSpec | None = field(default=None, compare=False)
    """The model the plan was made for, as the file states it (``plan``, ``provision`` and
    ``replan`` write it): a command reading the plan takes its sequence length unless given
    --seq-len (``model_for_plan``); a model of another shape is refused (``check_plan_model``).
    None: a file that does not say (every command then takes the model as given)."""

    @property
    def dp(self) -> int:
        """Returns the number of data-parallel replicas."""
        return len(self.pipelines)

    def devices(self) -> list[str]:
        """Returns every device the plan uses."""
        return [d for p in self.pipelines for s in p.stages for d in s.devices]

    def node_names(self) -> set[str]:
        """Returns the names of the nodes the plan's devices are on ('node:index')."""
        return {d.rpartition(":")[0] for d in self.devices()}

    def num_micro_batches(self, pipeline: Pipeline) -> int:
        """Returns the micro-batches one pipeline runs per iteration."""
        return pipeline.batch_size // self.micro_batch_size

    def is_uniform(self) -> bool:
        """Returns whether every pipeline has the same stage layout and batch share."""
        first = self.pipelines[0]
        v = self.virtual_stages
        shape = [(s.layers, s.tp, s.chunk_layers(v)) for s in first.stages]
        return all(
            p.batch_size == first.batch_size
            and [(s.layers, s.tp, s.chunk_layers(v)) for s in p.stages] == shape
            for p in self.pipelines
        )

    def to_dict(self, compact: bool = False) -> dict[str, Any]:
        """Returns the plan as the JSON-ready mapping of the plan file format; ``compact``:
        repeated pipelines as one entry each (``hetplan.plan_compact``)."""
        if compact:
            from hetplan.plan_compact import compact_dict

            return compact_dict(self)
        out = asdict(self)
        out.pop("extra")
        out.pop("model")
        if self.model is not None:
            out["model"] = model_dict(self.model)
        for pipe in out["pipelines"]:
            for stage in pipe["stages"]:
                stage["devices"] = list(stage["devices"])
                if stage["chunks"] is None:  # the even form, written as before
                    del stage["chunks"]
                else:
                    stage["chunks"] = list(stage["chunks"])
        if self.schedule != "Interleaved1F1B":
            out.pop("virtual_stages")
        return out

    def save(self, path: Path, compact: bool = True, option: str = "--out") -> None:
        """Writes the plan as JSON, whole or not at all (``outputs.write_text``: a path that
        cannot be written is an error naming ``option``); repeated pipelines in the compact
        form unless ``compact`` is False (every device listed)."""
        from hetplan.outputs import write_text

        write_text(path, json.dumps(self.to_dict(compact), indent=2) + "\n", option)


def _int(data: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = data.get(key, default)
    if value is None:
        raise InputError(f"{where}{key}", "required")
    if not isinstance(value, int) or isinstance(value, bool):
        raise InputError(f"{where}{key}", f"expected an integer, got {shown(value)}")
    return value


def _chunks(data: dict[str, Any], where: str) -> tuple[int, ...] | None:
    """Returns a stage's explicit per-chunk layer list, or None where it states none."""
    raw = data.get("chunks")
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{where}chunks", "must be a non-empty list of layer counts")
    for x in raw:
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            raise InputError(
                f"{where}chunks", f"layer counts must be integers >= 0, got {shown(x)}"
            )
    return tuple(raw)


MODEL_SHAPE = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
               "tie_embeddings")  # fmt: skip
"""The model fields a plan depends on besides its sequence length (which it may run at
another, given explicitly)."""


def model_dict(model: ModelSpec) -> dict[str, Any]:
    """Returns the plan file's ``model`` object: the model's name, shape and sequence length."""
    out: dict[str, Any] = {"name": model.name}
    out.update({k: getattr(model, k) for k in MODEL_SHAPE})
    if model.attn_head_dim:  # heads of another width than hidden / heads only
        out["head_dim"] = model.attn_head_dim
    out["seq_len"] = model.seq
    return out


def _parse_model(raw: Any) -> ModelSpec:
    """Returns the model a plan file's ``model`` object states (every field required)."""
    if not isinstance(raw, dict):
        raise InputError("model", "must be an object (name, shape and seq_len)")
    for key in ("name", *MODEL_SHAPE, "seq_len"):
        if key not in raw:
            raise InputError(f"model.{key}", "required")
    if not isinstance(raw["name"], str) or not raw["name"]:
        raise InputError("model.name", f"must be a non-empty string, got {shown(raw['name'])}")
    if raw["family"] not in ("gpt", "llama"):
        raise InputError("model.family", f"must be gpt or llama, got {shown(raw['family'])}")
    if not isinstance(raw["tie_embeddings"], bool):
        raise InputError("model.tie_embeddings", f"must be true or false, got "
                         f"{shown(raw['tie_embeddings'])}")  # fmt: skip
    seq = raw["seq_len"]  # (ModelSpec checks the other counts, under the same field names)
    if not isinstance(seq, int) or isinstance(seq, bool) or seq <= 0:
        raise InputError("model.seq_len", f"must be a positive integer, got {shown(seq)}")
    head_dim = raw.get("head_dim", 0)  # stated only where it is not hidden / heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 0:
        raise InputError("model.head_dim", f"must be a positive integer, got {shown(head_dim)}")
    return ModelSpec(raw["name"], raw["family"], raw["layers"], raw["hidden"], raw["heads"],
                     raw["kv_heads"], raw["ffn"], raw["vocab"], raw["seq_len"],
                     raw["tie_embeddings"], attn_head_dim=head_dim)  # fmt: skip


def model_for_plan(plan: Plan, model: ModelSpec, seq_len: int | None) -> ModelSpec:
    """Returns the model a command costs or runs ``plan`` with: ``model`` (the --model option,
    loaded with ``seq_len``, the --seq-len option) at the sequence length the plan was made
    for unless ``seq_len`` was given. A plan that states no model leaves ``model`` as it is.
    (A model of another shape is refused where the plan is checked: ``check_plan_model``.)"""
    if plan.model is None or seq_len is not None:
        return model
    return model.with_seq(plan.model.seq)


def check_model_shape(plan: Plan, model: ModelSpec) -> None:
    """Raises InputError (--model) unless ``model`` has the shape of the model the plan was
    made for (its name may differ: a config.json copied elsewhere is the same model)."""
    made = plan.model
    if made is None:
        return
    for key in (*MODEL_SHAPE, "head_dim"):
        want, got = getattr(made, key), getattr(model, key)
        if want != got:
            raise InputError(
                "--model",
                f"the plan was made for {made.name}, whose {key} is {shown(want)}; "
                f"{model.name}'s is {shown(got)}",
            )


def plan_from_dict(data: Any, cluster: Cluster | None = None) -> Plan:
    """Returns the Plan of a parsed plan file, checking its form (not the model); compact
    entries (a pipeline repeated over a node range) are expanded, and with ``cluster``
    their node ranges are checked against it."""
    if isinstance(data, dict) and isinstance(data.get("pipelines"), list):
        from hetplan.plan_compact import expand_pipelines, rename_field

        raw, origin = expand_pipelines(data["pipelines"], cluster)
        if raw is not data["pipelines"]:
            try:
                return _parse_plan({**data, "pipelines": raw})
            except InputError as exc:
                raise rename_field(exc, origin) from None
    return _parse_plan(data)


def _parse_plan(data: Any) -> Plan:
    """Returns the Plan of a parsed plan file in the explicit form, checking its form."""
    if not isinstance(data, dict):
        raise InputError("plan", "must be a JSON object")
    raw = data.get("pipelines")
    if not isinstance(raw, list) or not raw:
        raise InputError("pipelines", "required: a non-empty list")
    pipelines = []
    for i, pipe in enumerate(raw):
        where = f"pipelines[{i}]."
        if not isinstance(pipe, dict):
            raise InputError(f"pipelines[{i}]", "must be an object")
        stages_raw = pipe.get("stages")
        if not isinstance(stages_raw, list) or not stages_raw:
            raise InputError(f"{where}stages", "required: a non-empty list")
        stages = []
        for j, st in enumerate(stages_raw):
            swhere = f"{where}stages[{j}]."
            if not isinstance(st, dict):
                raise InputError(f"{where}stages[{j}]", "must be an object")
            devices = st.get("devices")
            if not isinstance(devices, list) or not devices:
                raise InputError(f"{swhere}devices", "required: a non-empty list of 'node:index'")
            if not all(isinstance(d, str) for d in devices):
                raise InputError(f"{swhere}devices", "device names must be strings")
            chunks = _chunks(st, swhere)
            layers = _int(st, "layers", swhere, sum(chunks) if chunks is not None else None)
            stages.append(Stage(layers, tuple(devices), chunks))
        pipelines.append(Pipeline(_int(pipe, "batch_size", where), tuple(stages)))
    known = {
        "global_batch_size",
        "micro_batch_size",
        "precision",
        "recompute",
        "zero_stage",
        "schedule",
        "virtual_stages",
        "sequence_parallel",
        "flash_attention",
        "overlap_grad_reduce",
        "overlap_tp_comm",
        "pipelines",
        "model",
    }
    extra = {k: v for k, v in data.items() if k not in known}
    plan = Plan(
        global_batch_size=_int(data, "global_batch_size", ""),
        micro_batch_size=_int(data, "micro_batch_size", "", 1),
        pipelines=tuple(pipelines),
        precision=str(data.get("precision", "bf16")),
        recompute=str(data.get("recompute", "none")),
        zero_stage=_int(data, "zero_stage", "", 0),
        schedule=str(data.get("schedule", "1F1B")),
        virtual_stages=_int(data, "virtual_stages", "", 1),
        sequence_parallel=bool(data.get("sequence_parallel", False)),
        flash_attention=bool(data.get("flash_attention", True)),
        overlap_grad_reduce=bool(data.get("overlap_grad_reduce", True)),
        overlap_tp_comm=bool(data.get("overlap_tp_comm", False)),
        extra=extra,
        model=None if data.get("model") is None else _parse_model(data["model"]),
    )
    check_plan_form(plan)
    return plan


def load_plan(path: Path, cluster: Cluster | None = None, option: str = "--plan") -> Plan:
    """Returns the Plan read from a JSON file (either form; ``cluster``: check compact
    entries' node ranges against it); ``option`` names the file in messages (a positional
    PLAN, a manifest's field)."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(option, f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InputError(
            option, f"{path} is not valid JSON: {exc.msg} (line {exc.lineno})"
        ) from None
    return plan_from_dict(data, cluster)


def check_plan_form(plan: Plan) -> None:
    """Raises InputError if the plan's own numbers are inconsistent."""
    if plan.precision not in PRECISIONS:
        raise InputError("precision", f"'{plan.precision}' is not one of {', '.join(PRECISIONS)}")
    if plan.recompute not in RECOMPUTE:
        raise InputError("recompute", f"'{plan.recompute}' is not one of {', '.join(RECOMPUTE)}")
    if plan.schedule not in SCHEDULES:
        raise InputError("schedule", f"'{plan.schedule}' is not one of {', '.join(SCHEDULES)}")
    if plan.zero_stage not in (0, 1, 2, 3):
        raise InputError("zero_stage", f"must be 0, 1, 2 or 3, got {plan.zero_stage}")
    if plan.micro_batch_size <= 0:
        raise InputError("micro_batch_size", "must be positive")
    if plan.virtual_stages <= 0:
        raise InputError("virtual_stages", "must be positive")
    if plan.virtual_stages > 1 and plan.schedule != "Interleaved1F1B":
        raise InputError("virtual_stages", "only the Interleaved1F1B schedule uses virtual stages")
    total = sum(p.batch_size for p in plan.pipelines)
    if total != plan.global_batch_size:
        raise InputError(
            "pipelines.batch_size",
            f"batch sizes sum to {total}, not the global batch {plan.global_batch_size}",
        )
    for i, pipe in enumerate(plan.pipelines):
        if pipe.batch_size <= 0 or pipe.batch_size % plan.micro_batch_size:
            raise InputError(
                f"pipelines[{i}].batch_size",
                f"{pipe.batch_size} is not a positive multiple of the micro-batch "
                f"{plan.micro_batch_size}",
            )
        for j, stage in enumerate(pipe.stages):
            if stage.layers < 0:
                raise InputError(f"pipelines[{i}].stages[{j}].layers", "must be >= 0")
            if stage.chunks is not None:
                check_chunks(stage, plan.virtual_stages, f"pipelines[{i}].stages[{j}]")
        if plan.schedule == "Interleaved1F1B":
            m, p = pipe.batch_size // plan.micro_batch_size, len(pipe.stages)
            if p > 1 and not interleave_fits(p, m):
                raise InputError(
                    f"pipelines[{i}]",
                    f"Interleaved1F1B runs {m} micro-batches on {p} stages only in equal "
                    f"groups of at least {p}: at least {p} micro-batches, a multiple of "
                    f"{m} // {p} = {max(1, m // p)}",
                )
    seen: set[str] = set()
    for dev in plan.devices():
        if dev in seen:
            raise InputError("devices", f"device {shown(dev)} is used more than once")
        seen.add(dev)


def check_chunks(stage: Stage, v: int, where: str) -> None:
    """Raises InputError unless the stage's explicit chunk list fits ``v`` virtual stages."""
    chunks = stage.chunks
    if chunks is None:
        return
    if len(chunks) != v:
        raise InputError(
            f"{where}.chunks",
            f"lists {len(chunks)} chunks, but the plan has {v} virtual stages per stage",
        )
    if any(x < 0 for x in chunks):
        raise InputError(f"{where}.chunks", "layer counts must be >= 0")
    if sum(chunks) != stage.layers:
        raise InputError(
            f"{where}.chunks", f"chunks sum to {sum(chunks)} layers, not the stage's {stage.layers}"
        )


def check_plan_model(plan: Plan, model: ModelSpec) -> None:
    """Raises InputError unless the plan fits the model whatever the cluster: its form,
    every pipeline's layers summing to the model's, TP degrees dividing the heads and the
    FFN, layers splitting into the stated chunks (``export`` has no cluster to check), and
    the model of the shape the plan was made for where the file states one."""
    check_plan_form(plan)
    check_model_shape(plan, model)
    for i, pipe in enumerate(plan.pipelines):
        layers = sum(s.layers for s in pipe.stages)
        if layers != model.layers:
            raise InputError(
                f"pipelines[{i}].stages",
                f"layers sum to {layers}, but {model.name} has {model.layers}",
            )
        for j, stage in enumerate(pipe.stages):
            where = f"pipelines[{i}].stages[{j}].devices"
            tp = stage.tp
            if model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
                raise InputError(where, f"tensor-parallel degree {tp} does not divide the heads")
            if model.ffn % tp:
                raise InputError(where, f"tensor-parallel degree {tp} does not divide ffn")
            v = plan.virtual_stages
            if stage.chunks is None and v > 1 and stage.layers % v:
                raise InputError(
                    f"pipelines[{i}].stages[{j}].layers",
                    f"{stage.layers} layers do not split evenly into {plan.virtual_stages} "
                    "chunks (state them with 'chunks', e.g. [4, 3])",
                )


def validate_plan(plan: Plan, model: ModelSpec, cluster: Cluster) -> None:
    """Raises InputError unless the plan places the model on the cluster's devices."""
    check_plan_model(plan, model)
    for i, pipe in enumerate(plan.pipelines):
        for j, stage in enumerate(pipe.stages):
            where = f"pipelines[{i}].stages[{j}].devices"
            nodes = {cluster.device_node(d).name for d in stage.devices}
            if len(nodes) > 1:
                spans = ", ".join(sorted(nodes))
                raise InputError(where, f"a tensor-parallel group spans nodes {spans}")
            gpu = cluster.device_node(stage.devices[0]).gpu
            if not gpu.supports(plan.precision):
                raise InputError("precision", f"{gpu.name} has no {plan.precision} support")
