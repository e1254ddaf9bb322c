"""ZeRO-1/2 as the cost model prices them (Megatron-Core's distributed optimizer): the
parameters of a sync group live in one contiguous buffer, their gradients in an fp32 one,
both padded to a multiple of the group size; a reduce-scatter sums the gradients into each
member's contiguous shard, AdamW updates the fp32 master of that shard, and
``all_gather_into_tensor`` brings every member the updated parameters.

The parameter buffer is in the plan's precision. fp32 and tf32: the parameters are the
masters (the shard's slice, no second copy). bf16 and fp16: the parameters themselves are
bf16 or fp16 (2 bytes each, the model runs on them with no cast), the fp32 master is the
shard's alone, and each parameter's gradient, made in the low precision by each
micro-batch's backward, is added into the fp32 buffer and dropped
(``register_post_accumulate_grad_hook``), as Megatron's ``main_grad``: the 6 + 12/d bytes
per parameter of the cost model's table (2 + 4 + 12/d), where fp32 parameters beside the
shard's master held 10 + 8/d, and the all-gather moves 2-byte parameters, as the cost model
prices it. The sums are those of autocast over fp32 parameters: the same low-precision
gradients added in fp32. The reduce-scatter is ``reduce_scatter_tensor``; on gloo an
all-reduce of the working buffer in place, whose slice is the shard (``ZeroBucket._scatter``
says why).

- ZeRO-1 keeps the whole gradient buffer and reduce-scatters it once per step, after the
  last micro-batch (``cost.dp_sync.grad_sync_times``: a reduce-scatter of fp32 gradients
  and an all-gather of the parameters, each priced from the profile's measured figures of
  that kind); the shard is the buffer's own slice.
- ZeRO-2 without pipelining reduce-scatters each micro-batch's gradients as soon as this
  rank's backward of that micro-batch has produced all of them
  (``cost.dp_sync.sharded_microbatch_s``), asynchronously: the next micro-batch's backward
  reuses the buffer if it has completed, else takes a fresh one (never waits inside the
  backward). Only the gradient shard outlives the step; the working buffers are freed
  after it. A member of a replica with fewer micro-batches than another adds zeros for the
  missing ones, so every member issues the same collectives.
- ZeRO-2 with pipelining runs as ZeRO-1, as ``cost.sharding.deferred_sync`` prices it
  (PyTorch's pipelining defers the sharded reduction to the last micro-batch).
- ZeRO-3 layers are FSDP's (``fsdp.py``); its embedding and head use this module as ZeRO-1
  does, their whole gradients freed after the step as ZeRO-3 counts them.

A bucket is the part of a sync group this rank holds in one model chunk: the units that sit
in one chunk on every member, so that with virtual stages each bucket's gradients are
complete after one chunk's backward (every member computes the same split from the shared
layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hetplan.runtime.grad_sync import LocalParam, square_sum
from hetplan.runtime.layout import RuntimeLayout, SyncGroup
from hetplan.runtime.optim_config import OptimConfig, adamw_kwargs

STATE_KEYS = ("exp_avg", "exp_avg_sq")
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class Piece:
    """The part of one parameter inside a member's shard: parameter elements [lo, hi),
    at ``at`` in the shard."""

    index: int
    lo: int
    hi: int
    at: int


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter sits in a group's flat buffer and each member's shard."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    padded: int
    shard: int

    def pieces(self, member: int) -> list[Piece]:
        """Returns the parameter pieces inside member ``member``'s shard, in flat order."""
        lo, hi = member * self.shard, (member + 1) * self.shard
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.sizes, strict=True)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append(Piece(i, a - off, b - off, a - lo))
        return out


def flat_layout(sizes: list[int], members: int) -> FlatLayout:
    """Returns the flat layout of parameters of ``sizes`` elements over ``members`` shards:
    parameters back to back, the total padded up to a multiple of ``members``."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += n
    shard = -(-pos // members)
    return FlatLayout(tuple(offsets), tuple(sizes), shard * members, shard)


def buckets_of(layout: RuntimeLayout, sg: SyncGroup) -> list[tuple[str, ...]]:
    """Returns the units of ``sg`` split into buckets: units in one chunk on every member,
    in the group's unit order (the same answer on every rank)."""
    key_of: dict[str, tuple[int, ...]] = {}
    for u in sg.units:
        key = []
        for r in sg.ranks:
            chunks = layout.places[r].chunks
            key.append(next(i for i, c in enumerate(chunks) if u in c.sync_units()))
        key_of[u] = tuple(key)
    keys = list(dict.fromkeys(key_of.values()))
    return [tuple(u for u in sg.units if key_of[u] == k) for k in keys]


