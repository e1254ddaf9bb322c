"""The per-rank training loop; torchrun runs it as ``python -m hetplan.runtime.worker``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from contextlib import suppress
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hetplan.cluster import load_cluster
from hetplan.cost.sharding import deferred_sync
from hetplan.plan import load_plan
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.config import RunConfig
from hetplan.runtime.data import TokenSource
from hetplan.runtime.fsdp import is_sharded
from hetplan.runtime.grad_sync import LocalParam, local_params
from hetplan.runtime.layout import EMBED, HEAD, RuntimeLayout, build_layout, device_order
from hetplan.runtime.memory_meter import MemoryMeter
from hetplan.runtime.model_torch import Features, StageModel, init_params
from hetplan.runtime.optim import PlanOptimizer
from hetplan.runtime.pipeline import build_schedule, make_loss_fn, run_step
from hetplan.runtime.precision import (
    LossScaler,
    LowParams,
    autocast_dtype,
    set_matmul_precision,
)
from hetplan.runtime.state import gather_unit, load_unit, restore_unit, save_unit
from hetplan.runtime.teardown import leave_and_exit

log = logging.getLogger(__name__)


def _devices(cfg: RunConfig, rank: int, world: int, order: list[str]) -> list[str]:
    """Returns the plan device of every rank, agreed through an all-gather."""
    if cfg.on_node is None:
        mine = order[rank]
    else:
        local = [d for d in order if d.rpartition(":")[0] == cfg.on_node]
        mine = local[int(os.environ.get("LOCAL_RANK", "0"))]
    names: list[Any] = [None] * world
    dist.all_gather_object(names, mine)
    return [str(n) for n in names]


class Trainer:
    """One rank's share of the plan: its model chunks, optimizer, schedule and groups."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.model = cfg.model_spec()
        self.cluster = load_cluster(cfg.cluster)
        self.plan = load_plan(Path(cfg.plan))
        self.rank, world = dist.get_rank(), dist.get_world_size()
        order = device_order(self.plan, self.cluster)
        if world != len(order):
            raise RuntimeError(f"plan needs {len(order)} processes, torchrun started {world}")
        self.layout: RuntimeLayout = build_layout(
            self.plan, self.model, self.cluster, _devices(cfg, self.rank, world, order)
        )
        groups = {r: dist.new_group(list(r)) for r in self.layout.all_groups()}
        self.place = place = self.layout.places[self.rank]
        self.tp_group = groups[place.tp_ranks] if place.tp > 1 else None
        self.sync = [(g, groups[g.ranks]) for g in self.layout.sync_groups if self.rank in g.ranks]
        self.device = _device(cfg.device)
        set_matmul_precision(self.plan.precision, self.device)
        plan = self.plan
        init = None
        if cfg.init_from:  # checked by the launcher; its numerics hold when resuming too
            from hetplan.runtime.hf_weights import open_init

            init = open_init(Path(cfg.init_from), self.model)
        self.features = Features(
            precision=plan.precision,
            recompute=plan.recompute,
            flash_attention=plan.flash_attention,
            sequence_parallel=plan.sequence_parallel and place.tp > 1,
            dropout=cfg.dropout,
            **({"norm_eps": init.norm_eps, "rope_theta": init.rope_theta} if init else {}),
        )
        self.modules = []
        for c in place.chunks:
            m = StageModel(self.model, c, place.tp, place.tp_index, self.tp_group, self.features)
            init_params(m, cfg.seed, place.tp, place.tp_index)
            self.modules.append(m)
        if init is not None and not cfg.resume:
            from hetplan.runtime.hf_weights import load_init

            load_init(self.modules, init, self.model, place.tp, place.tp_index)
        self.modules = [m.to(self.device) for m in self.modules]
        # bf16/fp16: the modules run on 2-byte parameters, the optimizer steps fp32 masters
        # (ZeRO-1/2: the shard's, zero.py; ZeRO-3 layers: FSDP's shards; else whole)
        self.low = autocast_dtype(plan.precision)
        if plan.zero_stage == 3:
            from hetplan.runtime.fsdp import shard_layers

            # with a multi-stage pipeline: gathered once, synced at the last backward
            shard_layers(list(self.modules), self.sync, self.device, deferred_sync(plan), self.low)
        # dropout masks: equal on a stage's TP ranks (they hold the same activations), and
        # drawn afresh each step from (seed, replica, stage, step), so a resumed run draws
        # the masks the uninterrupted run drew (``train_step``)
        self.dropout_seed = cfg.seed * 1_000_003 + 7919 * place.replica + place.stage + 1
        self.params: list[LocalParam] = local_params(list(self.modules))
        self.scaler = LossScaler(plan.precision == "fp16")
        self.opt = PlanOptimizer(
            self.params,
            self.sync,
            plan.zero_stage,
            cfg.optim(),
            self.layout,
            place,
            self.tp_group,
            self.features.sequence_parallel,
            self.scaler,
            self.device,
            deferred=deferred_sync(plan),  # pipelined ZeRO-2 as the cost model prices it
            low=self.low,
        )
        # activations counted in the warm-up steps (at least the first): the timed ones
        # run without the meter's hooks
        hooked = max(cfg.warmup_steps, 1)
        self.low_params: LowParams | None = None
        if self.low is not None:
            rest = [
                lp.param
                for lp in self.params
                if id(lp.param) not in self.opt.bucket_of and not is_sharded(lp.param)
            ]
            self.low_params = LowParams(list(self.modules), rest, self.low)
        low_held = self.low_params.tensors() if self.low_params is not None else []
        self.meter = MemoryMeter(self.device, [lp.param for lp in self.params] + low_held, hooked)
        self.step, self.position = 0, 0
        self.elastic: Any = None
        if cfg.local_dir:
            from hetplan.elastic.node_ckpt import NodeCheckpointer

            self.elastic = NodeCheckpointer(self, cfg.local_dir, cfg.storage)
        if cfg.resume and self.elastic is not None:
            self.elastic.restore()
        elif cfg.resume and cfg.checkpoint_dir:
            self._restore(Path(cfg.checkpoint_dir))
        if self.low_params is not None:  # the masters as restored
            self.low_params.refresh()
        if cfg.checkpoint_dir and self.elastic is None:
            if self.rank == 0:
                for stale in ckpt.clean_staging(Path(cfg.checkpoint_dir)):
                    log.warning("removed %s, left by an interrupted save", stale)
            dist.barrier()
        self.data = TokenSource(
            self.model.vocab, self.model.seq, cfg.seed, Path(cfg.data) if cfg.data else None
        )
        loss_fn = make_loss_fn(self.plan.micro_batch_size, self.plan.global_batch_size, self.scaler)
        pp_group = groups[place.pp_ranks]
        self.sched = build_schedule(
            self.plan.schedule,
            place,
            list(self.modules),
            self.device,
            pp_group,
            loss_fn,
            self.model,
            self.plan.precision,
            deferred_zero3=plan.zero_stage == 3 and deferred_sync(plan),
            act_dtype=self.low or torch.float32,
        )

    def _units(self) -> list[str]:
        return list(dict.fromkeys(u for c in self.place.chunks for u in c.units()))

    def _restore(self, root: Path) -> None:
        man = ckpt.verify_checkpoint(root, self.model)
        ckpt.check_batch(man, self.plan.global_batch_size, self.cfg.allow_batch_change)
        for unit in self._units():
            mine = [lp for lp in self.params if lp.unit == unit]
            state = load_unit(man.path / f"{unit}.pt")
            restore_unit(state, mine, self.opt, self.place.tp, self.place.tp_index)
        self.step, self.position = man.step, man.data_position

    def train_step(self) -> dict[str, Any]:
        """Runs one optimizer step on the next global batch; returns the global mean loss,
        the gradient norm, the learning rate and whether an fp16 overflow skipped it."""
        place = self.place
        inputs, targets = self.data.batch(self.position + place.batch_offset, place.batch_size)
        self.opt.zero_grad()
        scale = self.scaler.scale
        torch.manual_seed(self.dropout_seed + 104_729 * self.step)
        with self.meter.step():
            local = run_step(self.sched, place, inputs.to(self.device), targets.to(self.device))
        info = self.opt.step(self.step + 1)
        if self.low_params is not None:
            self.low_params.refresh()
        held = [lp.param for lp in self.params] + self.opt.state_tensors()
        held += self.low_params.tensors() if self.low_params is not None else []
        self.meter.note_static(
            held + [p.grad for p in held[: len(self.params)] if p.grad is not None]
        )
        counted = local / scale if place.tp_index == 0 else 0.0
        loss = torch.tensor([counted], dtype=torch.float64, device=self.device)
        dist.all_reduce(loss)
        self.step += 1
        self.position += self.plan.global_batch_size
        return {"loss": float(loss.item()), **info}

    def save(self, root: Path) -> None:
        """Writes a checkpoint of the current step (collective over all ranks)."""
        self.opt.materialize()
        if self.elastic is not None:
            self.elastic.save()
            return
        flag: list[Any] = [None]
        if self.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            flag[0] = ckpt.begin(root, self.step)
        dist.broadcast_object_list(flag, src=0)
        if not flag[0]:
            return
        stage = ckpt.staging_dir(root, self.step)
        files: dict[str, str] = {}
        for unit in self._units():
            owner = self.layout.owner(unit)
            if self.rank not in owner.tp_ranks:
                continue
            mine = [lp for lp in self.params if lp.unit == unit]
            state = gather_unit(mine, self.opt, self.place.tp, self.tp_group)
            if self.rank == owner.rank:
                path = stage / f"{unit}.pt"
                save_unit(path, state)
                files[path.name] = ckpt.sha256_file(path)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, files)
        if self.rank == 0:
            merged = {k: v for part in gathered for k, v in part.items()}
            ckpt.commit(
                root,
                self.step,
                self.position,
                self.cfg.seed,
                self.model,
                merged,
                global_batch=self.plan.global_batch_size,
                keep=self.cfg.keep,
            )
        dist.barrier()


