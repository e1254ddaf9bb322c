"""Per-rank entry point: synthesise on rank 0, broadcast, train (``run``: a rank forked by
``hetplan spmd run``; ``main``: a rank torchrun starts)."""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from hetplan.cluster import load_cluster
from hetplan.runtime.teardown import leave_and_exit
from hetplan.spmd import throttle
from hetplan.spmd.capture import capture
from hetplan.spmd.cli import build_example
from hetplan.spmd.codegen import build_rank_module, shard_inputs
from hetplan.spmd.costmodel import devices_from_cluster
from hetplan.spmd.execute import env_rank, train_step
from hetplan.spmd.program import Program
from hetplan.spmd.synth import plan_at, synthesize


def main() -> None:
    """Entry point of one rank under torchrun: ``run``, then leave the process."""
    run(sys.argv[1:])
    leave_and_exit(0)


def run(argv: list[str] | None = None) -> None:
    """Runs ``--steps`` SGD steps of the synthesised program on this rank, then leaves the
    process group (rank 0 prints each step and the median step time)."""
    ap = argparse.ArgumentParser(prog="hetplan.spmd.launch")
    ap.add_argument("--module", required=True)
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--inputs", default="")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", default="")
    ap.add_argument("--duty", default="", help="per-rank CPU duty cycle, e.g. 1,0.5")
    ap.add_argument("--program", default="synth", choices=("synth", "dp-ev", "dp-cp"))
    args = ap.parse_args(argv)
    rank, world = env_rank()
    if args.threads:
        torch.set_num_threads(int(args.threads.split(",")[rank % len(args.threads.split(","))]))
    watcher = None
    if args.duty:
        duties = args.duty.split(",")
        watcher = throttle.start(float(duties[rank % len(duties)]))
    # the program's modules and inputs are CPU tensors, which NCCL does not take: gloo, on a
    # GPU machine too
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    module, inputs = build_example(args.module, args.inputs)
    cap = capture(module, inputs)
    box = [None]
    if rank == 0:
        cluster = load_cluster(args.cluster)
        devs = devices_from_cluster(cluster, devices=list(cluster.devices())[:world])
        if args.program == "synth":
            box = [synthesize(cap, devs).program]  # type: ignore[list-item]
        else:
            b = devs.even() if args.program == "dp-ev" else devs.flops_proportional()
            res = plan_at(cap, devs, b, "dp", memory_limit=False)
            box = [Program(res.instrs, b, devs.names)]  # type: ignore[list-item]
    dist.broadcast_object_list(box, src=0)
    program = box[0]
    assert program is not None
    mod = build_rank_module(cap, program, rank)
    local = shard_inputs(mod, cap, inputs, program.ratios)
    opt = torch.optim.SGD(mod.parameters(), lr=0.01)
    times = []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        loss = train_step(mod, local)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step} loss {loss:.6f} time {times[-1]:.4f} s", flush=True)
    if rank == 0 and len(times) > 1:
        ratios = ",".join(f"{r:.4f}" for r in program.ratios)
        steady = sorted(times[1:])[len(times[1:]) // 2]
        print(f"program {args.program} ratios {ratios} median step {steady:.4f} s", flush=True)
    if watcher is not None:
        watcher.terminate()
        watcher.wait(timeout=5)
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
