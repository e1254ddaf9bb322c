"""The optimizer step of a plan: gradient sums among the ranks holding each layer, ZeRO
sharding of the optimizer state (and gradients), loss-scale unscaling, gradient clipping
on the global norm, the learning-rate schedule and AdamW.

ZeRO-1 and -2 use ``ZeroRedundancyOptimizer`` on each sync group (the ranks that hold the
same units at the same tensor-parallel index, whatever the replicas' batch shares): each
member keeps the AdamW state of its part of the group's parameters and broadcasts them
after its step. ZeRO-1 all-reduces the gradients; ZeRO-2 reduces each one to the rank that
updates it and frees it elsewhere. ZeRO-3 shards the layers with FSDP (``fsdp.py``); their
gradients arrive reduce-scattered and AdamW updates each rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from hetplan.runtime.fsdp import is_sharded
from hetplan.runtime.grad_sync import LocalParam, sync_grads
from hetplan.runtime.layout import RankPlace, RuntimeLayout, SyncGroup
from hetplan.runtime.optim_config import OptimConfig, adamw_kwargs, clip_coefficient, lr_at
from hetplan.runtime.precision import LossScaler

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class _Zero:
    """One ZeroRedundancyOptimizer over a sync group's parameters."""

    def __init__(self, params: list[LocalParam], pg: Any, sg: SyncGroup, cfg: OptimConfig):
        self.params = sorted(params, key=lambda lp: lp.name)  # the same order on every member
        self.pg, self.sg = pg, sg
        self.opt = ZeroRedundancyOptimizer(
            [lp.param for lp in self.params],
            optimizer_class=torch.optim.AdamW,
            process_group=pg,
            **adamw_kwargs(cfg),
        )
        # the partition is ZeroRedundancyOptimizer's own (by parameter size, greedy)
        to_rank: dict[Any, int] = self.opt._param_to_rank  # type: ignore[attr-defined]
        self.owner = {
            id(lp.param): dist.get_global_rank(pg, to_rank[lp.param]) for lp in self.params
        }


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
    ) -> None:
        self.params, self.sync, self.zero_stage, self.cfg = params, sync, zero_stage, cfg
        self.layout, self.place, self.tp_group = layout, place, tp_group
        self.seq_par, self.scaler, self.device = sequence_parallel, scaler, device
        self.rank = dist.get_rank()
        self.zeros: list[_Zero] = []
        in_zero: set[int] = set()
        if zero_stage > 0:
            for sg, pg in sync:
                mine = [
                    lp
                    for lp in params
                    if lp.sync_unit in sg.units and not is_sharded(lp.param) and sg.sharded
                ]
                if mine:
                    self.zeros.append(_Zero(mine, pg, sg, cfg))
                    in_zero.update(id(lp.param) for lp in mine)
        self.zero_params = in_zero
        rest = [lp.param for lp in params if id(lp.param) not in in_zero]
        self.plain = torch.optim.AdamW(rest, **adamw_kwargs(cfg)) if rest else None
        self.stepped = False
        self._full: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    # ---- the step -------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Drops every gradient."""
        for lp in self.params:
            lp.param.grad = None

    def step(self, step_number: int) -> dict[str, float]:
        """Sums gradients, unscales, clips, sets the learning rate and steps; returns the
        gradient norm, learning rate and whether the step was taken."""
        self._reduce_grads()
        grads = [lp.param.grad for lp in self.params if lp.param.grad is not None]
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
            for z in self.zeros:
                z.opt.step()
            self.stepped = True
        self.scaler.update(finite)
        return {"grad_norm": norm, "lr": lr_at(step_number, self.cfg), "skipped": not finite}

    def _optimizers(self) -> list[Any]:
        return ([self.plain] if self.plain is not None else []) + [z.opt for z in self.zeros]

    def _reduce_grads(self) -> None:
        if self.seq_par and self.tp_group is not None:
            self._sum_replicated_over_tp()
        zero2 = {id(z.sg) for z in self.zeros} if self.zero_stage >= 2 else set()
        plain_groups = [(sg, pg) for sg, pg in self.sync if id(sg) not in zero2]
        whole = [lp for lp in self.params if not is_sharded(lp.param)]
        sync_grads(whole, plain_groups, self.place.tp, self.place.tp_index)
        if self.zero_stage >= 2:
            for z in self.zeros:
                self._reduce_to_owners(z)

    def _sum_replicated_over_tp(self) -> None:
        """Sequence parallel: each TP rank ran the norms and biases on its slice of the
        sequence, so their gradients are partial sums over the group."""
        mine = [lp for lp in self.params if lp.dim is None and lp.unit.startswith("layer_")]
        grads = [_local(lp.param.grad) for lp in mine if lp.param.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        pos = 0
        for g in grads:
            g.copy_(flat[pos : pos + g.numel()].view_as(g))
            pos += g.numel()

    def _reduce_to_owners(self, z: _Zero) -> None:
        """ZeRO-2: each gradient goes to the member that updates it, and is freed elsewhere."""
        owners = sorted(set(z.owner.values()))
        for owner in owners:
            mine = [lp for lp in z.params if z.owner[id(lp.param)] == owner]
            grads = [_grad(lp.param) for lp in mine]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.reduce(flat, dst=owner, group=z.pg)
            pos = 0
            for lp, g in zip(mine, grads, strict=True):
                if owner == self.rank:
                    g.copy_(flat[pos : pos + g.numel()].view_as(g))
                else:
                    lp.param.grad = None
                pos += g.numel()

    def _counted(self, lp: LocalParam) -> bool:
        """Returns whether this rank adds ``lp``'s gradient to the global norm: each
        distinct gradient element is counted once over all ranks."""
        if lp.dim is None and self.place.tp_index != 0:
            return False  # the same on every TP rank
        if is_sharded(lp.param):
            return True  # each member holds its own shard
        if self.zero_stage >= 2 and id(lp.param) in self.zero_params:
            return lp.param.grad is not None  # only on the rank that updates it
        return self.rank in self.layout.owner(lp.unit).tp_ranks

    def _global_norm(self) -> float:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for lp in self.params:
            g = lp.param.grad
            if g is not None and self._counted(lp):
                total += _local(g).double().pow(2).sum()
        dist.all_reduce(total)
        return float(total.item()) ** 0.5

    def state_tensors(self) -> list[torch.Tensor]:
        """Returns every tensor of AdamW state this rank holds."""
        out: list[torch.Tensor] = []
        for opt in ([self.plain] if self.plain is not None else []) + [
            z.opt.optim for z in self.zeros
        ]:
            for st in opt.state.values():
                out += [st[k] for k in STATE_KEYS if k in st]
        return out

    # ---- checkpoints ----------------------------------------------------------------
    @torch.no_grad()
    def materialize(self) -> None:
        """Collective over all ranks: makes every local parameter and its AdamW state
        whole along the data-parallel dimension (TP shards stay split) for saving."""
        self._full = {}
        for lp in self.params:
            if is_sharded(lp.param):
                st = self.plain.state.get(lp.param, {}) if self.plain is not None else {}
                state: dict[str, Any] = {"step": float(st["step"])} if "step" in st else {}
                for key in STATE_KEYS:
                    if key in st:
                        state[key] = st[key].full_tensor()
                full: torch.Tensor = lp.param.full_tensor()  # type: ignore[attr-defined]
                self._full[id(lp.param)] = (full, state)
        for z in self.zeros:
            for lp in z.params:
                owner = z.owner[id(lp.param)]
                st = z.opt.optim.state.get(lp.param, {}) if owner == self.rank else {}
                state = {}
                if self.stepped:
                    step = torch.tensor(
                        [float(st["step"]) if st else 0.0], dtype=torch.float64, device=self.device
                    )
                    dist.broadcast(step, src=owner, group=z.pg)
                    state["step"] = float(step.item())
                    for key in STATE_KEYS:
                        t = st[key] if st else torch.empty_like(lp.param)
                        dist.broadcast(t, src=owner, group=z.pg)
                        state[key] = t
                self._full[id(lp.param)] = (lp.param.detach(), state)

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
        if state is None or not all(k in state for k in STATE_KEYS):
            return
        st: dict[str, Any] = {"step": torch.tensor(float(state["step"]))}
        for key in STATE_KEYS:
            t = state[key].to(p.device)
            if is_sharded(p):
                from torch.distributed.tensor import DTensor

                mesh, places = p.device_mesh, p.placements  # type: ignore[attr-defined]
                st[key] = DTensor.from_local(_dp_chunk(t, p).clone(), mesh, places, run_check=False)
            else:
                st[key] = t.clone()
        for z in self.zeros:
            if id(p) in z.owner:
                if z.owner[id(p)] == self.rank:
                    z.opt.optim.state[p] = st
                return
        if self.plain is not None:
            self.plain.state[p] = st


def _grad(p: torch.Tensor) -> torch.Tensor:
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


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