def _device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_distributed(name: str) -> torch.device:
    """Joins the process group on this rank's device and returns it: NCCL on CUDA, this rank's
    GPU (LOCAL_RANK) made current first, since NCCL's barrier and object collectives use the
    current device, GPU 0 on every rank until set (PyTorch's torch.distributed docs); gloo
    on the CPU."""
    device = _device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    return device


def train(cfg: RunConfig) -> dict[str, Any]:
    """Runs training on this rank (process group already initialised); returns the record."""
    tr = Trainer(cfg)
    steps: list[dict[str, Any]] = []
    progress = _progress(cfg.steps - tr.step) if cfg.progress and tr.rank == 0 else None
    tokens = tr.plan.global_batch_size * tr.model.seq
    while tr.step < cfg.steps:
        t0 = time.perf_counter()
        info = tr.train_step()
        dt = time.perf_counter() - t0
        loss = info["loss"]
        entry = {"step": tr.step, "time_s": dt, "tokens_per_s": tokens / dt, **info}
        steps.append(entry)
        if tr.rank == 0 and cfg.result:
            with open(cfg.result + ".steps", "a") as log_file:  # read after a failure
                log_file.write(json.dumps(entry) + "\n")
        if progress is not None:
            progress[0].update(progress[1], advance=1, loss=loss, dt=dt, tps=tokens / dt)
        every = cfg.checkpoint_every
        root = cfg.checkpoint_dir or cfg.local_dir
        if root and (tr.step == cfg.steps or (every and tr.step % every == 0)):
            tr.save(Path(root))
    if tr.elastic is not None:
        tr.elastic.finish()
    if progress is not None:
        progress[0].stop()
    timed = [s["time_s"] for s in steps[cfg.warmup_steps :]] or [s["time_s"] for s in steps]
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, (tr.place.device, tr.meter.peak_bytes(), torch.get_num_threads()))
    measured = statistics.median(timed) if timed else None
    return {
        "steps": steps,
        "peak_memory_bytes": {device: peak for device, peak, _ in peaks},
        "threads": {device: threads for device, _, threads in peaks},
        "tokens_per_s": tokens / measured if measured else None,
        "measured_step_time_s": measured,
        "final_step": tr.step,
        "world_size": dist.get_world_size(),
    }


