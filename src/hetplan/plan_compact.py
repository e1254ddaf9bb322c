"""The compact plan-file form: a pipeline template repeated ``count`` times over a node range.

A plan file's ``pipelines`` list may mix explicit pipelines (every stage names its devices)
and compact entries::

    {"count": 1024, "batch_size": 2, "nodes": "h100-80gb-0..h100-80gb-2047",
     "rank_order": "tp-dp-pp", "stages": [{"layers": 8, "tp": 8}, ...]}

The entry's devices are its nodes' devices in order, the same number on each node starting
at index 0 (``node:0``, ``node:1``, ...). Ranks take them in ``rank_order``, innermost
first, as Megatron-LM's ``--order`` names it: ``tp-dp-pp`` (Megatron's layout: the
tensor-parallel group innermost, then replicas, then stages) or ``tp-pp-dp`` (each replica's
stages on consecutive devices). Stage ``j`` of replica ``i`` with stage degrees ``t`` takes
the ``t[j]`` devices from offset ``count * sum(t[:j]) + i * t[j]`` (``tp-dp-pp``) or
``i * sum(t) + sum(t[:j])`` (``tp-pp-dp``).

``expand_pipelines`` turns compact entries into explicit pipeline objects (the plan reader
then parses them as usual); ``compact_pipelines`` writes a plan's pipelines back in the
compact form wherever consecutive pipelines repeat one template on whole node ranges.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

from hetplan.errors import InputError

if TYPE_CHECKING:
    from hetplan.cluster import Cluster
    from hetplan.plan import Pipeline, Plan

RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")
COMPACT_KEYS = {"count", "batch_size", "nodes", "rank_order", "stages"}
_RANGE = re.compile(r"^(?P<a>.*?)(?P<i>\d+)\.\.(?P<b>.*?)(?P<j>\d+)$")


def is_compact(entry: Any) -> bool:
    """Returns whether a plan file's pipeline entry is in the compact form."""
    return isinstance(entry, dict) and ("count" in entry or "nodes" in entry)


def parse_nodes(value: Any, where: str) -> list[str]:
    """Returns the node names of a compact entry's ``nodes``: a list of names, one name, or
    a range ``prefix3..prefix10`` (the same prefix, integer suffixes, first <= last)."""
    if isinstance(value, list):
        if not value or not all(isinstance(n, str) and n for n in value):
            raise InputError(where, "must be a non-empty list of node names")
        names = list(value)
    elif isinstance(value, str) and value:
        match = _RANGE.match(value)
        if match is None:
            if ".." in value:
                raise InputError(where, f"{value} is not a range such as node-0..node-15")
            names = [value]
        else:
            a, b = match["a"], match["b"]
            i, j = int(match["i"]), int(match["j"])
            if a != b:
                raise InputError(where, f"{value}: both ends must share the prefix {a}")
            if j < i:
                raise InputError(where, f"{value}: the range runs backwards ({i} > {j})")
            names = [f"{a}{k}" for k in range(i, j + 1)]
    else:
        raise InputError(where, "required: a node range such as node-0..node-15, or a list")
    if len(set(names)) != len(names):
        raise InputError(where, "names a node more than once")
    return names


def format_nodes(names: list[str]) -> str | list[str]:
    """Returns the shortest ``nodes`` value for ``names`` (a range where they count up)."""
    if len(names) == 1:
        return names[0]
    match = re.match(r"^(.*?)(\d+)$", names[0])
    if match is not None:
        prefix, start = match[1], int(match[2])
        if [f"{prefix}{start + k}" for k in range(len(names))] == names:
            return f"{names[0]}..{names[-1]}"
    return list(names)


def _positive(entry: dict[str, Any], key: str, where: str) -> int:
    value = entry.get(key)
    if value is None:
        raise InputError(f"{where}{key}", "required")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise InputError(f"{where}{key}", f"must be a positive integer, got {value}")
    return value


