"""The optimizer step of a plan: gradient sums among the ranks holding each layer, ZeRO
sharding of the optimizer state (and gradients), loss-scale unscaling, gradient clipping
on the global norm, the learning-rate schedule and AdamW.

ZeRO-1 and -2 shard each sync group (the ranks that hold the same units at the same
tensor-parallel index, whatever the replicas' batch shares) as Megatron-Core's distributed
optimizer does: flat buffers (the parameters in the plan's precision, the gradients in
fp32), a reduce-scatter of the gradients into each member's contiguous shard (ZeRO-1 once
per step, ZeRO-2 every micro-batch), AdamW on the shard's fp32 master and an all-gather of
the updated parameters (``zero.py``). ZeRO-3 shards the layers with FSDP
(``fsdp.py``); their gradients arrive reduce-scattered and AdamW updates each rank's shard.

The step runs on each ZeRO-3 parameter's local shard as a plain tensor sharing the
DTensor's storage (``LocalShards``): the same elementwise math, without DTensor's dispatch
per operation and tensor (the bench's 4-layer ZeRO-3 plan on CPU: the step took 17-19 ms
of CPU per rank, 26-36 ms wall; now 10-11 ms and 15-24 ms, as the cost model's optimizer
step prices it). The clipping norm stays the global one: each rank's sum of squares over
its shards, all-reduced with the rest.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hetplan.runtime.fsdp import is_sharded
from hetplan.runtime.grad_sync import LocalParam, square_sum, sync_grads
from hetplan.runtime.layout import RankPlace, RuntimeLayout, SyncGroup
from hetplan.runtime.optim_config import OptimConfig, adamw_kwargs, clip_coefficient, lr_at
from hetplan.runtime.precision import LossScaler
from hetplan.runtime.zero import STATE_KEYS, ZeroBucket, buckets_of

__all__ = ["STATE_KEYS", "PlanOptimizer"]


class PlanOptimizer:
    """One rank's optimizer under the plan's ZeRO stage."""

    def __init__(
        self,
        params: list[LocalParam],
        sync: list[tuple[SyncGroup, Any]],
        zero_stage: int,
        cfg: OptimConfig,
        layout: RuntimeLayout,
        place: RankPlace,
        tp_group: Any,
        sequence_parallel: bool,
        scaler: LossScaler,
        device: torch.device,
        deferred: bool = False,
        low: torch.dtype | None = None,
    ) -> None:
        """``deferred``: ZeRO-2 runs as ZeRO-1 (``cost.sharding.deferred_sync``: pipelined
        plans). ``low``: the plan's low precision, in which ZeRO-1/2 keep the parameters
        (``zero.py``)."""
        self.params, self.sync, self.zero_stage, self.cfg = params, sync, zero_stage, cfg
        self.layout, self.place, self.tp_group = layout, place, tp_group
        self.seq_par, self.scaler, self.device = sequence_parallel, scaler, device
        self.rank = dist.get_rank()
        self.buckets: list[ZeroBucket] = []
        self.bucket_of: dict[int, ZeroBucket] = {}
        zero_groups: set[int] = set()
        mode = 1 if zero_stage == 2 and deferred else zero_stage
        self.per_micro_batch = mode == 2
        if zero_stage > 0:
            for sg, pg in sync:
                if not sg.sharded:
                    continue
                most = max(layout.places[r].micro_batches for r in sg.ranks)
                for units in buckets_of(layout, sg):
                    mine = [
                        lp for lp in params if lp.sync_unit in units and not is_sharded(lp.param)
                    ]
                    if not mine:
                        continue
                    if mode == 2 and sequence_parallel and tp_group is not None:
                        self._check_tp_aligned(sg)
                    b = ZeroBucket(mine, pg, mode, most, cfg, low)
                    self.buckets.append(b)
                    self.bucket_of.update((id(lp.param), b) for lp in mine)
                    zero_groups.add(id(sg))
        self.zero_groups = zero_groups
        self.shards = LocalShards([lp.param for lp in params if is_sharded(lp.param)])
        rest = [self.shards.plain(lp.param) for lp in params if id(lp.param) not in self.bucket_of]
        self.plain = torch.optim.AdamW(rest, **adamw_kwargs(cfg)) if rest else None
        self._full: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    def _check_tp_aligned(self, sg: SyncGroup) -> None:
        """ZeRO-2 with sequence parallelism sums the shards' replicated gradients over the
        TP group: each TP peer must hold the same shard of its own group."""
        me = sg.ranks.index(self.rank)
        for q in self.place.tp_ranks:
            g = next(g for g in self.layout.sync_groups if q in g.ranks and sg.units[0] in g.units)
            if g.ranks.index(q) != me:
                raise RuntimeError(
                    f"ZeRO-2 with sequence parallelism: rank {q} is member {g.ranks.index(q)} "
                    f"of its data-parallel group, rank {self.rank} member {me}"
                )

    # ---- the step -------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drops every gradient; the ZeRO buckets start the step with a zeroed buffer."""
        for lp in self.params:
            if id(lp.param) not in self.bucket_of:
                lp.param.grad = None
        self.shards.bind()  # drops the shards' gradients too
        for b in self.buckets:
            b.start()

    def step(self, step_number: int) -> dict[str, float]:
        """Sums gradients, unscales, clips, sets the learning rate and steps; returns the
        gradient norm, learning rate and whether the step was taken."""
        self._reduce_grads()
        self.shards.bind()
        grads = [
            self._grad(lp)
            for lp in self.params
            if lp.param.grad is not None and id(lp.param) not in self.bucket_of
        ]
        grads += [b.shard_grad for b in self.buckets if b.shard_grad is not None]
        finite = self.scaler.unscale_and_check(grads, self.device)
        norm = self._global_norm() if finite else float("inf")
        if finite:
            coef = clip_coefficient(norm, self.cfg.grad_clip)
            if coef < 1.0:
                with torch.no_grad():
                    for g in grads:
                        g.mul_(coef)
            lr = lr_at(step_number, self.cfg)
            for opt in self._optimizers():
                for group in opt.param_groups:
                    group["lr"] = lr
            if self.plain is not None:
                self.plain.step()
            for b in self.buckets:
                b.step()
        self.scaler.update(finite)
        return {"grad_norm": norm, "lr": lr_at(step_number, self.cfg), "skipped": not finite}

    def _grad(self, lp: LocalParam) -> torch.Tensor:
        """Returns ``lp``'s gradient this rank holds, a plain tensor (ZeRO-3: its shard's)."""
        g = self.shards.plain(lp.param).grad
        assert g is not None
        return g

    def _optimizers(self) -> list[Any]:
        return ([self.plain] if self.plain is not None else []) + [b.opt for b in self.buckets]

    def _reduce_grads(self) -> None:
        if self.seq_par and self.tp_group is not None:
            self._sum_replicated_over_tp()
        plain_groups = [(sg, pg) for sg, pg in self.sync if id(sg) not in self.zero_groups]
        whole = [lp for lp in self.params if not is_sharded(lp.param)]
        sync_grads(whole, plain_groups, self.place.tp, self.place.tp_index)
        for b in self.buckets:
            b.add_missing()
        for b in self.buckets:
            b.reduce()
        if self.per_micro_batch and self.seq_par and self.tp_group is not None:
            pieces = [t for b in self.buckets for t in b.replicated_pieces()]
            _all_reduce_pieces(pieces, self.tp_group)

    def _sum_replicated_over_tp(self) -> None:
        """Sequence parallel: each TP rank ran the norms and biases on its slice of the
        sequence, so their gradients are partial sums over the group (ZeRO-2's are summed
        in their shards, after the reduce-scatters)."""
        mine = [
            lp
            for lp in self.params
            if lp.dim is None
            and lp.unit.startswith("layer_")
            and not (self.per_micro_batch and id(lp.param) in self.bucket_of)
        ]
        grads = []
        for lp in mine:
            b = self.bucket_of.get(id(lp.param))
            if b is not None and b.low is not None:
                grads.append(b.grad_of(lp.param))  # added into the fp32 buffer
            elif lp.param.grad is not None:
                grads.append(_local(lp.param.grad))
        with torch.no_grad():
            _all_reduce_pieces(grads, self.tp_group)

    def _counted(self, lp: LocalParam) -> bool:
        """Returns whether this rank adds ``lp``'s gradient to the global norm: each
        distinct gradient element is counted once over all ranks (ZeRO shards apart)."""
        if id(lp.param) in self.bucket_of:
            return False  # counted in the shards
        if lp.dim is None and self.place.tp_index != 0:
            return False  # the same on every TP rank
        if is_sharded(lp.param):
            return True  # each member holds its own shard
        return self.rank in self.layout.owner(lp.unit).tp_ranks

    def _global_norm(self) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for lp in self.params:
            if lp.param.grad is not None and self._counted(lp):
                total += square_sum(self._grad(lp))
        for b in self.buckets:
            total += b.square_sum(self.place.tp_index)
        dist.all_reduce(total)
        return float(total.item()) ** 0.5

    def state_tensors(self) -> list[torch.Tensor]:
        """Returns every tensor of optimizer state this rank holds: AdamW's, and the ZeRO
        gradient shards."""
        out: list[torch.Tensor] = []
        if self.plain is not None:
            for st in self.plain.state.values():
                out += [st[k] for k in STATE_KEYS if k in st]
        for b in self.buckets:
            out += b.state_tensors()
        return out

    # ---- checkpoints ----------------------------------------------------------------
    @torch.no_grad()
    def materialize(self) -> None:
        """Collective over all ranks: makes every local parameter and its AdamW state
        whole along the data-parallel dimension (TP shards stay split) for saving."""
        self._full = {}
        for lp in self.params:
            if is_sharded(lp.param):
                shard = self.shards.plain(lp.param)
                st = self.plain.state.get(shard, {}) if self.plain is not None else {}
                state: dict[str, Any] = {"step": float(st["step"])} if "step" in st else {}
                for key in STATE_KEYS:
                    if key in st:
                        state[key] = _full_tensor(st[key], lp.param)
                full: torch.Tensor = lp.param.full_tensor()  # type: ignore[attr-defined]
                self._full[id(lp.param)] = (full, state)
        for b in self.buckets:
            states = b.gather_state()
            masters = b.gather_masters()  # low precision: the fp32 values, not the params'
            for lp in b.params:
                value = masters.get(id(lp.param), lp.param.detach())
                self._full[id(lp.param)] = (value, states.get(id(lp.param), {}))

    def param_of(self, lp: LocalParam) -> torch.Tensor:
        """Returns the TP-local, data-parallel-whole value of ``lp`` (after materialize)."""
        got = self._full.get(id(lp.param))
        return got[0] if got is not None else lp.param.detach()

    def state_of(self, lp: LocalParam) -> dict[str, Any]:
        """Returns ``lp``'s AdamW state (step, exp_avg, exp_avg_sq), after materialize."""
        got = self._full.get(id(lp.param))
        if got is not None:
            return got[1]
        st = self.plain.state.get(lp.param, {}) if self.plain is not None else {}
        out: dict[str, Any] = {"step": float(st["step"])} if "step" in st else {}
        out.update({k: st[k] for k in STATE_KEYS if k in st})
        return out

    @torch.no_grad()
    def load(self, lp: LocalParam, value: torch.Tensor, state: dict[str, Any] | None) -> None:
        """Sets ``lp`` (TP-local full ``value``) and its AdamW state on this rank."""
        p = lp.param
        if is_sharded(p):
            local = _dp_chunk(value, p)
            p.to_local().copy_(local.to(p.device))  # type: ignore[attr-defined]
        else:
            p.copy_(value.to(p.device))
        bucket = self.bucket_of.get(id(p))
        if bucket is not None:
            bucket.load_param(lp, value)
        if state is None or not all(k in state for k in STATE_KEYS):
            return
        if bucket is not None:
            bucket.load_state(lp, state)
            return
        st: dict[str, Any] = {"step": torch.tensor(float(state["step"]))}
        for key in STATE_KEYS:
            t = state[key].to(p.device)
            st[key] = (_dp_chunk(t, p) if is_sharded(p) else t).clone()
        if self.plain is not None:
            self.plain.state[self.shards.plain(p)] = st


