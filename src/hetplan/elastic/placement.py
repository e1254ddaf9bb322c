"""Which node holds which checkpoint shard: derived from a plan, and recorded per step.

A shard is one plan-independent checkpoint unit (``embed``, ``layer_NNNN``, ``head``):
full fp32 parameters with both Adam moments. Every node keeps on local disk the shards its
devices hold under the plan, so data-parallel replicas give several copies of each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan

EMBED, HEAD = "embed", "head"
STATE_BYTES_PER_PARAM = 12
"""A runtime checkpoint stores fp32 weights, exp_avg and exp_avg_sq for every parameter."""


def layer_unit(i: int) -> str:
    """Returns the shard name of transformer layer ``i``."""
    return f"layer_{i:04d}"


def node_of(device: str) -> str:
    """Returns the node name of a device 'node:index'."""
    return device.rpartition(":")[0]


def shard_bytes(model: ModelSpec) -> dict[str, int]:
    """Returns the checkpoint bytes of every shard of ``model``."""
    out = {EMBED: model.embedding_params() * STATE_BYTES_PER_PARAM}
    for i in range(model.layers):
        out[layer_unit(i)] = model.layer_params() * STATE_BYTES_PER_PARAM
    # a tied output matrix is the embedding's table, saved once, in the embedding's shard
    # (the runtime's head.pt then holds the final norm alone)
    tied = model.vocab * model.hidden if model.tie_embeddings else 0
    out[HEAD] = (model.head_params() - tied) * STATE_BYTES_PER_PARAM
    return out


def _chunks(plan: Plan) -> int:
    """Returns the model chunks per stage the plan's schedule runs."""
    return plan.virtual_stages if plan.schedule == "Interleaved1F1B" else 1


def stage_units(plan: Plan, model: ModelSpec) -> list[list[set[str]]]:
    """Returns per pipeline, per stage, the shards the stage holds (virtual stages too)."""
    v = _chunks(plan)
    return [[set(u) for u in _pipeline_units(pipe.stages, v, model)] for pipe in plan.pipelines]


def _pipeline_units(stages: Any, v: int, model: ModelSpec) -> list[frozenset[str]]:
    """Returns per stage of one pipeline the shards it holds, with ``v`` model chunks."""
    p = len(stages)
    units: list[set[str]] = [set() for _ in range(p)]
    start = 0
    for c in range(v):
        for j, stage in enumerate(stages):
            n = stage.chunk_layers(v)[c]  # uneven chunks (Stage.chunks) too
            units[j].update(layer_unit(i) for i in range(start, start + n))
            start += n
            if c == 0 and j == 0:
                units[j].add(EMBED)
            if c == v - 1 and j == p - 1:
                units[j].add(HEAD)
                if model.tie_embeddings:
                    units[j].add(EMBED)
    return [frozenset(u) for u in units]


def node_shards(plan: Plan, model: ModelSpec) -> dict[str, frozenset[str]]:
    """Returns node -> the shards its devices hold under ``plan``. Pipelines of the same
    stage layers (every replica of a uniform plan) share one computation of their units."""
    v = _chunks(plan)
    memo: dict[tuple[tuple[int, ...], ...], list[frozenset[str]]] = {}
    out: dict[str, set[str]] = {}
    for pipe in plan.pipelines:
        key = tuple(tuple(stage.chunk_layers(v)) for stage in pipe.stages)
        units = memo.get(key)
        if units is None:
            units = memo[key] = _pipeline_units(pipe.stages, v, model)
        for stage, us in zip(pipe.stages, units, strict=True):
            for n in {node_of(d) for d in stage.devices}:
                held = out.get(n)
                if held is None:
                    out[n] = set(us)
                else:
                    held |= us
    return {n: frozenset(s) for n, s in out.items()}


@dataclass(frozen=True)
class Placement:
    """The record of one checkpoint step: node -> shard -> SHA-256 of its local copy."""

    step: int
    data_position: int
    holders: dict[str, dict[str, str]]

    def to_json(self) -> dict[str, Any]:
        """Returns the JSON form written beside the checkpoints."""
        return {"step": self.step, "data_position": self.data_position, "holders": self.holders}

    @staticmethod
    def from_json(data: Any) -> Placement:
        """Returns the Placement of a parsed record."""
        try:
            return Placement(
                int(data["step"]),
                int(data["data_position"]),
                {str(n): dict(s) for n, s in data["holders"].items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError("placement", f"unreadable placement record: {exc}") from None

    def dumps(self) -> bytes:
        """Returns the record as JSON bytes."""
        return (json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n").encode()

    def digest(self, shard: str) -> str | None:
        """Returns the SHA-256 every copy of ``shard`` must have (None if no node holds it)."""
        for shards in self.holders.values():
            if shard in shards:
                return shards[shard]
        return None
