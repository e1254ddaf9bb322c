"""Start a plan's ranks with torchrun: itself on one machine, or one command per node."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster, load_cluster
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.plan import Plan, load_plan
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.config import RunConfig, check_data_file
from hetplan.runtime.forkrun import WORKER
from hetplan.runtime.layout import build_layout, check_runtime_plan, device_order
from hetplan.runtime.support import check_plan_support, check_run_options, resolve_device


@dataclass(frozen=True)
class Checked:
    """The inputs of a run, checked before any process starts."""

    plan: Plan
    model: ModelSpec
    cluster: Cluster
    devices: list[str]
    nodes: dict[str, int]
    """Processes per node (nodes the plan uses, in cluster order)."""
    resume_step: int | None


def preflight(cfg: RunConfig) -> Checked:
    """Returns the checked inputs of ``cfg``; raises InputError on any mismatch."""
    model = cfg.model_spec()
    cluster = load_cluster(cfg.cluster)
    plan = load_plan(Path(cfg.plan), option="PLAN")
    check_runtime_plan(plan, model, cluster)
    check_run_options(cfg)
    if cfg.steps <= 0:
        raise InputError("--steps", "must be positive")
    if cfg.data is not None:
        check_data_file(Path(cfg.data), model.vocab, model.seq, plan.global_batch_size)
    if cfg.init_from is not None:
        from hetplan.runtime.hf_weights import check_init_from

        check_init_from(Path(cfg.init_from), model)
    resume_step = None
    if cfg.resume and cfg.local_dir:
        pass  # elastic: each worker verifies the shards its node holds after recovery
    elif cfg.resume:
        if not cfg.checkpoint_dir:
            raise InputError("--resume", "needs --checkpoint-dir")
        man = ckpt.verify_checkpoint(Path(cfg.checkpoint_dir), model)
        ckpt.check_batch(man, plan.global_batch_size, cfg.allow_batch_change)
        ckpt.check_resume(man.step, man.seed, cfg.steps, cfg.seed)
        resume_step = man.step
    elif cfg.checkpoint_dir and Path(cfg.checkpoint_dir).exists():
        root = Path(cfg.checkpoint_dir)
        if not root.is_dir():
            raise InputError("--checkpoint-dir", f"{root} is not a directory")
        held = ckpt.step_dirs(root)
        if held and not cfg.local_dir:  # a new run would mix its steps with the old run's
            last = held[-1][0]
            raise InputError("--checkpoint-dir", f"{root} holds checkpoints up to step "
                             f"{last}: --resume to continue, or name another folder")  # fmt: skip
    # the device last: --device auto asks torch whether CUDA is here (3 s of import), while
    # every check above needs no torch, so bad input is refused at once
    device = resolve_device(cfg.device)
    check_plan_support(plan, model, build_layout(plan, model, cluster), device)
    devices = device_order(plan, cluster)
    nodes: dict[str, int] = {}
    for d in devices:
        nodes[d.rpartition(":")[0]] = nodes.get(d.rpartition(":")[0], 0) + 1
    if device == "cuda":
        check_gpu_count(max(nodes.values()))
    return Checked(plan, model, cluster, devices, nodes, resume_step)


def check_gpu_count(processes: int) -> None:
    """Raises InputError unless this machine has a GPU for each of the processes the plan
    runs on one node (rank r of a node uses GPU r)."""
    import torch

    have = torch.cuda.device_count()
    if processes > have:
        raise InputError("--device", f"cuda: the plan runs {processes} processes on one node, "
                         f"one GPU each, and this machine has {have}")  # fmt: skip


def host_available_bytes() -> float | None:
    """Returns the memory this machine can give new processes (Linux's MemAvailable), or
    None where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0
    except OSError:
        return None
    return None


def check_host_memory(need_bytes: dict[str, float], devices: list[str]) -> None:
    """Raises InputError if the ranks of ``devices``, run as CPU processes on this machine,
    would hold more than it has available: each its model state and activations at the
    cost model's peak (``need_bytes``, per device), without the GPU's reserve. A plan made
    for GPUs otherwise starts and its ranks are killed one by one when memory runs out."""
    have = host_available_bytes()
    need = sum(need_bytes[d] for d in devices)
    if have is not None and need > have:
        raise InputError(
            "--device",
            f"cpu: the plan's {len(devices)} processes here would hold {need / 1e9:,.1f} GB of "
            f"weights, gradients, optimizer state and activations (the cost model's peaks), "
            f"and this machine has {have / 1e9:,.1f} GB available",
        )


def worker_args(cfg: RunConfig) -> list[str]:
    """Returns the worker's command-line arguments for ``cfg``."""
    out: list[str] = []
    for name, value in asdict(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out += [flag] if value else []
        elif value is not None:
            out += [flag, str(value)]
    return out


def launcher() -> list[str]:
    """Returns the first words of a command that runs torchrun's arguments here: this
    interpreter's ``forkrun`` (torchrun's launcher, the ranks forked from one import of the
    worker), never a torchrun found first on PATH."""
    return [sys.executable, "-u", "-m", "hetplan.runtime.forkrun"]


def node_commands(
    cfg: RunConfig, checked: Checked, master_addr: str, port: int = 29500
) -> list[tuple[str, list[str]]]:
    """Returns (node, torchrun command) for each node the plan uses."""
    out = []
    for i, (node, n) in enumerate(checked.nodes.items()):
        cmd = [
            "torchrun",
            f"--nnodes={len(checked.nodes)}",
            f"--node-rank={i}",
            f"--master-addr={master_addr}",
            f"--master-port={port}",
            f"--nproc-per-node={n}",
            "-m",
            WORKER,
            *worker_args(replace(cfg, on_node=node)),
        ]
        out.append((node, cmd))
    return out


def format_command(cmd: list[str]) -> str:
    """Returns ``cmd`` as one shell line."""
    return shlex.join(cmd)


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env


def run_command(
    cmd: list[str], cfg: RunConfig, timeout_s: float | None, rank0: bool = True
) -> dict[str, Any]:
    """Runs a torchrun command whose rank 0 writes cfg.result; returns that record ({} where
    ``rank0`` is False: this node's command runs other ranks, rank 0 writes on its node)."""
    proc = subprocess.run(
        cmd,
        env=_env(cfg.threads),
        stdout=None if cfg.progress else subprocess.PIPE,
        stderr=None if cfg.progress else subprocess.PIPE,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(failure_cause(proc.returncode, proc.stderr or ""))
    if cfg.result is None or not rank0:
        return {}
    record: dict[str, Any] = json.loads(Path(cfg.result).read_text())
    return record


def failure_cause(code: int, stderr: str) -> str:
    """Returns one line saying why a torchrun run failed: the first rank that failed, how
    it ended (exit code or signal) and the last error a worker printed."""
    import re
    import signal

    ranks = re.findall(r"rank\s*:\s*(\d+)", stderr)
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", stderr)
    how = f"torchrun exited with {code}"
    if ranks and codes:
        ec = int(codes[-1])
        ended = f"killed by {signal.Signals(-ec).name}" if ec < 0 else f"exited with {ec}"
        how = f"rank {ranks[-1]} {ended}"
    found = [
        ln
        for ln in stderr.splitlines()
        if re.search(r"(Error|Exception)\b.*:", ln)
        and "Traceback" not in ln
        and "ChildFailedError" not in ln
    ]
    # a worker's own error ("[rank1]: ValueError: ...") before the launcher's
    mine = [ln for ln in found if ln.startswith("[rank")] or found
    errors = [ln.split("]:", 1)[-1].strip() if ln.startswith("[rank") else ln for ln in mine]
    return f"training failed: {how}" + (f": {errors[-1]}" if errors else "")


def run_ranks(cfg: RunConfig, nproc: int, timeout_s: float | None) -> dict[str, Any]:
    """Runs ``nproc`` ranks of ``cfg`` on this machine from this process (torchrun's agent,
    the ranks forked from one import of the worker: ``forkrun.run_here``); returns rank 0's
    record (``cfg.result``). A failed run raises RuntimeError with its cause on one line;
    without ``cfg.progress`` the ranks' own output is kept from this process's."""
    from hetplan.runtime.forkrun import run_here

    assert cfg.result is not None
    with tempfile.TemporaryDirectory(prefix="hetplan-logs-") as logs:
        try:
            failures = run_here(worker_args(cfg), nproc, logs, not cfg.progress, timeout_s)
        except TimeoutError as exc:
            raise RuntimeError(f"training failed: {exc}") from None
    if failures:
        raise RuntimeError(failed_run_cause(failures, cfg.result))
    record: dict[str, Any] = json.loads(Path(cfg.result).read_text())
    return record


def failed_run_cause(failures: dict[int, Any], result: str | None = None) -> str:
    """Returns one line saying why a run failed: the rank at the root (one killed by a
    signal first: no peer's failure makes a rank die of a signal, while a dead peer makes
    the others raise; then the earliest to fail), how it ended, and the error it raised
    (torch's error file, else the one the worker wrote beside the result)."""
    import signal

    rank, f = min(failures.items(), key=lambda kv: (kv[1].exitcode >= 0, kv[1].timestamp, kv[0]))
    code = f.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    error = f.error
    if not error and result:
        with contextlib.suppress(OSError):
            error = Path(f"{result}.error.{rank}").read_text().strip()
    return f"training failed: rank {rank} {how}" + (f": {' '.join(error.split())}" if error else "")


def run_local(cfg: RunConfig, timeout_s: float | None = 600.0) -> dict[str, Any]:
    """Checks the inputs, trains on this machine through torchrun's agent, returns rank 0's
    record."""
    checked = preflight(cfg)
    with tempfile.TemporaryDirectory(prefix="hetplan-run-") as tmp:
        local = replace(cfg, result=str(Path(tmp) / "result.json"))
        return run_ranks(local, len(checked.devices), timeout_s)