class LocalShards:
    """A plain tensor per ZeRO-3 (DTensor) parameter, standing for its local shard in the
    optimizer (which keys its state by it): ``bind`` points each at the shard's current
    storage and gradient (FSDP may replace the local tensor, at its lazy initialisation;
    a reduce-scatter gives a new gradient every step), so updating it updates the shard."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        with torch.no_grad():
            self.local = {id(p): _local(p).detach() for p in params}

    def plain(self, p: torch.Tensor) -> torch.Tensor:
        """Returns the tensor the optimizer steps for ``p``: its shard's, or ``p`` itself."""
        return self.local.get(id(p), p)

    @torch.no_grad()
    def bind(self) -> None:
        """Points every shard tensor at its parameter's local data and gradient."""
        for p in self.params:
            t = self.local[id(p)]
            t.data = _local(p)
            t.grad = None if p.grad is None else _local(p.grad)


def _full_tensor(shard: torch.Tensor, like: Any) -> torch.Tensor:
    """Collective over ``like``'s mesh: the whole tensor of which ``shard`` is this rank's
    part, sharded as the DTensor ``like`` (FSDP's uneven dim-0 chunks included)."""
    from torch.distributed.tensor import DTensor

    whole = DTensor.from_local(
        shard,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
    out: torch.Tensor = whole.full_tensor()
    return out


def _all_reduce_pieces(pieces: list[torch.Tensor], group: Any) -> None:
    """Sums ``pieces`` over ``group`` in place, as one flat buffer."""
    if not pieces:
        return
    flat = torch.cat([t.reshape(-1) for t in pieces])
    dist.all_reduce(flat, group=group)
    pos = 0
    for t in pieces:
        t.copy_(flat[pos : pos + t.numel()].view_as(t))
        pos += t.numel()


def _local(t: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]
    return out


def _dp_chunk(full: torch.Tensor, p: Any) -> torch.Tensor:
    """Returns this rank's FSDP shard (dim 0, torch.chunk order) of ``full``."""
    mesh = p.device_mesh
    n, r = mesh.size(), mesh.get_local_rank()
    parts = list(full.chunk(n, dim=0))
    local = parts[r] if r < len(parts) else full[:0]
    want = tuple(p.to_local().shape)
    if tuple(local.shape) != want:
        raise RuntimeError(f"FSDP shard of shape {want} does not match {tuple(local.shape)}")
    return local
