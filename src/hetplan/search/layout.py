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


def replica_shares(global_batch: int, dp: int, micro_batch: int) -> list[int] | None:
    """Returns each replica's batch share: the global batch over ``dp`` equally where it
    divides; else its ``global_batch / micro_batch`` micro-batches as evenly as they go
    (the first replicas one more), so a GPU count the batch does not divide still runs every
    replica; None where neither holds (a micro-batch that does not divide the batch, or
    fewer micro-batches than replicas)."""
    if dp <= 0:
        return None
    if global_batch % dp == 0:
        return [global_batch // dp] * dp
    if micro_batch <= 0 or global_batch % micro_batch or global_batch // micro_batch < dp:
        return None
    q, r = share_counts(global_batch, dp, micro_batch)
    return [(q + 1) * micro_batch] * r + [q * micro_batch] * (dp - r)


def share_counts(global_batch: int, dp: int, micro_batch: int) -> tuple[int, int]:
    """Returns (q, r): in ``replica_shares``, the first r replicas run q + 1 micro-batches and
    the others q (r = 0 where the batch divides evenly; ``micro_batch`` must divide the
    batch)."""
    return divmod(global_batch // micro_batch, dp)


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
    """Returns the Megatron-layout plan: TP innermost inside a node, then DP, then PP;
    batch shares by ``replica_shares`` (equal where ``dp`` divides the batch).

    Rank ``((stage * dp) + replica) * tp + t`` takes the rank-th device in node order.
    """
    devs = list(devices if devices is not None else cluster.devices())
    need = tp * pp * dp
    if need > len(devs):
        raise InputError("degrees", f"tp*pp*dp = {need} exceeds the {len(devs)} GPUs")
    shares = replica_shares(global_batch, dp, micro_batch)
    if shares is None:
        raise InputError(
            "--dp",
            f"data-parallel degree {dp} does not divide the batch {global_batch}, nor do "
            f"its micro-batches of {micro_batch} spread over {dp} replicas",
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
        pipelines.append(Pipeline(shares[r], tuple(stages)))
    return Plan(
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        pipelines=tuple(pipelines),
        **options,  # type: ignore[arg-type]
    )
