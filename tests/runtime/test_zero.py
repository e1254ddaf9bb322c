"""ZeRO-1/2's flat buffers and shards (``runtime/zero.py``): the layout by hand, and runs
whose shard bookkeeping is easy to get wrong against the one-device fp32 reference: an odd
group (3 replicas) whose flat buffer needs padding and whose shard boundaries cut through
parameters, replicas with different micro-batch counts, virtual stages (a bucket per
chunk) with the tied embedding shared by the first and last stage, and the sharded AdamW
state saved under one ZeRO stage and resumed under another plan. ZeRO-2 reduce-scatters
every micro-batch on the 3 replicas (no pipeline) and runs as ZeRO-1 with a pipeline."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from hetplan.cluster import load_cluster
from hetplan.cost.estimate import estimate
from hetplan.model import load_model
from hetplan.plan import load_plan
from hetplan.runtime.checkpoint import LATEST, step_dir_name
from hetplan.runtime.config import RunConfig
from hetplan.runtime.launch import run_local
from hetplan.runtime.layout import build_layout
from hetplan.runtime.optim_config import OptimConfig
from hetplan.runtime.reference import checkpoint_params, max_relative_error, reference_train
from hetplan.runtime.zero import Piece, buckets_of, flat_layout

SEED = 5
# three replicas, batch shares 2:4:2 (1, 2 and 1 micro-batches of 2)
DP3 = [(2, [(4, [0])]), (4, [(4, [1])]), (2, [(4, [2])])]
TWO_BY_TWO = [(4, [(2, [0]), (2, [1])]), (4, [(2, [2]), (2, [3])])]
ASYM = [(2, [(4, [0])]), (6, [(1, [1]), (3, [2])])]


def test_flat_layout_by_hand() -> None:
    # 5 + 3 = 8 elements over 3 members: padded to 9, shards of 3. Member 0 holds the
    # first 3 elements of parameter 0; member 1 its last 2 and parameter 1's first;
    # member 2 parameter 1's last 2, then one element of padding.
    lay = flat_layout([5, 3], 3)
    assert (lay.offsets, lay.padded, lay.shard) == ((0, 5), 9, 3)
    assert lay.pieces(0) == [Piece(0, 0, 3, 0)]
    assert lay.pieces(1) == [Piece(0, 3, 5, 0), Piece(1, 0, 1, 2)]
    assert lay.pieces(2) == [Piece(1, 1, 3, 0)]
    # even: no padding, whole parameters
    even = flat_layout([4, 4], 2)
    assert (even.padded, even.pieces(1)) == (8, [Piece(1, 0, 4, 0)])


def test_buckets_split_by_chunk(inputs: dict[str, Path], write_plan: Any, tmp_path: Path) -> None:
    # 2 replicas x 2 stages x 2 virtual stages, 4 layers: stage 0 runs layer 0 (with the
    # embedding) then layer 2, stage 1 layer 1 then layer 3 (with the head). The group of
    # the two stage-0 ranks holds both chunks' units: one bucket per chunk.
    path = write_plan(tmp_path / "p.json", TWO_BY_TWO, schedule="Interleaved1F1B", virtual_stages=2)
    model = load_model(str(inputs["gpt"]))
    layout = build_layout(load_plan(path), model, load_cluster(str(inputs["cluster"])))
    first = next(g for g in layout.sync_groups if g.ranks == (0, 2) and "embed" in g.units)
    assert buckets_of(layout, first) == [("embed", "layer_0000"), ("layer_0002",)]
    tied = next(g for g in layout.sync_groups if "embed_tok" in g.units)
    assert tied.ranks == (0, 1, 2, 3)
    assert buckets_of(layout, tied) == [("embed_tok",)]


def _cfg(plan: Path, inputs: dict[str, Path], root: Path, **kw: Any) -> RunConfig:
    optim = OptimConfig(lr=2e-3, warmup_steps=2, decay_steps=3, grad_clip=0.5)
    return RunConfig(
        plan=str(plan),
        model=str(inputs["gpt"]),
        cluster=str(inputs["cluster"]),
        seed=SEED,
        checkpoint_dir=str(root),
        threads=1,
        lr=optim.lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=optim.decay_steps,
        grad_clip=optim.grad_clip,
        **kw,
    )


def _reference(inputs: dict[str, Path], steps: int) -> tuple[dict, list[float]]:
    optim = OptimConfig(lr=2e-3, warmup_steps=2, decay_steps=3, grad_clip=0.5)
    return reference_train(load_model(str(inputs["gpt"])), 8, steps, SEED, optim)


@pytest.mark.distributed
@pytest.mark.parametrize("stage", [1, 2])
def test_odd_group_with_padding_matches_single_device(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any, stage: int
) -> None:
    ref, losses = _reference(inputs, 3)
    # the case is what it claims: one bucket of every parameter over 3 members, padded,
    # with shard boundaries inside parameters (sizes from the reference model)
    sizes = [ref[k].numel() for k in sorted(ref)]
    lay = flat_layout(sizes, 3)
    assert lay.padded > sum(sizes)
    cuts = {m * lay.shard for m in (1, 2)}
    assert all(any(o < c < o + n for o, n in zip(lay.offsets, sizes, strict=True)) for c in cuts)

    plan = write_plan(tmp_path / "plan.json", DP3, zero_stage=stage)
    record = run_local(_cfg(plan, inputs, tmp_path / "ckpt", steps=3), timeout_s=300)
    assert max_relative_error(checkpoint_params(tmp_path / "ckpt"), ref) <= 1e-5
    assert [s["loss"] for s in record["steps"]] == pytest.approx(losses, rel=1e-5)
    assert record["steps"][0]["grad_norm"] > 0.5  # clipping in play, on the global norm


@pytest.mark.distributed
def test_zero2_interleaved_tied_embedding_matches_single_device(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    # pipelined: ZeRO-2 runs as ZeRO-1 (cost.sharding.deferred_sync), a bucket per chunk,
    # and the tied token table's group spans both stages of each replica
    plan = write_plan(
        tmp_path / "plan.json",
        TWO_BY_TWO,
        zero_stage=2,
        schedule="Interleaved1F1B",
        virtual_stages=2,
    )
    run_local(_cfg(plan, inputs, tmp_path / "ckpt", steps=3), timeout_s=300)
    ref, _ = _reference(inputs, 3)
    assert max_relative_error(checkpoint_params(tmp_path / "ckpt"), ref) <= 1e-5


@pytest.mark.distributed
def test_sharded_state_resumes_under_another_plan(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    # 2 steps under ZeRO-1 on 3 replicas, the 3rd under ZeRO-2 on the asymmetric plan:
    # the AdamW moments cross from one shard layout to another through the unit files
    first = write_plan(tmp_path / "a.json", DP3, zero_stage=1)
    run_local(_cfg(first, inputs, tmp_path / "ckpt", steps=2), timeout_s=300)
    work = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ckpt", work)
    other = write_plan(tmp_path / "b.json", ASYM, zero_stage=2)
    record = run_local(_cfg(other, inputs, work, steps=3, resume=True), timeout_s=300)
    assert [s["step"] for s in record["steps"]] == [3]
    ref, losses = _reference(inputs, 3)
    assert max_relative_error(checkpoint_params(work), ref) <= 1e-5
    assert record["steps"][0]["loss"] == pytest.approx(losses[2], rel=1e-5)


def test_square_sum_reads_once_in_float64():
    """The clipping norm's sum of squares: 3^2 + 4^2 = 25 from fp32, and float64 keeps what
    fp32 accumulation would round away (1e7^2 + 1: fp32 spacing there is 8,388,608)."""
    import torch

    from hetplan.runtime.grad_sync import square_sum

    assert float(square_sum(torch.tensor([3.0, 4.0]))) == 25.0
    got = square_sum(torch.tensor([1e7, 1.0], dtype=torch.float32))
    assert got.dtype == torch.float64 and float(got) == 1e14 + 1


@pytest.mark.distributed
def test_zero3_state_resumes_under_another_plan(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    # ZeRO-3 steps AdamW on each FSDP shard's local tensor (optim.LocalShards): its moments
    # must come out whole in the checkpoint and go back into the shards. 2 steps on 3
    # replicas (hidden 32 and MLP 128 split 11:11:10 and 43:43:42 by FSDP), the 3rd on
    # 2 pipelines of 2 stages, each layer now sharded over 2: a lost or misplaced moment
    # makes step 3 a different update from the one-device reference's
    first = write_plan(tmp_path / "a.json", DP3, zero_stage=3)
    run_local(_cfg(first, inputs, tmp_path / "ckpt", steps=2), timeout_s=300)
    ref2, _ = _reference(inputs, 2)
    assert max_relative_error(checkpoint_params(tmp_path / "ckpt"), ref2) <= 1e-5
    work = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ckpt", work)
    other = write_plan(tmp_path / "b.json", TWO_BY_TWO, zero_stage=3)
    record = run_local(_cfg(other, inputs, work, steps=3, resume=True), timeout_s=300)
    assert [s["step"] for s in record["steps"]] == [3]
    ref, losses = _reference(inputs, 3)
    assert max_relative_error(checkpoint_params(work), ref) <= 1e-5
    assert record["steps"][0]["loss"] == pytest.approx(losses[2], rel=1e-5)


# ---- bf16: 2-byte parameters, fp32 master shards (zero.py) -----------------------------
DP4 = [(2, [(4, [i])]) for i in range(4)]


def _bf16_inputs(inputs: dict[str, Path], root: Path) -> dict[str, Path]:
    cluster = root / "cluster_bf16.yaml"  # the shared one names no bf16 figure
    cluster.write_text(
        inputs["cluster"].read_text().replace("fp32_tflops", "bf16_tflops: 0.2, fp32_tflops")
    )
    return {**inputs, "cluster": cluster}


@pytest.mark.distributed
def test_bf16_zero_memory_is_the_cost_models(
    tmp_path: Path, inputs: dict[str, Path], write_plan: Any
) -> None:
    """Four replicas. Per parameter, fp32 ZeRO-1 holds 4 (weights) + 4 (gradients) + 8/4
    (AdamW shard) bytes; bf16 ZeRO-1 2 + 4 + 12/4 (master and AdamW shard): less, with
    half-size activations besides. Fp32 weights beside the shard's master held 4 + 4 + 8/4
    plus a bf16 copy, above the fp32 run. Each within 10% of ``estimate``'s peak (the
    Megatron-Core table, 6 + 12/d for bf16)."""
    bf = _bf16_inputs(inputs, tmp_path)
    cluster = load_cluster(str(bf["cluster"]))
    for stage in (1, 2):
        peak = {}
        for precision in ("fp32", "bf16"):
            plan = write_plan(
                tmp_path / f"{precision}{stage}.json", DP4, zero_stage=stage, precision=precision
            )
            cfg = RunConfig(str(plan), str(bf["gpt"]), str(bf["cluster"]), steps=2, threads=1)
            peak[precision] = max(run_local(cfg, timeout_s=300)["peak_memory_bytes"].values())
            est = estimate(load_plan(plan), cfg.model_spec(), cluster)
            assert peak[precision] == pytest.approx(est.max_memory_bytes, rel=0.1)
        assert peak["bf16"] < 0.85 * peak["fp32"]


# session-wide: a module-scoped fixture is built again whenever xdist runs another module's
# test on this worker between the group's tests (97 s each time)
@pytest.fixture(scope="session")
def bf16_runs(
    tmp_path_factory: pytest.TempPathFactory, inputs: dict[str, Path], write_plan: Any
) -> dict[str, Any]:
    """Three bf16 steps on 3 replicas under each ZeRO stage, checkpointed after every step
    (the tests read step 3, and resume from step 2): plans, inputs, roots and records."""
    root = tmp_path_factory.mktemp("bf16")
    bf = _bf16_inputs(inputs, root)
    plans, roots, records = {}, {}, {}
    for stage in (0, 1, 2, 3):
        plans[stage] = write_plan(root / f"z{stage}.json", DP3, zero_stage=stage,
                                  precision="bf16")  # fmt: skip
        roots[stage] = root / f"c{stage}"
        cfg = _cfg(plans[stage], bf, roots[stage], steps=3, checkpoint_every=1)
        records[stage] = run_local(cfg, timeout_s=300)
    return {"inputs": bf, "plans": plans, "roots": roots, "records": records}


def _from_step(root: Path, step: int, work: Path) -> Path:
    """Copies checkpoint ``step`` of ``root`` alone into ``work``, named the latest there."""
    name = step_dir_name(step)
    shutil.copytree(root / name, work / name)
    (work / LATEST).write_text(name)
    return work


@pytest.mark.distributed
@pytest.mark.xdist_group("bf16_zero")
@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_checkpoint_keeps_the_fp32_master(
    tmp_path: Path, bf16_runs: dict[str, Any], stage: int
) -> None:
    """bf16 on 3 replicas, the modules on bf16 parameters (ZeRO-1: a padded buffer, shards
    cutting parameters, fp32 master shards; ZeRO-0: whole fp32 masters): the checkpoint
    holds the fp32 masters, not the bf16 parameters (values bf16 cannot represent), and a
    3rd step resumed from step 2's checkpoint ends where 3 straight steps do, to the bit
    (resuming from bf16-rounded weights would not); ZeRO-2 follows ZeRO-1 within fp32
    rounding (its gradients are summed in another order)."""
    import torch

    straight = bf16_runs["roots"][stage]
    want = checkpoint_params(straight)
    assert all(t.dtype == torch.float32 for t in want.values())
    assert any(bool((t.to(torch.bfloat16).float() != t).any()) for t in want.values())

    work = _from_step(straight, 2, tmp_path / "resumed")
    cfg = _cfg(bf16_runs["plans"][stage], bf16_runs["inputs"], work, steps=3, resume=True)
    record = run_local(cfg, timeout_s=300)
    assert [s["step"] for s in record["steps"]] == [3]
    got = checkpoint_params(work)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert record["steps"][0]["loss"] == bf16_runs["records"][stage]["steps"][2]["loss"]

    if stage == 1:
        two = checkpoint_params(bf16_runs["roots"][2])
        assert max_relative_error(two, want) <= 1e-5


@pytest.mark.distributed
@pytest.mark.xdist_group("bf16_zero")
def test_bf16_zero_stages_run_one_program(bf16_runs: dict[str, Any]) -> None:
    """In bf16 every ZeRO stage runs the same mixed-precision program (2-byte parameters
    and activations, fp32 masters, gradients and AdamW state): after 3 steps on 3 replicas
    their fp32 masters agree to fp32 rounding (sums in another order). ZeRO-3's layers
    gathered in fp32 under autocast instead kept the residual stream in fp32: a different
    program, 1e-3 away."""
    got = {stage: checkpoint_params(bf16_runs["roots"][stage]) for stage in (0, 1, 2, 3)}
    for stage in (1, 2, 3):
        assert max_relative_error(got[stage], got[0]) <= 1e-5, stage