class ZeroBucket:
    """One bucket's flat buffers, shard, AdamW and collectives on this rank."""

    def __init__(
        self,
        params: list[LocalParam],
        pg: Any,
        stage: int,
        micro_batches: int,
        cfg: OptimConfig,
        low: torch.dtype | None = None,
    ) -> None:
        """``low``: the plan's low precision (bf16, fp16), in which the parameters live."""
        self.params = sorted(params, key=lambda lp: lp.name)  # the same order on every member
        self.pg, self.stage, self.micro_batches = pg, stage, micro_batches
        self.n, self.me = dist.get_world_size(pg), dist.get_rank(pg)
        self.gloo = dist.get_backend(pg) == "gloo"
        first = self.params[0].param
        if any(lp.param.dtype != torch.float32 for lp in self.params):
            raise RuntimeError("ZeRO needs fp32 parameters (autocast runs the low precision)")
        self.layout = flat_layout([lp.param.numel() for lp in self.params], self.n)
        self.mine = self.layout.pieces(self.me)
        self.lo = self.me * self.layout.shard
        self.offset_of = {
            id(lp.param): off for lp, off in zip(self.params, self.layout.offsets, strict=True)
        }
        self.low = low
        full = torch.zeros(self.layout.padded, dtype=torch.float32, device=first.device)
        with torch.no_grad():
            for lp, off in zip(self.params, self.layout.offsets, strict=True):
                full[off : off + lp.param.numel()].copy_(lp.param.reshape(-1))
            mine = full[self.lo : self.lo + self.layout.shard]
            self.flat = full if low is None else full.to(low)
            for lp, off in zip(self.params, self.layout.offsets, strict=True):
                lp.param.data = self.flat[off : off + lp.param.numel()].view_as(lp.param)
        # fp32: the shard's slice of the parameters; low precision: the shard's own copy
        self.master = torch.nn.Parameter(mine if low is None else mine.clone())
        del full, mine
        self.opt = torch.optim.AdamW([self.master], **adamw_kwargs(cfg))
        self.grads: torch.Tensor | None = None  # the whole gradient buffer
        self.shard_grad: torch.Tensor | None = None
        self.pending: tuple[Any, torch.Tensor] | None = None
        self.extra: list[tuple[Any, torch.Tensor]] = []
        """Reduce-scatters still running: earlier micro-batches', and zeros for missing ones."""
        self.keep: list[torch.Tensor] = []
        """The buffers those reduce-scatters read."""
        self.arrived = 0
        self.done = 0
        self.active = False
        for lp in self.params:
            if stage == 2:
                lp.param.register_hook(self._before_grad)
            if stage == 2 or low is not None:
                lp.param.register_post_accumulate_grad_hook(self._after_grad)

    # ---- gradients ------------------------------------------------------------------
    def _views(self, buf: torch.Tensor) -> None:
        for lp, off in zip(self.params, self.layout.offsets, strict=True):
            # low precision: the gradients are added into ``buf`` as they come (_adopt)
            view = buf[off : off + lp.param.numel()].view_as(lp.param)
            lp.param.grad = view if self.low is None else None

    def _new_grads(self) -> torch.Tensor:
        return torch.zeros(self.layout.padded, dtype=torch.float32, device=self.flat.device)

    def grad_of(self, p: torch.Tensor) -> torch.Tensor:
        """Returns ``p``'s fp32 gradient: its view of the whole buffer (ZeRO-1, after the
        backward)."""
        assert self.grads is not None
        off = self.offset_of[id(p)]
        return self.grads[off : off + p.numel()].view(p.shape)

    def start(self) -> None:
        """Before a step's backward: a zeroed gradient buffer under every parameter."""
        if self.grads is None:
            self.grads = self._new_grads()
        else:
            self.grads.zero_()
        self._views(self.grads)
        self.shard_grad = None
        self.arrived = self.done = 0
        self.pending = None
        self.extra, self.keep = [], []
        self.active = True

    def _before_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """ZeRO-2: the buffer still holds the previous micro-batch's gradients until their
        reduce-scatter completes. Done: clear it; still running: this micro-batch gets a
        fresh buffer, and the backward goes on without waiting for the group."""
        if self.active and self.pending is not None:
            work, _ = self.pending
            assert self.grads is not None
            if work.is_completed():
                self._collect()
                self.grads.zero_()
            else:
                self.extra.append(self.pending)
                self.keep.append(self.grads)
                self.pending = None
                self.grads = self._new_grads()
                self._views(self.grads)
        return grad

    def _after_grad(self, p: torch.Tensor) -> None:
        """Adds a low-precision gradient into the fp32 buffer; ZeRO-2: counts this
        micro-batch's gradients and, with all of them, reduce-scatters."""
        if not self.active:
            return
        self._adopt(p)
        if self.stage != 2:
            return
        self.arrived += 1
        if self.arrived == len(self.params):
            self.arrived = 0
            assert self.grads is not None
            self.pending = self._scatter(self.grads, async_op=True)
            self.done += 1

    def _scatter(self, buf: torch.Tensor, async_op: bool) -> tuple[Any, torch.Tensor]:
        """Starts summing ``buf`` over the group into this member's shard; returns the work
        and the tensor that then holds the shard. gloo: an all-reduce of ``buf`` in place
        (``buf`` is a working buffer), whose slice is the shard, as ``fsdp.py`` does for
        FSDP: gloo's ``reduce_scatter_tensor`` costs 1.5-1.9x its all-reduce of the same
        buffer in CPU time here (torch 2.13, 2 processes, 14 MB; docs/runtime.md)."""
        if self.gloo:
            work = dist.all_reduce(buf, group=self.pg, async_op=async_op)
            return work, buf[self.lo : self.lo + self.layout.shard]
        out = torch.empty(self.layout.shard, dtype=torch.float32, device=buf.device)
        return _reduce_scatter(out, buf, group=self.pg, async_op=async_op), out

    def _collect(self) -> None:
        assert self.pending is not None
        work, out = self.pending
        work.wait()
        self.pending = None
        if self.shard_grad is None:
            self.shard_grad = out.clone()  # ``out`` may be a view of a working buffer
        else:
            self.shard_grad.add_(out)

    def _adopt(self, p: torch.Tensor) -> None:
        """Makes sure ``p``'s gradient is its view of the buffer (autograd accumulates into
        an existing gradient in place; should it have replaced it, copy it back). Low
        precision: adds the gradient into the fp32 buffer and drops it."""
        assert self.grads is not None
        off = self.offset_of[id(p)]
        view = self.grads[off : off + p.numel()].view(p.shape)
        if self.low is not None:
            if p.grad is not None:
                view.add_(p.grad)
                p.grad = None
            return
        if p.grad is None:
            p.grad = view
        elif p.grad.data_ptr() != view.data_ptr():
            view.copy_(p.grad)
            p.grad = view

    def add_missing(self) -> None:
        """ZeRO-2, after this rank's backward: issues the reduce-scatters of zeros for the
        micro-batches its replica lacks against the group's largest replica (without
        waiting: a member still in its backward may wait on them)."""
        if self.stage != 2:
            return
        if self.arrived:
            raise RuntimeError("a micro-batch left some ZeRO-2 gradients unproduced")
        if self.pending is not None:  # summed in micro-batch order
            self.extra.append(self.pending)
            self.pending = None
        for _ in range(self.done, self.micro_batches):
            zeros = self._new_grads()
            self.keep.append(zeros)
            self.extra.append(self._scatter(zeros, async_op=True))

    def reduce(self) -> None:
        """After the backward: the summed gradient shard (ZeRO-1: one reduce-scatter;
        ZeRO-2: waits for the last micro-batch's and those of ``add_missing``, which every
        bucket of the rank must have issued first)."""
        assert self.grads is not None
        if self.stage == 2:
            for work, out in self.extra:
                self.pending = (work, out)
                self._collect()
            self.extra, self.keep = [], []
            self.active = False
        else:
            for lp in self.params:
                self._adopt(lp.param)
            _, out = self._scatter(self.grads, async_op=False)
            mine = self.grads[self.lo : self.lo + self.layout.shard]
            if out.data_ptr() != mine.data_ptr():
                mine.copy_(out)
            # ZeRO-1 keeps the whole buffer: the shard is its slice, no second copy
            self.shard_grad = mine if self.stage == 1 else mine.clone()
        if self.stage >= 2:  # only the shard outlives the step
            for lp in self.params:
                lp.param.grad = None
            self.grads = None
        self.master.grad = self.shard_grad

    def replicated_pieces(self) -> list[torch.Tensor]:
        """Returns the shard's slices of parameters replicated over tensor parallelism
        inside layers (sequence parallelism leaves their gradients partial)."""
        assert self.shard_grad is not None
        return [
            self.shard_grad[pc.at : pc.at + pc.hi - pc.lo]
            for pc in self.mine
            if self.params[pc.index].dim is None and self.params[pc.index].unit.startswith("layer_")
        ]

    def square_sum(self, tp_index: int) -> torch.Tensor:
        """Returns the squared norm of the shard's gradients, parameters replicated over
        tensor parallelism counted on TP rank 0 only."""
        assert self.shard_grad is not None
        total = torch.zeros((), dtype=torch.float64, device=self.flat.device)
        for pc in self.mine:
            if self.params[pc.index].dim is None and tp_index != 0:
                continue
            total += square_sum(self.shard_grad[pc.at : pc.at + pc.hi - pc.lo])
        return total

    # ---- the update -----------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the shard, then every member gathers the updated parameters (low
        precision: the master's rounding, 2 bytes each; gloo and NCCL take bf16 and fp16)."""
        self.opt.step()
        if self.low is None:
            _all_gather(self.flat, self.master.detach().clone(), group=self.pg)
            return
        mine = self.flat[self.lo : self.lo + self.layout.shard]
        mine.copy_(self.master)
        _all_gather(self.flat, mine.clone(), group=self.pg)

    def state_tensors(self) -> list[torch.Tensor]:
        """Returns the AdamW state and gradient shard this rank holds (low precision: with
        the fp32 master and the whole gradient buffer, which no parameter's grad shows)."""
        st = self.opt.state.get(self.master, {})
        out = [st[k] for k in STATE_KEYS if k in st]
        if self.low is not None:
            out += [self.master.detach()] + ([self.grads] if self.grads is not None else [])
        return out + ([self.shard_grad] if self.shard_grad is not None else [])

    # ---- checkpoints ----------------------------------------------------------------
    @torch.no_grad()
    def gather_state(self) -> dict[int, dict[str, Any]]:
        """Collective over the group: every parameter's whole AdamW state, by id."""
        st = self.opt.state.get(self.master, {})
        if not all(k in st for k in STATE_KEYS):
            return {}
        full = {}
        for key in STATE_KEYS:
            full[key] = self._new_grads()
            _all_gather(full[key], st[key].contiguous(), group=self.pg)
        out = {}
        for lp, off in zip(self.params, self.layout.offsets, strict=True):
            n = lp.param.numel()
            entry: dict[str, Any] = {"step": float(st["step"])}
            for key in STATE_KEYS:
                entry[key] = full[key][off : off + n].view_as(lp.param)
            out[id(lp.param)] = entry
        return out

    @torch.no_grad()
    def gather_masters(self) -> dict[int, torch.Tensor]:
        """Collective over the group: every parameter's whole fp32 master, by id (low
        precision; {} where the parameters are the masters)."""
        if self.low is None:
            return {}
        full = self._new_grads()
        _all_gather(full, self.master.detach().contiguous(), group=self.pg)
        return {
            id(lp.param): full[off : off + lp.param.numel()].view(lp.param.shape)
            for lp, off in zip(self.params, self.layout.offsets, strict=True)
        }

    @torch.no_grad()
    def load_param(self, lp: LocalParam, value: torch.Tensor) -> None:
        """Writes this rank's part of ``lp``'s fp32 ``value`` into the master shard (low
        precision; the parameter itself is set by the caller)."""
        if self.low is None:
            return
        index = next(i for i, q in enumerate(self.params) if q.param is lp.param)
        flat = value.reshape(-1)
        for pc in self.mine:
            if pc.index == index:
                src = flat[pc.lo : pc.hi].to(self.master.device, torch.float32)
                self.master.data[pc.at : pc.at + pc.hi - pc.lo].copy_(src)

    @torch.no_grad()
    def load_state(self, lp: LocalParam, state: dict[str, Any]) -> None:
        """Writes this rank's part of ``lp``'s AdamW state into the shard's."""
        st = self.opt.state[self.master]
        if not all(k in st for k in STATE_KEYS):
            st["step"] = torch.tensor(0.0)
            for key in STATE_KEYS:
                st[key] = torch.zeros_like(self.master)
        st["step"] = torch.tensor(float(state["step"]))
        index = next(i for i, q in enumerate(self.params) if q.param is lp.param)
        for pc in self.mine:
            if pc.index == index:
                for key in STATE_KEYS:
                    src = state[key].reshape(-1)[pc.lo : pc.hi]
                    st[key][pc.at : pc.at + pc.hi - pc.lo].copy_(src.to(st[key].device))
