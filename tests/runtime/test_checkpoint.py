"""Checkpoints: resume under another plan, and bad input refused before training starts."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.runtime import checkpoint as ckpt
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import preflight, run_local
from hetplan.runtime.reference import checkpoint_params, max_relative_error, reference_train

SEED = 3
TWO_BY_TWO = [(4, [(2, [0]), (2, [1])]), (4, [(2, [2]), (2, [3])])]
ASYMMETRIC = [(2, [(4, [0])]), (6, [(1, [1]), (3, [2])])]


def _cfg(plan: Path, inputs: dict[str, Path], root: Path, **kw: Any) -> RunConfig:
    return RunConfig(
        plan=str(plan),
        model=str(inputs["gpt"]),
        cluster=str(inputs["cluster"]),
        seed=SEED,
        checkpoint_dir=str(root),
        threads=1,
        **kw,
    )


# session-wide and one worker's (xdist_group): the run is made once, not once per worker
# or again after another module's test
@pytest.fixture(scope="session")
def first_run(
    tmp_path_factory: pytest.TempPathFactory, inputs: dict[str, Path], write_plan: Any
) -> tuple[Path, Path]:
    """Returns (checkpoint root with steps 1 and 2 of a 2x2 run, the asymmetric plan)."""
    root = tmp_path_factory.mktemp("run")
    plan = write_plan(root / "a.json", TWO_BY_TWO)
    run_local(_cfg(plan, inputs, root / "ckpt", steps=2, checkpoint_every=1), timeout_s=240)
    return root / "ckpt", write_plan(root / "b.json", ASYMMETRIC)


@pytest.mark.distributed
@pytest.mark.xdist_group("first_run")
def test_resume_under_another_plan_matches_uninterrupted(
    first_run: tuple[Path, Path], inputs: dict[str, Path], tmp_path: Path
) -> None:
    root, other = first_run
    assert (root / ckpt.LATEST).read_text().strip() == "step_00000002"
    work = tmp_path / "ckpt"
    shutil.copytree(root, work)
    record = run_local(_cfg(other, inputs, work, steps=4, resume=True), timeout_s=240)
    assert [s["step"] for s in record["steps"]] == [3, 4]
    ref, losses = reference_train(load_model(str(inputs["gpt"])), 8, 4, SEED)
    assert max_relative_error(checkpoint_params(work), ref) <= 1e-5
    assert [s["loss"] for s in record["steps"]] == pytest.approx(losses[2:], rel=1e-5)
    # the step-2 checkpoint was not touched; step 4 was added beside it
    assert ckpt.read_manifest(work / "step_00000002").data_position == 16
    assert ckpt.read_manifest(work).step == 4


@pytest.mark.distributed
@pytest.mark.xdist_group("first_run")
def test_corrupt_checkpoint_refused_and_left_alone(
    first_run: tuple[Path, Path], inputs: dict[str, Path], tmp_path: Path
) -> None:
    root, other = first_run
    work = tmp_path / "ckpt"
    shutil.copytree(root, work)
    victim = work / "step_00000002" / "layer_0001.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in work.rglob("*") if p.is_file()}
    with pytest.raises(InputError, match="corrupt"):
        preflight(_cfg(other, inputs, work, steps=4, resume=True))
    # the workers verify too, before any step (the launch past preflight's own check)
    with pytest.raises(RuntimeError, match=r"training failed: rank \d exited with 1: .*corrupt"):
        from hetplan.runtime.launch import run_ranks

        cfg = _cfg(other, inputs, work, steps=4, resume=True)
        run_ranks(replace(cfg, result=str(tmp_path / "result.json")), 3, timeout_s=120)
    assert {p: p.read_bytes() for p in work.rglob("*") if p.is_file()} == before


@pytest.mark.distributed
@pytest.mark.xdist_group("first_run")
def test_existing_checkpoint_never_overwritten(first_run: tuple[Path, Path]) -> None:
    root, _ = first_run
    assert not ckpt.begin(root, 2)
    assert not ckpt.staging_dir(root, 2).exists()


@pytest.mark.distributed
@pytest.mark.xdist_group("first_run")
def test_half_written_checkpoint_is_invisible(
    first_run: tuple[Path, Path], inputs: dict[str, Path], tmp_path: Path
) -> None:
    root, _ = first_run
    work = tmp_path / "ckpt"
    shutil.copytree(root, work)
    assert ckpt.begin(work, 3)  # a crash after this leaves only a staging directory
    (ckpt.staging_dir(work, 3) / "embed.pt").write_bytes(b"partial")
    man = ckpt.verify_checkpoint(work, load_model(str(inputs["gpt"])))
    assert man.step == 2


def test_missing_checkpoint(inputs: dict[str, Path], tmp_path: Path, write_plan: Any) -> None:
    plan = write_plan(tmp_path / "p.json", ASYMMETRIC)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no checkpoint"):
        preflight(_cfg(plan, inputs, tmp_path / "empty", steps=2, resume=True))
    with pytest.raises(InputError, match="no such directory"):
        preflight(_cfg(plan, inputs, tmp_path / "absent", steps=2, resume=True))


def test_plan_that_does_not_match_model(
    inputs: dict[str, Path], tmp_path: Path, write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", [(8, [(2, [0]), (3, [1])])])
    with pytest.raises(InputError, match="layers sum to 5"):
        preflight(_cfg(plan, inputs, tmp_path / "c", steps=2))


def test_plan_that_does_not_match_cluster(
    inputs: dict[str, Path], tmp_path: Path, write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", [(8, [(2, [0]), (2, [7])])])
    with pytest.raises(InputError, match="only 4"):
        preflight(_cfg(plan, inputs, tmp_path / "c", steps=2))


def test_mixed_tp_inside_one_pipeline_refused(
    inputs: dict[str, Path], tmp_path: Path, write_plan: Any
) -> None:
    plan = write_plan(tmp_path / "p.json", [(8, [(2, [0, 1]), (2, [2])])])
    with pytest.raises(InputError, match="one tensor-parallel degree per pipeline"):
        preflight(_cfg(plan, inputs, tmp_path / "c", steps=2))


@pytest.mark.distributed
@pytest.mark.xdist_group("first_run")
def test_resume_with_another_model_refused(
    first_run: tuple[Path, Path], inputs: dict[str, Path]
) -> None:
    # the checkpoint is the tiny GPT's; the Llama of the same size is another model
    root, other = first_run
    cfg = _cfg(other, inputs, root, steps=4, resume=True)
    with pytest.raises(InputError, match=r"--resume: checkpoint .* has family 'gpt', the model"):
        preflight(replace(cfg, model=str(inputs["llama"])))


def test_commit_and_prune_fsync_the_directories(
    tmp_path: Path, inputs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a rename is durable only once its directory is fsynced: record what gets fsynced
    synced: list[str] = []
    real = ckpt.os.fsync

    def fsync(fd: int) -> None:
        synced.append(str(Path(f"/proc/self/fd/{fd}").readlink()))
        real(fd)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    root = tmp_path / "ckpt"
    model = load_model(str(inputs["gpt"]))
    for step in (1, 2):
        assert ckpt.begin(root, step)
        stage = ckpt.staging_dir(root, step)
        ckpt.write_atomic(stage / "embed.pt", b"x")
        synced.clear()
        ckpt.commit(root, step, 8 * step, 0, model, {"embed.pt": "0"}, global_batch=8, keep=1)
        # the manifest file, its directory before the rename, the root after it and after
        # 'latest' is replaced; at step 2 the root once more after step 1 is pruned
        assert synced[1] == str(stage)
        assert synced.count(str(root)) == (2 if step == 1 else 3)
    assert [s for s, _ in ckpt.step_dirs(root)] == [2]
