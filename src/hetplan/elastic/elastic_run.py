"""An elastic run: torchrun's elastic agent runs the plan's workers; when one is killed (a
preemption), the agent stops the survivors, and this supervisor replans on the nodes that
remain, executes the recovery plan (peer copies, storage downloads, checksums verified) and
starts the workers again from the recovered step under the new plan."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hetplan.cluster import Cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.elastic.placement import node_of, node_shards, shard_bytes
from hetplan.elastic.recovery import RecoveryProblem, plan_recovery
from hetplan.elastic.replan import replan
from hetplan.elastic.storage import ShardStore
from hetplan.elastic.transfer import (
    Throttle,
    complete_storage,
    execute,
    measured_file_latency_s,
    measured_hash_bytes_per_s,
    survey,
)
from hetplan.errors import InputError
from hetplan.runtime.checkpoint import check_resume
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import preflight, worker_args

log = logging.getLogger(__name__)


def launch_workers(cfg: RunConfig, nproc: int, log_dir: str) -> dict[int, int]:
    """Runs the workers under torchrun's elastic agent, forked from this process's server
    (``forkrun.run_here``: every recovery's ranks fork from the same imported worker);
    returns {} on success, else the exit code of every failed rank (a preempted one was
    killed: -SIGKILL). Their output is this process's."""
    from hetplan.runtime.forkrun import run_here

    failures = run_here(worker_args(cfg), nproc, log_dir, quiet=False)
    return {rank: f.exitcode for rank, f in failures.items()}


def open_store(url: str) -> ShardStore:
    """Returns the shard store at ``url``; one that cannot be used names --storage."""
    try:
        store = ShardStore(url)
    except (ValueError, ImportError) as exc:  # unknown protocol, missing fsspec backend
        raise InputError("--storage", f"cannot use {url}: {exc}") from None
    if store.fs is None and Path(store.url).exists() and not Path(store.url).is_dir():
        raise InputError("--storage", f"{url} is not a directory")
    return store


def check_elastic_checkpoints(cfg: RunConfig, store: ShardStore, local_root: Path) -> None:
    """Refuses, before any process starts, what the plain checkpoint path refuses: a new run
    into a store or local folder holding another run's steps, and a resume with nothing
    left to train or another seed (``launch.preflight`` for --checkpoint-dir)."""
    latest = store.latest_step()
    if not cfg.resume:
        if latest is not None:
            raise InputError("--storage", f"{cfg.storage} holds checkpoints up to step "
                             f"{latest}: --resume to continue, or name another store")  # fmt: skip
        held = sorted(local_root.glob("*/step_*")) if local_root.is_dir() else []
        if held:
            raise InputError("--local-dir", f"{local_root} holds checkpoints ({held[-1].name}"
                             " on a node): --resume to continue, or name another")  # fmt: skip
        return
    man = None if latest is None else store.manifest(latest)
    if man is not None:
        check_resume(int(man["step"]), int(man.get("seed", cfg.seed)), cfg.steps, cfg.seed)


def run_elastic(
    cfg: RunConfig,
    storage_bytes_per_s: float,
    max_recoveries: int = 3,
    emulate_bandwidth: bool = True,
    params: CostParams | None = None,
) -> dict[str, Any]:
    """Trains ``cfg`` elastically until ``cfg.steps``; returns the last attempt's record with
    every recovery (lost nodes, step, bytes by source, predicted and measured times).
    ``params``: the cost model's terms (with a measured profile: ``load_cost``) that check
    the plan fits and score every replan (None: the shipped fit)."""
    if not cfg.local_dir or not cfg.storage:
        raise InputError("--elastic", "needs --local-dir and --storage")
    local_root = Path(cfg.local_dir)
    store = open_store(cfg.storage)
    check_elastic_checkpoints(cfg, store, local_root)
    recoveries: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    """Steps of earlier attempts, up to the checkpoint each recovery resumed from."""
    with tempfile.TemporaryDirectory(prefix="hetplan-elastic-") as tmp:
        cur = replace(cfg, result=str(Path(tmp) / "result.json"))
        checked = preflight(cur)
        plan, model, cluster = checked.plan, checked.model, checked.cluster
        alive: Cluster = cluster
        # the plan's estimate, made while nothing waits on it: the cost model's first call in
        # a process reads its calibration and fills its caches (about 1 ms on the bench's
        # CPU plan), which a replan after a preemption would otherwise pay in its downtime
        params = params or default_params()  # launch's --params and --profile, else shipped
        estimate(plan, model, cluster, params).require_fit("PLAN")  # as launch refuses it
        for attempt in range(max_recoveries + 1):
            order = preflight(cur).devices
            failed = launch_workers(cur, len(order), str(Path(tmp) / f"logs-{attempt}"))
            step_log = Path(f"{cur.result}.steps")
            attempt_steps = _read_steps(step_log)
            step_log.unlink(missing_ok=True)
            if not failed:
                record: dict[str, Any] = json.loads(Path(cur.result or "").read_text())
                record["steps_before_recovery"] = done
                record["recoveries"] = recoveries
                record["plan"] = plan.to_dict()
                return record
            killed = sorted(
                {node_of(order[r]) for r, code in failed.items() if code == -signal.SIGKILL}
            )
            if not killed:
                causes = [Path(f"{cur.result}.error.{r}") for r in sorted(failed)]
                last = [c.read_text() for c in causes if c.is_file()]
                raise RuntimeError(
                    f"training failed: workers failed without a preemption (exit codes "
                    f"{failed})" + (f": {last[0]}" if last else "")
                )
            if attempt == max_recoveries:
                raise RuntimeError(f"training failed: gave up after {max_recoveries} recoveries")
            if set(killed) >= {n.name for n in alive.nodes}:
                raise RuntimeError(f"training failed: every node was lost ({', '.join(killed)})")
            t0, cpu0 = time.perf_counter(), time.process_time()
            res = replan(plan, model, alive, killed, params=params)
            if not res.estimate.fits:
                raise RuntimeError(
                    f"training failed: without {', '.join(killed)}, no plan fits in the "
                    f"remaining memory ({res.estimate.memory_shortfall()})"
                )
            replan_cpu_s = time.process_time() - cpu0
            done.extend(attempt_steps)
            for node in killed:  # a preempted node's disk goes with it
                shutil.rmtree(local_root / node, ignore_errors=True)
            units = list(shard_bytes(model))
            found = survey(local_root, [n.name for n in res.cluster.nodes], store, units)
            problem = RecoveryProblem(
                shard_bytes={n.removesuffix(".pt"): b for n, b in found.sizes_bytes.items()},
                need=node_shards(res.plan, model),
                held=found.held,
                nic_bytes_per_s={n.name: n.network_bytes_per_s for n in alive.nodes},
                storage_bytes_per_s=storage_bytes_per_s,
                in_storage=found.in_storage,
                hash_bytes_per_s=measured_hash_bytes_per_s(),
                file_latency_s=measured_file_latency_s(str(local_root)),
            )
            rec = plan_recovery(problem)
            throttle = (
                Throttle(problem.nic_bytes_per_s, storage_bytes_per_s)
                if emulate_bandwidth
                else None
            )
            measured_s, notes = execute(rec, found, local_root, store, model, cfg.seed, throttle)
            uploaded = complete_storage(found, local_root, store, model, cfg.seed)
            plan, alive = res.plan, res.cluster
            plan_path = Path(tmp) / f"plan_{attempt + 1}.json"
            plan.save(plan_path)
            done[:] = [s for s in done if s["step"] <= found.step]
            recoveries.append(
                {
                    "lost": killed,
                    "step": found.step,
                    "steps_lost": len(attempt_steps) and attempt_steps[-1]["step"] - found.step,
                    "plan": plan.to_dict(),
                    "replan_time_s": res.replan_time_s,
                    "replan_cpu_s": replan_cpu_s,
                    "measured_recovery_s": measured_s,
                    "downtime_s": time.perf_counter() - t0,
                    "uploaded_to_storage": uploaded,
                    "notes": found.notes + notes + res.notes,
                    **rec.to_json(),
                }
            )
            cur = replace(cur, plan=str(plan_path), resume=True)
    raise AssertionError("unreachable")


def _read_steps(path: Path) -> list[dict[str, Any]]:
    """Returns the steps rank 0 logged (one JSON object a line; a torn last line skipped)."""
    out = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                break
    return out
