"""Leaving a process group without the interpreter's shutdown racing gloo's threads.

A gloo rank that returns normally after ``destroy_process_group`` can still abort
("terminate called without an active exception", SIGABRT) while the interpreter tears
down: the transport's worker threads may outlive the objects they hold. A rank that has
finished its work, flushed its output and left the group has nothing left to run, so it
ends with ``os._exit`` and skips that teardown. Only for processes started to be ranks
(spawned workers, torchrun entry points), never a process that hosts other work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch.distributed as dist


def leave_and_exit(code: int = 0) -> None:
    """Destroys the default process group (if any), flushes stdio, ends the process."""
    if dist.is_initialized():
        dist.destroy_process_group()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
