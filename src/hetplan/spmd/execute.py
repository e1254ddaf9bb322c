"""Running rank programs: one training step, gradient sync, and local multi-process runs."""

from __future__ import annotations

import importlib
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetplan.errors import InputError
from hetplan.runtime.teardown import leave_and_exit
from hetplan.spmd.capture import Captured, capture
from hetplan.spmd.codegen import RankModule, build_rank_module, local_sizes, shard_inputs
from hetplan.spmd.program import Program
from hetplan.spmd.runtime import _gather

Factory = Callable[..., tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]


def load_factory(spec: str) -> Factory:
    """Returns the factory named 'package.module:function'."""
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise InputError("--module", f"{spec!r} is not of the form 'package.module:factory'")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise InputError("--module", f"cannot import {mod_name}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise InputError("--module", f"{mod_name} has no callable {fn_name!r}")
    return fn


def free_port() -> int:
    """Returns a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sync_grads(mod: RankModule) -> None:
    """All-reduces the (partial) gradients of the replicated parameters."""
    params = mod.local_params()
    for name in mod.grad_sync:
        p = params[name]
        if p.grad is None:  # this rank's use was masked out: it contributes zeros
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def train_step(mod: RankModule, local_inputs: Sequence[torch.Tensor]) -> float:
    """Runs forward and backward, syncs gradients, and returns the global loss."""
    loss = mod(*local_inputs)
    loss.backward()
    sync_grads(mod)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total)


def full_grads(mod: RankModule, cap: Captured, ratios: Sequence[float]) -> dict[str, torch.Tensor]:
    """Returns every parameter's whole gradient, by module path (collective: all ranks)."""
    out = {}
    for name, p in mod.local_params().items():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        lay = mod.param_layouts[name]
        if lay.kind == "S":
            g = _gather(g.contiguous(), lay.dim, local_sizes(cap.node(name), lay, ratios), "padded")
        out[mod.param_paths[name]] = g.detach().clone()
    return out


def _equivalence_worker(
    rank: int, world: int, port: int, cases: list[dict[str, Any]], queue: Any
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        for case in cases:
            torch.manual_seed(case["seed"])
            module, inputs = load_factory(case["factory"])(**case.get("kwargs", {}))
            cap = capture(module, inputs)
            program: Program = case["program"]
            mod = build_rank_module(cap, program, rank)
            loss = train_step(mod, shard_inputs(mod, cap, inputs, program.ratios))
            grads = full_grads(mod, cap, program.ratios)
            if rank == 0:
                queue.put((case["name"], loss, {k: v.numpy() for k, v in grads.items()}))
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_and_exit(0)


def run_distributed(
    cases: list[dict[str, Any]], world: int, timeout_s: float = 120.0
) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """Runs each case's program on ``world`` local gloo ranks; returns rank 0's results.

    A case names a 'factory' ('pkg.mod:fn', with 'kwargs'), a 'seed' and a 'program'.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _equivalence_worker,
        args=(world, free_port(), cases, queue),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout_s
    results: dict[str, tuple[float, dict[str, torch.Tensor]]] = {}
    while len(results) < len(cases):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise TimeoutError("distributed run timed out")
        if not queue.empty():
            name, loss, grads = queue.get()
            results[name] = (loss, {k: torch.from_numpy(v) for k, v in grads.items()})
            continue
        if procs.join(timeout=0.05):
            break
    while not procs.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in procs.processes:
                p.kill()
            raise TimeoutError("distributed run did not exit")
    while not queue.empty():
        name, loss, grads = queue.get()
        results[name] = (loss, {k: torch.from_numpy(v) for k, v in grads.items()})
    return results


def reference(
    factory: str, kwargs: dict[str, Any], seed: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """Returns the single-device loss and gradients of a factory's model."""
    torch.manual_seed(seed)
    module, inputs = load_factory(factory)(**kwargs)
    loss = module(*inputs)
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None
    }


def env_rank() -> tuple[int, int]:
    """Returns (rank, world size) from the torchrun environment."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
