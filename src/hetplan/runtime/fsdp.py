"""ZeRO-3: each transformer layer sharded with ``torch.distributed.fsdp.fully_shard`` over the
ranks that hold it (its sync group: the same layer at the same tensor-parallel index in
every replica). FSDP gathers a layer's parameters before its forward and backward and
reduce-scatters its gradients, micro-batch by micro-batch, summing (not averaging): every
micro-batch loss is already scaled by its share of the global batch.

With a multi-stage pipeline the layers run as PyTorch's pipelining runs FSDP2 and as the
cost model prices it (``cost.sharding.deferred_sync``): gathered at the step's first
forward and held (``reshard_after_forward=False``), gradients kept whole and accumulated
with no sync for every micro-batch's backward but the last, which reduce-scatters them and
reshards (``DeferredStage`` in ``pipeline.py`` sets the flags per backward). Replicas
without pipelining whose batch shares give different micro-batch counts run so too
(per micro-batch, the longer replica's extra gathers would have no partner).

Deferred, any replicas line up, whatever their stage splits and micro-batch counts. Each
layer issues exactly two collectives a step over its sync group: its all-gather G(i) at
the first forward that reaches it (micro-batch 0) and its reduce-scatter R(i) at the last
backward. Order them globally G(0) < G(1) < ... < G(L-1) < R(L-1) < ... < R(0).

1. Every rank issues its own collectives in that order. A rank's chunks hold increasing
   layer ranges (virtual stage c*p+j), and micro-batch 0's forward passes them in
   increasing order (chunk c+1's input comes, through the other stages, from chunk c's
   output); its last backwards pass them in decreasing order for the same reason, after
   all its forwards (they are micro-batch m-1's, the last to arrive). So the members of
   a process group (they hold the same layers: a group is their holders at one TP
   index) issue its collectives in the same order, as gloo and NCCL require.
2. No cycle of waits. Suppose all collectives before c complete. A holder of c's layer
   reaches c after compute, its pipeline's point-to-point transfers and earlier
   collectives only: before G(i) its stage waits for micro-batch 0's activations from
   earlier stages, which ran only layers below i (collectives G(<i)); before R(i) it waits
   for gradients from later stages, which ran the backwards of layers above i (their
   last ones issue R(>i)) and forwards (every G). Each pipeline's schedule is itself
   deadlock-free, so every holder issues c and c completes; by induction, every one does.

Embedding, head and TP collectives do not break this: the embedding and head sync after
the pipeline step (``optim.py``), and a stage's TP ranks run the same layers in lockstep.
``tests/runtime/test_zero3_pipeline.py`` counts the collectives on uneven replicas and
``tests/runtime/test_features.py`` checks the training against one device.

The embedding and head stay whole (their optimizer state is sharded as ZeRO-1/2, see
``optim.py``): a tied token table is held by the first and the last stage, which run at
different times of the pipeline step, so gathering it across them would deadlock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from hetplan.runtime.layout import SyncGroup, layer_unit


class GlooReduceScatter(DefaultReduceScatter):
    """Reduce-scatter for gloo, which has none: all-reduce, keep this rank's part."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        dist.all_reduce(input_tensor, op=op, group=group)
        n, i = output_tensor.numel(), dist.get_rank(group)
        flat = input_tensor.reshape(-1)[i * n : (i + 1) * n]
        output_tensor.copy_(flat.view_as(output_tensor))
        return None


def shard_layers(
    modules: list[nn.Module],
    sync: list[tuple[SyncGroup, Any]],
    device: torch.device,
    deferred: bool = False,
    low: torch.dtype | None = None,
) -> list[str]:
    """Applies fully_shard to every layer of ``modules`` held by more than one rank; returns
    the sharded units. ``deferred``: held gathered from the first forward to the last
    backward (a multi-stage pipeline, see the module docstring). ``low``: the plan's low
    precision (``shard_block``)."""
    by_unit = {u: pg for sg, pg in sync if sg.sharded for u in sg.units}
    meshes: dict[int, DeviceMesh] = {}
    done: list[str] = []
    for m in modules:
        layers: Any = getattr(m, "layers", {})
        for name, block in layers.items():
            unit = layer_unit(int(name))
            pg = by_unit.get(unit)
            if pg is None:
                continue
            mesh = meshes.get(id(pg))
            if mesh is None:
                mesh = meshes[id(pg)] = DeviceMesh.from_group(pg, device.type)
            shard_block(block, pg, device, mesh, reshard_after_forward=not deferred, low=low)
            done.append(unit)
    return done


def shard_block(
    block: nn.Module,
    pg: Any,
    device: torch.device,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    low: torch.dtype | None = None,
) -> None:
    """Shards one layer over ``pg`` as ZeRO-3 runs it (the profile times the same). ``low``
    (bf16, fp16): FSDP's mixed precision, as torchtitan runs it and the cost model prices
    it: fp32 shards (the masters), the layer gathered in ``low`` (2 bytes a parameter
    moved and held while it runs), gradients reduce-scattered and kept in fp32."""
    mesh = mesh or DeviceMesh.from_group(pg, device.type)
    mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if low else None)
    fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    block.set_gradient_divide_factor(1.0)  # type: ignore[operator]
    block.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    if dist.get_backend(pg) == "gloo":
        block.set_custom_reduce_scatter(GlooReduceScatter())  # type: ignore[operator]


def is_sharded(t: torch.Tensor) -> bool:
    """Returns whether ``t`` is a DTensor (an FSDP-sharded parameter or state)."""
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def sharded_layers(module: nn.Module) -> list[FSDPModule]:
    """Returns the ``fully_shard``ed layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def set_deferred_sync(layers: list[FSDPModule], last_backward: bool) -> None:
    """Before a micro-batch's backward: gradients accumulate whole and the parameters stay
    gathered, unless it is the step's last backward, which reduce-scatters and reshards
    (torch's ``PipelineStage.backward_maybe_with_nosync`` for a stage that is itself
    sharded; here the stage's layers are)."""
    for m in layers:
        m.set_is_last_backward(last_backward)
        m.set_requires_gradient_sync(last_backward)
        m.set_reshard_after_backward(last_backward)
