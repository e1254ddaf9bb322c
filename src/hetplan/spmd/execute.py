"""Running rank programs: one training step, gradient sync, and local multi-process runs."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
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
    """Returns the factory named 'package.module:function' or 'path/to/file.py:function'.

    A module is looked up as ``python -m`` would: the current folder first, then the
    installed packages (the console script alone would not see the current folder).
    """
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name or not fn_name.isidentifier():
        raise InputError(
            "--module", f"{spec!r} is not of the form 'package.module:factory' or 'file.py:factory'"
        )
    if mod_name.endswith(".py"):
        mod = _module_from_file(mod_name)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(mod_name)
        except ImportError as exc:
            raise InputError("--module", f"cannot import {mod_name}: {exc}") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise InputError("--module", f"{mod_name} has no callable {fn_name!r}")
    return fn


def _module_from_file(path: str) -> ModuleType:
    """Returns the module of a Python file, imported once under a name of its own."""
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise InputError("--module", f"no such file: {path}")
    name = "_hetplan_user_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise InputError("--module", f"cannot import {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    folder = os.path.dirname(full)
    if folder not in sys.path:  # the file's own imports of its neighbours, as 'python file.py'
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(mod)
    except ImportError as exc:
        del sys.modules[name]
        raise InputError("--module", f"cannot import {path}: {exc}") from None
    return mod


def checked_example(spec: str, made: Any) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """Returns a factory's result as (module, inputs), or says what is wrong with it.

    The factory returns the model and its example inputs: a tensor, or a tuple of
    tensors, that ``model(*inputs)`` takes and that yields the scalar loss.
    """
    want = "the factory returns (model, inputs): an nn.Module and a tuple of tensors"
    if not isinstance(made, tuple | list) or len(made) != 2:
        raise InputError("--module", f"{spec} returned {type(made).__name__}: {want}")
    module, inputs = made
    if not isinstance(module, torch.nn.Module):
        kind = type(module).__name__
        raise InputError("--module", f"{spec} returned a model of type {kind}: {want}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, tuple | list):
        raise InputError("--module", f"{spec} returned {type(inputs).__name__} inputs: {want}")
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise InputError(
                "--module", f"{spec}: input {i} is of type {type(x).__name__}; inputs are tensors"
            )
    try:
        inspect.signature(module.forward).bind(*inputs)
    except TypeError as exc:
        raise InputError(
            "--module", f"{spec}: its model's forward does not take the {len(inputs)} inputs: {exc}"
        ) from None
    except ValueError:  # no signature to read: the traced call says
        pass
    return module, tuple(inputs)


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

    A case names a 'factory' ('pkg.mod:fn', with 'kwargs'), a 'seed' and a 'program'. The
    ranks fork from this process's fork server (``runtime.forkrun.start_server``: torch
    imported once, kept for later runs) instead of each importing torch anew.
    """
    from hetplan.runtime.forkrun import start_server

    start_server()
    ctx = mp.get_context("forkserver")
    queue = ctx.SimpleQueue()
    procs = mp.start_processes(
        _equivalence_worker,
        args=(world, free_port(), cases, queue),
        nprocs=world,
        join=False,
        start_method="forkserver",
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
