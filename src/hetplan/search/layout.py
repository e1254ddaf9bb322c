"""Building Megatron-style uniform plans: degrees to devices, layers to stages."""

from __future__ import annotations

from functools import cache

from hetplan.cluster import Cluster
from hetplan.errors import InputError
from hetplan.plan import Pipeline, Plan, Stage


def even_layer_split(layers: int, stages: int) -> list[int]:
    """Returns layers per stage as even as possible; extra layers go to the middle stages,
    since the first and last stages also hold the embedding and the head."""
    return list(_even_split(layers, stages))


@cache
def _even_split(layers: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(layers, stages)
    out = [base] * stages
    order = sorted(range(stages), key=lambda i: (i in (0, stages - 1), abs(i - stages / 2)))
    for i in order[:extra]:
        out[i] += 1
    return tuple(out)


def uniform_plan(
    cluster: Cluster,
    layers: int,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    global_batch: int,
    devices: list[str] | None = None,
    **options: object,
) -> Plan:
    """Returns the Megatron-layout plan: TP innermost inside a node, then DP, then PP.

    Rank ``((stage * dp) + replica) * tp + t`` takes the rank-th device in node order.
    """
    devs = list(devices if devices is not None else cluster.devices())
    need = tp * pp * dp
    if need > len(devs):
        raise InputError("degrees", f"tp*pp*dp = {need} exceeds the {len(devs)} GPUs")
    if global_batch % dp:
        raise InputError(
            "--dp", f"data-parallel degree {dp} does not divide the batch {global_batch}"
        )
    if pp > layers:
        raise InputError("--pp", f"{pp} stages for {layers} layers")
    split = even_layer_split(layers, pp)
    pipelines = []
    for r in range(dp):
        stages = []
        for s in range(pp):
            base = (s * dp + r) * tp
            stages.append(Stage(split[s], tuple(devs[base : base + tp])))
        pipelines.append(Pipeline(global_batch // dp, tuple(stages)))
    return Plan(
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        pipelines=tuple(pipelines),
        **options,  # type: ignore[arg-type]
    )
