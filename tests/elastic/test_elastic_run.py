"""Kill a worker mid-run: the run replans, recovers from survivors and storage, and ends
with exactly the parameters of a clean run resumed from that checkpoint under the new plan."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hetplan.model import load_model
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import _env, run_local
from hetplan.runtime.reference import checkpoint_params, max_relative_error, reference_train

STEPS = 40
SEED = 3
SUPERVISOR = """
import json, sys
from hetplan.runtime.config import RunConfig
from hetplan.elastic.elastic_run import run_elastic
cfg = RunConfig(**json.loads(sys.argv[1]))
rec = run_elastic(cfg, 20e6)
open(sys.argv[2], "w").write(json.dumps(rec))
"""


def _latest(root: Path) -> int:
    try:
        return int((root / ckpt.LATEST).read_text().strip()[5:])
    except (OSError, ValueError):
        return 0


@pytest.mark.distributed
@pytest.mark.slow
def test_kill_a_worker_resumes_on_the_rest(elastic_inputs: dict[str, Path], tmp_path: Path) -> None:
    # two one-stage replicas and one of two stages: losing n3 leaves n2 holding half the
    # model, which the replan (three one-stage replicas, 3/3/2 micro-batches, faster than
    # the two intact ones at 4/4) completes from its peers' copies
    plan = {
        "global_batch_size": 8, "micro_batch_size": 1, "precision": "fp32", "schedule": "1F1B",
        "pipelines": [
            {"batch_size": 2, "stages": [{"layers": 4, "devices": ["n0:0"]}]},
            {"batch_size": 2, "stages": [{"layers": 4, "devices": ["n1:0"]}]},
            {"batch_size": 4, "stages": [{"layers": 2, "devices": ["n2:0"]},
                                         {"layers": 2, "devices": ["n3:0"]}]},
        ],
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    local, store = tmp_path / "local", tmp_path / "store"
    cfg = RunConfig(
        plan=str(tmp_path / "plan.json"),
        model=str(elastic_inputs["model"]),
        cluster=str(elastic_inputs["cluster"]),
        steps=STEPS,
        seed=SEED,
        checkpoint_every=2,
        threads=1,
        local_dir=str(local),
        storage=str(store),
    )
    out = tmp_path / "record.json"
    args = [sys.executable, "-c", SUPERVISOR, json.dumps(cfg.__dict__), str(out)]
    proc = subprocess.Popen(args, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while _latest(local / "n3") < 4:  # preempt n3 once a few checkpoints exist
        assert proc.poll() is None and time.monotonic() < deadline, "run ended too early"
        time.sleep(0.01)
    pid = int((local / "n3" / "worker-3.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text.decode()[-3000:]
    record = json.loads(out.read_text())
    (rec,) = record["recoveries"]
    assert rec["lost"] == ["n3"]
    step = rec["step"]
    assert 4 <= step < STEPS and step % 2 == 0
    # the new plan runs on the three survivors; survivors' copies did most of the work
    devices = {d for p in rec["plan"]["pipelines"] for s in p["stages"] for d in s["devices"]}
    assert devices == {"n0:0", "n1:0", "n2:0"}
    assert rec["bytes_local"] > 0 and rec["bytes_from_peers"] > 0
    assert rec["predicted_recovery_s"] < rec["baseline_recovery_s"]
    assert [s["step"] for s in record["steps"]] == list(range(step + 1, STEPS + 1))
    # --json keeps the steps trained before the failure, up to the recovered checkpoint
    before = [s["step"] for s in record["steps_before_recovery"]]
    assert before == list(range(1, step + 1))
    assert rec["steps_lost"] >= 0
    # control: a clean run from the same checkpoint (complete in storage) under the new plan
    control = tmp_path / "control"
    shutil.copytree(store / ckpt.step_dir_name(step), control / ckpt.step_dir_name(step))
    (control / ckpt.LATEST).write_text(ckpt.step_dir_name(step) + "\n")
    plan2 = tmp_path / "plan2.json"
    plan2.write_text(json.dumps(rec["plan"]))
    ctl = RunConfig(
        plan=str(plan2),
        model=cfg.model,
        cluster=cfg.cluster,
        steps=STEPS,
        seed=SEED,
        threads=1,
        checkpoint_dir=str(control),
        resume=True,
    )
    ctl_record = run_local(ctl, timeout_s=120)
    final = ckpt.verify_checkpoint(store, load_model(cfg.model))
    assert final.step == STEPS and final.data_position == STEPS * 8
    elastic_params = checkpoint_params(store)
    assert max_relative_error(elastic_params, checkpoint_params(control)) == 0.0
    losses = [s["loss"] for s in record["steps"]]
    assert losses == [s["loss"] for s in ctl_record["steps"]]
    # and both equal one uninterrupted full-batch run: no step saw other data
    ref, _ = reference_train(load_model(cfg.model), 8, STEPS, SEED)
    assert max_relative_error(elastic_params, ref) <= 1e-5


def test_elastic_refusals_before_any_process(tmp_path: Path) -> None:
    """As the plain checkpoint path: a new run into a store or local folder holding another
    run's steps, a resume with nothing left to train or another seed, and a store that
    cannot be used, each one line naming the option (a second run overwrote the first's
    steps in storage with exit 0; an unknown URL scheme was a traceback)."""
    from hetplan.elastic.elastic_run import check_elastic_checkpoints, open_store
    from hetplan.errors import InputError

    store_dir, local = tmp_path / "store", tmp_path / "local"
    base = RunConfig(plan="p.json", model="m", cluster="c", steps=6, seed=3,
                     local_dir=str(local), storage=str(store_dir))  # fmt: skip
    store = open_store(str(store_dir))
    check_elastic_checkpoints(base, store, local)  # empty: a new run starts
    (local / "n0" / "step_00000002").mkdir(parents=True)
    with pytest.raises(InputError) as info:
        check_elastic_checkpoints(base, store, local)
    assert info.value.field == "--local-dir"
    store.commit({"step": 4, "seed": 3})
    cases = [({}, "--storage"), ({"resume": True, "steps": 4}, "--steps"),
             ({"resume": True, "seed": 5}, "--seed")]  # fmt: skip
    for kw, field in cases:
        with pytest.raises(InputError) as info:
            check_elastic_checkpoints(replace(base, **kw), store, local)
        assert info.value.field == field, info.value
    check_elastic_checkpoints(replace(base, resume=True), store, local)  # continues to 6
    (tmp_path / "afile").write_text("x")
    for url in ("foo://x", str(tmp_path / "afile")):
        with pytest.raises(InputError) as info:
            open_store(url)
        assert info.value.field == "--storage"
