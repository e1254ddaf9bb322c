"""torchrun with the ranks forked from one process that has imported the worker.

``torchrun -m hetplan.runtime.worker`` starts every rank as a new interpreter, and each
imports torch and ``torch.distributed.pipelining`` (which pulls DTensor, FSDP and
``torch._dynamo``) before it computes anything: about 6 CPU seconds a rank on a laptop-class
core, paid again by every rank of every run. This entry point takes torchrun's own
arguments (``torch.distributed.run.parse_args``) and runs torchrun's own launcher
(``elastic_launch``: the same rendezvous, agent, monitoring and failure report) with the
worker as a Python entry point started by ``forkserver``: one server process imports the
worker once, before any rank exists, and forks each rank from it. Nothing is initialised
at import (no CUDA context, no process group, no thread pool), so each forked rank joins its
group and picks its device as a torchrun rank does; CUDA and NCCL are safe under
``forkserver`` (PyTorch's multiprocessing notes).

    python -m hetplan.runtime.forkrun --standalone --nproc-per-node=4 \\
        -m hetplan.runtime.worker --plan ...
"""

from __future__ import annotations

import sys
import uuid

WORKER = "hetplan.runtime.worker"


def main(argv: list[str] | None = None) -> None:
    """Runs the ranks torchrun's arguments ``argv`` describe (the script must be the worker
    module, ``-m hetplan.runtime.worker``)."""
    start_server()  # it imports the worker while this process imports torch's launcher
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv if argv is not None else sys.argv[1:])
    if not args.module or args.training_script != WORKER:
        raise SystemExit(f"forkrun runs -m {WORKER} only")
    if args.standalone:  # as torchrun.run does: a local c10d rendezvous on a free port
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = "forkserver"
    config, _, _ = torchrun.config_from_args(args)
    elastic_launch(config=config, entrypoint=run_rank)(list(args.training_script_args))


def start_server() -> None:
    """Starts this process's fork server (once), importing the worker; ranks started with
    ``start_method="forkserver"`` are forked from it."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload([WORKER])
    forkserver.ensure_running()


def run_rank(argv: list[str]) -> None:
    """One forked rank: the worker's run, returning to the launcher's wrapper (which reports
    the outcome, then ends the process with ``os._exit``: no interpreter teardown)."""
    from hetplan.runtime.worker import run  # preloaded in the server: no import here

    apply_thread_count()
    run(argv)


def apply_thread_count() -> None:
    """Gives this forked rank the intra-op threads its ``OMP_NUM_THREADS`` asks (torchrun's
    launcher sets 1 a rank where several share a machine and the user set none). A process
    that execs reads the variable as OpenMP loads; a rank forked from a server that has
    imported torch inherits the server's count instead (as many as the machine's cores:
    with ``--threads 0`` four ranks on two cores ran eight threads, 19 CPU seconds for a
    two-step run that takes 14 on one thread a rank). ``--threads`` above 0 overrides it."""
    import os

    import torch

    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        torch.set_num_threads(int(first))


if __name__ == "__main__":
    main()
