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

On one machine ``run_here`` does the same from the calling process, with no launcher process
at all: its fork server is started once and kept, so every later run of that process (a
test suite's, an elastic run's recoveries) forks its ranks without importing anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

WORKER = "hetplan.runtime.worker"
SPMD_WORKER = "hetplan.spmd.launch"
"""The SPMD ranks' module (``hetplan spmd run``; it imports ``spmd.execute``, whose
``run_distributed`` forks the equivalence ranks): one server, started by whichever comes
first, serves both (its preloads are fixed when it starts)."""


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


@dataclass(frozen=True)
class Failure:
    """How one rank of a run ended: its exit code (-N: killed by signal N), the error it
    raised ("" where it raised none: a signal, ``os._exit``) and when, in whole seconds
    (torch's, to find the first to fail)."""

    exitcode: int
    error: str
    timestamp: int


SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
"""The signals torch's agent turns into ``SignalException`` while it runs (its default
``TORCHELASTIC_SIGNALS_TO_HANDLE``): their handlers are this process's own again after."""


def run_here(
    argv: list[str],
    nproc: int,
    log_dir: str,
    quiet: bool = True,
    timeout_s: float | None = None,
    entry: Callable[[list[str]], None] | None = None,
) -> dict[int, Failure]:
    """Runs ``nproc`` ranks of the worker with arguments ``argv`` on this machine under
    torchrun's elastic agent (a c10d rendezvous on a free local port, as ``--standalone``),
    from this process: the ranks fork from its server (``start_server``, started once and
    kept). Returns {} when every rank succeeded, else {rank: Failure} for those that failed.

    ``quiet``: each rank's stdout and stderr go to files under ``log_dir`` (else to this
    process's own, as the fork server inherited them). Where ``OMP_NUM_THREADS`` is unset
    and several ranks share the machine, each gets 1, as torchrun gives. ``timeout_s`` (on
    the main thread): the ranks are stopped after that many seconds and TimeoutError
    raised. The agent's log lines are kept from this process's stderr; the signal handlers
    it installs are undone. ``entry``: the rank's function (default ``run_rank``, the
    training worker; ``run_spmd_rank`` for ``hetplan spmd run``)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    start_server()
    conf = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.05,
        start_method="forkserver",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL if quiet else Std.NONE),
    )
    threads = {"OMP_NUM_THREADS": "1"} if nproc > 1 and "OMP_NUM_THREADS" not in os.environ else {}
    with _environ(threads), _quiet_agent(), _own_signals(), _deadline(timeout_s) as expired:
        failures: dict[int, Failure] = {}
        try:
            elastic_launch(conf, entry or run_rank)(list(argv))
        except ChildFailedError as exc:
            failures = {
                int(rank): Failure(f.exitcode, _raised(f), f.timestamp)
                for rank, f in exc.failures.items()
            }
        except SignalException:
            if expired:
                raise TimeoutError(
                    f"no result after {timeout_s:g} s: the ranks were stopped"
                ) from None
            raise KeyboardInterrupt from None
    return failures


def _raised(failure: Any) -> str:
    """Returns the error a failed rank raised ("Type: text", from the error file torch's
    ``record`` wrote), or "" where it wrote none (killed, or it ended before raising)."""
    if not os.path.isfile(failure.error_file):
        return ""
    message = failure.message  # the file's "message": the text, or {"message": text, ...}
    if isinstance(message, dict):
        message = message.get("message", "")
    return " ".join(str(message).split())


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Sets ``values`` in this process's environment (the agent copies ``OMP_NUM_THREADS``
    into each rank's) for the block, then restores it."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """Keeps the agent's and the launcher's log records (closing signals sent, a failure
    table) off this process's stderr: the caller states the outcome on one line."""
    names = [n for n in logging.root.manager.loggerDict
             if n.startswith(("torch.distributed", "torch.multiprocessing"))]  # fmt: skip
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before, strict=True):
            lg.disabled = was


@contextlib.contextmanager
def _own_signals() -> Iterator[None]:
    """Restores this process's handlers of the signals the agent takes over (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kinds = [getattr(signal, name) for name in SIGNALS if hasattr(signal, name)]
    before = {k: signal.getsignal(k) for k in kinds}
    try:
        yield
    finally:
        for k, handler in before.items():
            signal.signal(k, handler)


@contextlib.contextmanager
def _deadline(timeout_s: float | None) -> Iterator[list[bool]]:
    """Within the block, after ``timeout_s`` raises torch's ``SignalException`` (SIGTERM) in
    the main thread, which the agent answers by stopping the ranks; yields a flag list,
    non-empty once that happened. No deadline off the main thread or without a timeout."""
    expired: list[bool] = []
    if timeout_s is None or threading.current_thread() is not threading.main_thread():
        yield expired
        return
    from torch.distributed.elastic.multiprocessing import SignalException

    def expire(signum: int, frame: object) -> None:
        expired.append(True)
        raise SignalException(f"no result after {timeout_s} s", sigval=signal.SIGTERM)

    before = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(timeout_s, 1e-3))
    try:
        yield expired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def start_server() -> None:
    """Starts this process's fork server (once), importing the training worker and the
    SPMD one; ranks started with ``start_method="forkserver"`` are forked from it."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload([WORKER, SPMD_WORKER])
    forkserver.ensure_running()


def run_rank(argv: list[str]) -> None:
    """One forked rank: the worker's run, returning to the launcher's wrapper (which reports
    the outcome, then ends the process with ``os._exit``: no interpreter teardown)."""
    from hetplan.runtime.worker import run  # preloaded in the server: no import here

    prepare_rank()
    run(argv)


def run_spmd_rank(argv: list[str]) -> None:
    """One forked rank of ``hetplan spmd run`` (``spmd.launch.run``), as ``run_rank``."""
    from hetplan.spmd.launch import run  # preloaded in the server

    prepare_rank()
    run(argv)


def prepare_rank() -> None:
    """Readies a forked rank before its run: its thread count (``apply_thread_count``) and
    tqdm's lock (``thread_lock_for_tqdm``)."""
    apply_thread_count()
    thread_lock_for_tqdm()


def thread_lock_for_tqdm() -> None:
    """Gives tqdm a thread lock where it has none yet. torch.fx's ``Interpreter.run`` (the
    SPMD capture) builds a progress bar, disabled or not, and tqdm's first bar makes its
    global lock with a ``multiprocessing.RLock``: a named semaphore, which a rank forked
    from the server registers with the resource tracker it shares with the launching
    process. A rank stopped mid-run (a peer failed) never unregisters it, and the tracker
    then printed "leaked semaphore objects" after the run's one-line cause. A rank draws
    no bars beside other processes', so a thread lock serves it."""
    try:
        from tqdm import tqdm
    except ImportError:  # torch falls back to its own stand-in, which takes no lock
        return
    if "_lock" not in vars(tqdm):
        tqdm.set_lock(threading.RLock())


def apply_thread_count() -> None:
    """Gives this forked rank the intra-op threads its ``OMP_NUM_THREADS`` asks (torchrun's
    launcher sets 1 a rank where several share a machine and the user set none). A process
    that execs reads the variable as OpenMP loads; a rank forked from a server that has
    imported torch inherits the server's count instead (as many as the machine's cores:
    with ``--threads 0`` four ranks on two cores ran eight threads, 19 CPU seconds for a
    two-step run that takes 14 on one thread a rank). ``--threads`` above 0 overrides it."""
    import torch

    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        torch.set_num_threads(int(first))


if __name__ == "__main__":
    main()