def _progress(total: int) -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    bar = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[dt]:.3f} s/step  {task.fields[tps]:,.0f} tok/s"),
        TextColumn("loss {task.fields[loss]:.4f}"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
    )
    task = bar.add_task("train", total=total, loss=float("nan"), dt=0.0, tps=0.0)
    bar.start()
    return bar, task


def _parse(argv: list[str] | None) -> RunConfig:
    ap = argparse.ArgumentParser(prog="hetplan.runtime.worker")
    defaults = RunConfig("", "", "")
    for name, value in asdict(defaults).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action="store_true")
        elif name in ("plan", "model", "cluster"):
            ap.add_argument(flag, required=True)
        else:
            kind = type(value) if value is not None else str
            ap.add_argument(flag, type=kind, default=value)
    return RunConfig(**vars(ap.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    """Entry point of one rank under torchrun."""
    run(argv)
    leave_and_exit(0)


def run(argv: list[str] | None = None) -> None:
    """Runs one rank to its end and leaves the process group (torchrun's ranks, and those
    ``forkrun`` forks); on failure writes the cause beside the result first."""
    cfg = _parse(argv)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    init_distributed(cfg.device)
    try:
        record = train(cfg)
        if dist.get_rank() == 0 and cfg.result:
            ckpt.write_atomic(Path(cfg.result), json.dumps(record).encode())
    except BaseException as exc:
        if cfg.result:  # the cause, for a launcher that does not read this rank's stderr
            with suppress(OSError):
                cause = " ".join(f"{type(exc).__name__}: {exc}".split())
                Path(f"{cfg.result}.error.{dist.get_rank()}").write_text(cause)
        dist.destroy_process_group()
        raise
    dist.destroy_process_group()


__all__ = ["EMBED", "HEAD", "RunConfig", "Trainer", "main", "run", "train"]

if __name__ == "__main__":
    main()