def _offsets(tps: list[int], count: int, order: str) -> list[list[int]]:
    """Returns, per replica and stage, the offset of the stage's first device."""
    before = [sum(tps[:j]) for j in range(len(tps))]
    total = sum(tps)
    if order == "tp-dp-pp":
        return [[count * before[j] + i * tps[j] for j in range(len(tps))] for i in range(count)]
    return [[i * total + before[j] for j in range(len(tps))] for i in range(count)]


def expand_entry(entry: dict[str, Any], i: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Returns the explicit pipeline objects of compact entry ``pipelines[i]`` and its nodes."""
    where = f"pipelines[{i}]."
    unknown = sorted(set(entry) - COMPACT_KEYS)
    if unknown:
        raise InputError(
            f"{where}{unknown[0]}", f"unknown key of a repeated pipeline (allowed: "
            f"{', '.join(sorted(COMPACT_KEYS))})",
        )  # fmt: skip
    count = _positive(entry, "count", where)
    batch = _positive(entry, "batch_size", where)
    nodes = parse_nodes(entry.get("nodes"), f"{where}nodes")
    order = entry.get("rank_order", "tp-dp-pp")
    if order not in RANK_ORDERS:
        raise InputError(f"{where}rank_order", f"{order} is not one of {', '.join(RANK_ORDERS)}")
    stages = entry.get("stages")
    if not isinstance(stages, list) or not stages:
        raise InputError(f"{where}stages", "required: a non-empty list")
    tps = []
    for j, st in enumerate(stages):
        if not isinstance(st, dict):
            raise InputError(f"{where}stages[{j}]", "must be an object")
        if "devices" in st:
            raise InputError(
                f"{where}stages[{j}].devices", "a repeated pipeline states tp, not devices"
            )
        tps.append(_positive(st, "tp", f"{where}stages[{j}]."))
    total = count * sum(tps)
    per_node, rest = divmod(total, len(nodes))
    if rest:
        raise InputError(
            f"{where}nodes",
            f"{count} pipelines of {sum(tps)} GPUs ({total}) do not spread evenly over "
            f"{len(nodes)} nodes",
        )
    devices = [f"{n}:{k}" for n in nodes for k in range(per_node)]
    out = []
    for offsets in _offsets(tps, count, order):
        explicit = []
        for st, tp, off in zip(stages, tps, offsets, strict=True):
            stage = {k: v for k, v in st.items() if k != "tp"}
            stage["devices"] = devices[off : off + tp]
            explicit.append(stage)
        out.append({"batch_size": batch, "stages": explicit})
    return out, nodes


def expand_pipelines(raw: list[Any], cluster: Cluster | None = None) -> tuple[list[Any], list[int]]:
    """Returns the explicit pipeline objects of a plan file's ``pipelines`` list and, per
    explicit pipeline, the index of the entry it came from.

    Compact entries must not share a node; with ``cluster``, their nodes must exist and
    hold the GPUs the entry places on them."""
    if not any(is_compact(e) for e in raw):
        return raw, list(range(len(raw)))
    out: list[Any] = []
    origin: list[int] = []
    owner: dict[str, int] = {}
    for i, entry in enumerate(raw):
        if not is_compact(entry):
            out.append(entry)
            origin.append(i)
            continue
        pipes, nodes = expand_entry(entry, i)
        for name in nodes:
            if name in owner:
                raise InputError(
                    f"pipelines[{i}].nodes",
                    f"overlaps the nodes of pipelines[{owner[name]}] (node {name})",
                )
            owner[name] = i
        if cluster is not None:
            _check_nodes(pipes, nodes, cluster, i)
        out.extend(pipes)
        origin.extend([i] * len(pipes))
    return out, origin


def _check_nodes(pipes: list[dict[str, Any]], nodes: list[str], cluster: Cluster, i: int) -> None:
    """Raises InputError naming ``pipelines[i].nodes`` unless its nodes exist and hold the
    devices the entry places on them."""
    where = f"pipelines[{i}].nodes"
    per_node = sum(len(st["devices"]) for p in pipes for st in p["stages"]) // len(nodes)
    for name in nodes:
        node = cluster.node_or_none(name)
        if node is None:
            raise InputError(where, f"node {name} is not in the cluster")
        if node.gpus < per_node:
            raise InputError(where, f"places {per_node} GPUs on node {name}, which has {node.gpus}")


def _template(pipe: Pipeline) -> tuple[Any, ...]:
    """Returns what two pipelines must share to be one compact entry: batch share and each
    stage's fields but its devices, with its degree."""
    return (
        pipe.batch_size,
        tuple(
            (st.tp, tuple(getattr(st, f.name) for f in fields(st) if f.name != "devices"))
            for st in pipe.stages
        ),
    )


def _whole_nodes(devices: list[str]) -> list[str] | None:
    """Returns the nodes of ``devices`` when they are, node by node, ``node:0..node:d-1``
    with the same ``d`` on every node (the compact form's device order), else None."""
    nodes: list[str] = []
    counts: list[int] = []
    for dev in devices:
        name, _, index = dev.rpartition(":")
        if nodes and name == nodes[-1]:
            if index != str(counts[-1]):
                return None
            counts[-1] += 1
        elif index == "0":
            nodes.append(name)
            counts.append(1)
        else:
            return None
    if not nodes or len(set(counts)) != 1 or len(set(nodes)) != len(nodes):
        return None
    return nodes


def _explicit(plan: Plan, pipe: Pipeline) -> dict[str, Any]:
    """Returns one pipeline's explicit object, as ``Plan.to_dict`` writes it."""
    one: dict[str, Any] = replace(plan, pipelines=(pipe,)).to_dict()["pipelines"][0]
    one["stages"] = list(one["stages"])
    return one


def _entry(plan: Plan, pipes: list[Pipeline], order: str) -> dict[str, Any] | None:
    """Returns the compact entry of consecutive ``pipes`` (one template) in ``order``, or
    None where their devices do not follow it."""
    tps = [st.tp for st in pipes[0].stages]
    offsets = _offsets(tps, len(pipes), order)
    flat: list[str] = [""] * (len(pipes) * sum(tps))
    for pipe, offs in zip(pipes, offsets, strict=True):
        for st, off in zip(pipe.stages, offs, strict=True):
            flat[off : off + st.tp] = st.devices
    nodes = _whole_nodes(flat)
    if nodes is None:
        return None
    template = _explicit(plan, pipes[0])
    stages = []
    for st, tp in zip(template["stages"], tps, strict=True):
        stages.append({("tp" if k == "devices" else k): (tp if k == "devices" else v)
                       for k, v in st.items()})  # fmt: skip
    return {
        "count": len(pipes),
        "batch_size": template["batch_size"],
        "nodes": format_nodes(nodes),
        "rank_order": order,
        "stages": stages,
    }


def compact_pipelines(plan: Plan) -> list[dict[str, Any]]:
    """Returns the plan's ``pipelines`` list in the compact form: each run of consecutive
    pipelines with one template written as one entry where its devices follow a rank order
    on whole nodes; the rest explicit."""
    pipes = plan.pipelines
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(pipes):
        tmpl = _template(pipes[i])
        k = i + 1
        while k < len(pipes) and _template(pipes[k]) == tmpl:
            k += 1
        entry = None
        if k - i > 1:
            run = list(pipes[i:k])
            entry = _entry(plan, run, "tp-dp-pp") or _entry(plan, run, "tp-pp-dp")
        if entry is not None:
            out.append(entry)
            i = k
            continue
        out.append(_explicit(plan, pipes[i]))
        i += 1
    return out


def compact_dict(plan: Plan) -> dict[str, Any]:
    """Returns the plan file mapping of ``plan`` with repeated pipelines compact."""
    out = replace(plan, pipelines=plan.pipelines[:1]).to_dict()
    out["pipelines"] = compact_pipelines(plan)
    return out


def rename_field(exc: InputError, origin: list[int]) -> InputError:
    """Returns ``exc`` with an explicit pipeline index in its field mapped back to the plan
    file's entry it was expanded from."""
    match = re.match(r"^pipelines\[(\d+)\](.*)$", exc.field)
    if match is None or int(match[1]) >= len(origin) or origin[int(match[1])] == int(match[1]):
        return exc
    return InputError(f"pipelines[{origin[int(match[1])]}]{match[2]}", exc.reason)
