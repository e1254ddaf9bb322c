"""Uneven interleaved layouts (issue 14 item 5): per-chunk layer counts in plans, the layout
grammar, the cost model, export, the runtime's layout and Llama 3 405B's published layout.

Expected values are hand computed here (the tiny replay, the held activations, the layout
strings), or come from the even layout of a model with as many layers per chunk (the cost
of a chunk depends on its own layers only), never from the code's own split formula."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from hetplan.chunk_layout import (
    apply_layout,
    format_megatron_layout,
    lightened_chunks,
    parse_layout,
    parse_megatron_layout,
)
from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.schedule import held_layers, replay
from hetplan.errors import InputError
from hetplan.model import load_model
from hetplan.plan import Stage, plan_from_dict, validate_plan
from hetplan.report.export import deepspeed_config, megatron_args
from hetplan.runtime.layout import build_layout
from hetplan.search.layout import uniform_plan

# Llama 3 405B on PP16 with two chunks per stage, the first and the last stage one layer
# lighter (Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.2): 126 layers as
# 16 x 8 slots less 2; the lighter chunk sits beside the embedding and beside the head.
LLAMA3_CHUNKS = [(3, 4)] + [(4, 4)] * 14 + [(4, 3)]
LLAMA3_LAYOUT = "Et*3|(t*4|)*30,t*3L"  # written by hand from the table above


def _plan_dict(chunks: list[list[int]] | None, layers: list[int], v: int) -> dict:
    stages = []
    for j, n in enumerate(layers):
        st: dict = {"layers": n, "devices": [f"n0:{j}"]}
        if chunks is not None:
            st["chunks"] = chunks[j]
        stages.append(st)
    return {
        "global_batch_size": 4,
        "micro_batch_size": 1,
        "schedule": "Interleaved1F1B",
        "virtual_stages": v,
        "pipelines": [{"batch_size": 4, "stages": stages}],
    }


# --------------------------------------------------------------------------------------
# plan form
# --------------------------------------------------------------------------------------


def test_chunks_round_trip_and_even_plans_are_written_as_before():
    data = _plan_dict([[2, 1], [1, 2]], [3, 3], 2)
    plan = plan_from_dict(data)
    assert [s.chunks for s in plan.pipelines[0].stages] == [(2, 1), (1, 2)]
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    even = plan_from_dict(_plan_dict(None, [4, 4], 2))
    written = even.to_dict()
    assert all("chunks" not in s for s in written["pipelines"][0]["stages"])
    assert written["pipelines"][0]["stages"][0] == {"layers": 4, "devices": ["n0:0"]}


def test_layers_may_be_left_to_the_chunks():
    data = _plan_dict([[2, 1], [1, 2]], [3, 3], 2)
    for st in data["pipelines"][0]["stages"]:
        del st["layers"]
    plan = plan_from_dict(data)
    assert [s.layers for s in plan.pipelines[0].stages] == [3, 3]


@pytest.mark.parametrize(
    ("chunks", "layers", "field", "reason"),
    [
        ([[2, 1], [1, 1, 1]], [3, 3], "pipelines[0].stages[1].chunks", "lists 3 chunks"),
        ([[2, 1], [1, 1]], [3, 3], "pipelines[0].stages[1].chunks", "sum to 2 layers"),
        ([[2, 1], [3, -1]], [3, 2], "pipelines[0].stages[1].chunks", ">= 0"),
        ([[2, 1], "x"], [3, 3], "pipelines[0].stages[1].chunks", "non-empty list"),
    ],
)
def test_bad_chunks_name_the_field(chunks, layers, field, reason):
    with pytest.raises(InputError) as err:
        plan_from_dict(_plan_dict(chunks, layers, 2))
    assert err.value.field == field
    assert reason in str(err.value)


def test_an_odd_stage_without_chunks_is_refused_with_the_way_out():
    model = dataclasses.replace(load_model("gpt3-1.3b"), layers=14)
    cl = parse_inline_cluster("A100-80GB:1x2")
    plan = uniform_plan(cl, 14, 1, 2, 1, 1, 4, schedule="Interleaved1F1B", virtual_stages=2)
    odd = dataclasses.replace(
        plan,
        pipelines=(
            dataclasses.replace(
                plan.pipelines[0],
                stages=tuple(Stage(7, st.devices) for st in plan.pipelines[0].stages),
            ),
        ),
    )
    with pytest.raises(InputError, match="chunks"):
        validate_plan(odd, model, cl)
    ok = apply_layout(plan, [(4, 3), (3, 4)])
    validate_plan(ok, model, cl)


# --------------------------------------------------------------------------------------
# the layout grammar (Megatron-Core's --pipeline-model-parallel-layout)
# --------------------------------------------------------------------------------------


def test_megatron_layout_strings_parse_by_hand():
    # virtual stages in order: stage 0 chunk 0, stage 1 chunk 0, stage 0 chunk 1, ...
    assert parse_megatron_layout("E|t*4|tt|tL", 2) == [(0, 2), (4, 1)]
    assert parse_megatron_layout("Et,t|t|ttL", 1) == [(2, 1, 2)]
    assert parse_megatron_layout("E(t|)*3L", 2) == [(1, 1), (1, 0)]
    assert parse_megatron_layout(LLAMA3_LAYOUT, 16) == LLAMA3_CHUNKS
    assert sum(map(sum, LLAMA3_CHUNKS)) == 126


def test_layouts_are_written_compactly_and_read_back():
    assert format_megatron_layout(LLAMA3_CHUNKS) == LLAMA3_LAYOUT
    assert format_megatron_layout([(2,)] * 4) == "Ett|tt|tt|ttL"
    assert format_megatron_layout([(2,)] * 6) == "Ett|(tt|)*4,ttL"
    for stages in ([(0, 2), (4, 1)], [(1, 1, 1)], [(5,), (0,), (3,)], LLAMA3_CHUNKS):
        assert parse_megatron_layout(format_megatron_layout(stages), len(stages)) == stages


@pytest.mark.parametrize(
    ("text", "pp", "reason"),
    [
        ("Et*3|(tt|)*29,m|L", 16, "unexpected 'm'"),  # MTP layers are not modelled
        ("Et|t|tL", 2, "3 virtual stages do not divide among 2"),
        ("tE|tL", 1, "embedding E must appear once, first"),
        ("Et|LtL", 1, "loss L must appear once"),
        ("[[1,2],[3]]", 2, "same number of chunks"),
        ("[[1,2]]", 2, "lists 1 stages"),
        ("[[1,-2],[3,1]]", 2, "stage 0"),
        ("[1,2", 2, "not a valid JSON list"),
    ],
)
def test_bad_layouts_name_the_option(text, pp, reason):
    with pytest.raises(InputError) as err:
        parse_layout(text, pp)
    assert err.value.field == "--layout"
    assert reason in str(err.value)


def test_json_layout_form():
    assert parse_layout("[[3,4],[4,4],[4,3]]", 3) == [(3, 4), (4, 4), (4, 3)]
    assert parse_layout("[7, 9]", 2) == [(7,), (9,)]


def test_lightened_chunks_put_the_lighter_chunk_beside_embedding_and_head():
    assert list(lightened_chunks([7] + [8] * 14 + [7], 2)) == LLAMA3_CHUNKS
    assert lightened_chunks([3, 4, 3], 2) == ((1, 2), (2, 2), (2, 1))


# --------------------------------------------------------------------------------------
# the schedule: a tiny case by hand, held activations by hand
# --------------------------------------------------------------------------------------


def test_tiny_uneven_interleaved_by_hand():
    """2 stages, 2 chunks, layers [2, 1] and [1, 2], m = 2; a layer takes 1 forward, 2
    backward, transfers are free. Virtual stages vs0 = s0c0 (2 layers), vs1 = s1c0 (1),
    vs2 = s0c1 (1), vs3 = s1c1 (2). Stage 0 warms up with all 4 forwards, stage 1 with 2:
      s0: F0c0 0-2, F1c0 2-4, F0c1 4-5 (vs1 mb0 done at 3), F1c1 5-6
      s1: F0c0 2-3, F1c0 4-5, F0c1 5-7, B0c1 7-11, F1c1 11-13, B1c1 13-17,
          B0c0 17-19 (vs2 B mb0 done at 13), B1c0 19-21
      s0: B0c1 11-13, B1c1 17-19, B0c0 19-23, B1c0 23-27
    The iteration ends at 27; each stage computes 6 forward + 12 backward."""
    layers = [[2, 1], [1, 2]]
    fwd = [[1.0 * n for n in st] for st in layers]
    bwd = [[2.0 * n for n in st] for st in layers]
    rep = replay("Interleaved1F1B", 2, 2, fwd, bwd, [0.0, 0.0], record=True)
    assert rep.makespan_s == pytest.approx(27.0)
    assert rep.busy_s == pytest.approx([18.0, 18.0])
    assert rep.last_backward_end_s == pytest.approx([27.0, 21.0])
    s1 = [(k, mb, c, a, b) for s, k, mb, c, a, b in rep.events if s == 1]
    assert s1[6] == ("B", 0, 0, 17.0, 19.0)


def test_held_activations_by_hand():
    # stage 0 runs all four forwards first: 2 + 2 + 1 + 1 layers, two chunk-0 micro-batches
    assert held_layers("Interleaved1F1B", 2, 2, 0, (2, 1)) == ((6, 2),)
    # stage 1: F0c0 (1), F1c0 (2), F0c1 (4), B0c1, F1c1 (4 again): at most 4 layers, 2 of c0
    assert held_layers("Interleaved1F1B", 2, 2, 1, (1, 2)) == ((4, 2),)


# --------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------


def _chunk_durations(est) -> dict[tuple[int, str, int], float]:
    out: dict[tuple[int, str, int], float] = {}
    for s, kind, _, c, a, b in est.replays[0].events:
        out[(s, kind, c)] = b - a
    return out


def _two_stage(layers: int, chunks: list[tuple[int, ...]] | None):
    model = dataclasses.replace(load_model("gpt3-1.3b"), layers=layers)
    cl = parse_inline_cluster("A100-80GB:1x4")
    plan = uniform_plan(
        cl, layers, 2, 2, 1, 1, 4, schedule="Interleaved1F1B", virtual_stages=2,
        sequence_parallel=True, recompute="selective", precision="bf16",
    )  # fmt: skip
    if chunks is not None:
        plan = apply_layout(plan, chunks)
    return estimate(plan, model, cl, record=True), plan, model, cl


def test_each_chunk_costs_what_an_even_chunk_of_its_size_costs():
    uneven, *_ = _two_stage(6, [(2, 1), (1, 2)])
    ones, *_ = _two_stage(4, None)  # every chunk 1 layer
    twos, *_ = _two_stage(8, None)  # every chunk 2 layers
    got, one, two = _chunk_durations(uneven), _chunk_durations(ones), _chunk_durations(twos)
    for kind in ("F", "B"):
        assert got[(0, kind, 0)] == pytest.approx(two[(0, kind, 0)], rel=1e-12)
        assert got[(0, kind, 1)] == pytest.approx(one[(0, kind, 1)], rel=1e-12)
        assert got[(1, kind, 0)] == pytest.approx(one[(1, kind, 0)], rel=1e-12)
        assert got[(1, kind, 1)] == pytest.approx(two[(1, kind, 1)], rel=1e-12)


def test_uneven_estimate_replays_its_own_chunk_times():
    est, *_ = _two_stage(6, [(2, 1), (1, 2)])
    d = _chunk_durations(est)
    fwd = [[d[(s, "F", c)] for c in range(2)] for s in range(2)]
    bwd = [[d[(s, "B", c)] for c in range(2)] for s in range(2)]
    sends = [st.send_s for st in est.stages]
    again = replay("Interleaved1F1B", 4, 2, fwd, bwd, sends)
    assert est.pipeline_times_s[0] == pytest.approx(again.makespan_s, rel=1e-12)
    # the breakdown still sums to the iteration
    parts = {
        k: v
        for k, v in est.breakdown.items()
        if k
        not in (
            "pipeline_send_s_per_micro_batch",
            "data_parallel_sync_total_s",
            "microbatch_overhead_s",
        )
    }
    assert sum(parts.values()) == pytest.approx(est.iteration_time_s, rel=1e-9)


def test_uneven_memory_counts_the_layers_held():
    est, plan, model, _ = _two_stage(6, [(2, 1), (1, 2)])
    mb = plan.micro_batch_size
    e = 2
    layer = mb * model.layer_activation_bytes(2, True, "selective", True, e)
    embed = mb * model.embedding_activation_bytes(2, True, e)
    head = mb * model.head_activation_bytes(2, e)
    # m = 4, p = 2, v = 2: stage 0 warms up with min(2 + 2, 8) = 4 forwards (2+2+1+1 layers,
    # 2 of chunk 0) and then alternates one forward with one backward
    held0 = max(a * layer + b * embed for a, b in held_layers("Interleaved1F1B", 2, 4, 0, (2, 1)))
    assert held0 >= 6 * layer + 2 * embed
    assert est.stages[0].memory.activations == pytest.approx(held0, rel=1e-12)
    held1 = max(a * layer for a, _ in held_layers("Interleaved1F1B", 2, 4, 1, (1, 2)))
    assert est.stages[1].memory.activations == pytest.approx(held1 + head, rel=1e-12)


def test_even_chunks_stated_give_exactly_the_even_estimate():
    plain, plan, model, cl = _two_stage(8, None)
    stated = estimate(apply_layout(plan, [(2, 2), (2, 2)]), model, cl, record=True)
    assert stated.iteration_time_s == plain.iteration_time_s
    assert stated.breakdown == plain.breakdown
    assert [s.memory for s in stated.stages] == [s.memory for s in plain.stages]


# --------------------------------------------------------------------------------------
# export and runtime
# --------------------------------------------------------------------------------------


def test_megatron_export_writes_the_layout_and_deepspeed_refuses():
    _, plan, model, _ = _two_stage(6, [(2, 1), (1, 2)])
    args = megatron_args(plan, model)
    lay = [a for a in args if a.startswith("--pipeline-model-parallel-layout=")]
    assert lay == ["--pipeline-model-parallel-layout=Ett|t|t|ttL"]
    assert not any(a.startswith("--num-layers-per-virtual") for a in args)
    with pytest.raises(InputError, match="interleaved"):
        deepspeed_config(plan, model)


def test_megatron_export_of_uneven_stages_without_chunks():
    model = dataclasses.replace(load_model("gpt3-1.3b"), layers=10)
    cl = parse_inline_cluster("A100-80GB:1x4")
    plan = apply_layout(uniform_plan(cl, 10, 1, 4, 1, 1, 4), [(2,), (3,), (4,), (1,)])
    args = megatron_args(plan, model)
    assert "--pipeline-model-parallel-layout=Ett|t*3|t*4|tL" in args
    # an even middle: Megatron-Core's first/last flags say it (the middle takes the rest)
    light = apply_layout(uniform_plan(cl, 10, 1, 4, 1, 1, 4), [(2,), (3,), (3,), (2,)])
    args = megatron_args(light, model)
    assert "--decoder-first-pipeline-num-layers=2" in args
    assert "--decoder-last-pipeline-num-layers=2" in args
    assert not any(a.startswith("--pipeline-model-parallel-layout") for a in args)


def test_runtime_builds_chunks_of_their_own_sizes():
    model = dataclasses.replace(load_model("gpt2"), layers=6)
    cl = parse_inline_cluster("A100-80GB:1x2")
    plan = apply_layout(
        uniform_plan(cl, 6, 1, 2, 1, 1, 4, schedule="Interleaved1F1B", virtual_stages=2),
        [(2, 1), (1, 2)],
    )
    lay = build_layout(plan, model, cl)
    got = [[(c.stage_index, c.start, c.end, c.embed, c.head) for c in p.chunks] for p in lay.places]
    # layers follow virtual-stage order: vs0 = s0c0 [0,2), vs1 = s1c0 [2,3), vs2 = s0c1
    # [3,4), vs3 = s1c1 [4,6)
    assert got == [
        [(0, 0, 2, True, False), (2, 3, 4, False, False)],
        [(1, 2, 3, False, False), (3, 4, 6, False, True)],
    ]
    empty = apply_layout(plan, [(0, 3), (1, 2)])
    with pytest.raises(InputError) as err:
        build_layout(empty, model, cl)
    assert err.value.field == "pipelines[0].stages[0].chunks"


# --------------------------------------------------------------------------------------
# Llama 3 405B: Meta's layout predicts and exports
# --------------------------------------------------------------------------------------


def _llama3(dp: int):
    model = load_model("llama3-405b")
    cl = parse_inline_cluster(f"H100-80GB:{16 * dp}x8")
    # TP8 PP16, 16 micro-batches of one sequence per replica (Meta: batch 16 per DP group at
    # 16K GPUs), ZeRO-1 with sequence parallelism; full recomputation (without it the
    # first stage's 47 in-flight chunks need ~100 GB)
    base = uniform_plan(
        cl, model.layers, 8, 16, dp, 1, 16 * dp, precision="bf16", sequence_parallel=True,
        recompute="full", zero_stage=1,
    )  # fmt: skip
    return apply_layout(base, parse_megatron_layout(LLAMA3_LAYOUT, 16)), model, cl


def test_llama3_405b_layout_predicts_and_exports():
    plan, model, cl = _llama3(2)
    assert [s.layers for s in plan.pipelines[0].stages] == [7] + [8] * 14 + [7]
    est = estimate(plan, model, cl)
    assert est.fits
    parts = {
        k: v
        for k, v in est.breakdown.items()
        if k
        not in (
            "pipeline_send_s_per_micro_batch",
            "data_parallel_sync_total_s",
            "microbatch_overhead_s",
        )
    }
    assert sum(parts.values()) == pytest.approx(est.iteration_time_s, rel=1e-9)
    assert 0.1 < est.mfu < 0.6
    args = megatron_args(plan, model)
    (lay,) = [a.split("=", 1)[1] for a in args if a.startswith("--pipeline-model-parallel-layout")]
    assert parse_megatron_layout(lay, 16) == LLAMA3_CHUNKS
    assert "--pipeline-model-parallel-size=16" in args and "--num-layers=126" in args


def test_predict_layout_on_the_command_line():
    res = subprocess.run(
        [sys.executable, "-m", "hetplan", "predict", "--model", "llama3-405b", "--cluster",
         "H100-80GB:32x8", "--tp", "8", "--pp", "16", "--dp", "2", "--micro-batch-size", "1",
         "-b", "32", "--recompute", "full", "--zero-stage", "1", "--sequence-parallel",
         "--layout", LLAMA3_LAYOUT, "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["fits"] and [s["layers"] for s in out["stages"][:16]] == [7] + [8] * 14 + [7]
    bad = subprocess.run(
        [sys.executable, "-m", "hetplan", "predict", "--model", "llama3-405b", "--cluster",
         "H100-80GB:32x8", "--tp", "8", "--pp", "16", "--dp", "2", "--micro-batch-size", "1",
         "-b", "32", "--layout", "Et*3|(t*4|)*30,t*2L"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "error: --layout: places 125 layers, the model has 126"
    ]


RUNTIME_CLUSTER = """\
gpu_types:
  cpu: {fp16_tflops: 0.2, fp32_tflops: 0.1, memory_gb: 16, hbm_gbyte_per_s: 10}
nodes:
  - {name: host, gpu: cpu, gpus: 2, intra_node_bandwidth: 5 GB/s}
"""


@pytest.mark.distributed
def test_runtime_trains_uneven_chunks_like_one_device(tmp_path):
    """Two processes on gloo, chunks [2, 1] and [1, 2] of a 6-layer Llama: the parameters
    after 3 AdamW steps equal one device's training of the whole batch."""
    pytest.importorskip("torch")
    from hetplan.runtime.config import RunConfig
    from hetplan.runtime.launch import run_local
    from hetplan.runtime.reference import (
        checkpoint_params,
        max_relative_error,
        reference_train,
    )

    config = {
        "hidden_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 64,
        "max_position_embeddings": 16,
    }  # fmt: skip
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(config))
    (tmp_path / "cluster.yaml").write_text(RUNTIME_CLUSTER)
    plan = {
        "global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32",
        "schedule": "Interleaved1F1B", "virtual_stages": 2,
        "pipelines": [{"batch_size": 8, "stages": [
            {"chunks": [2, 1], "devices": ["host:0"]},
            {"chunks": [1, 2], "devices": ["host:1"]},
        ]}],
    }  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    cfg = RunConfig(
        plan=str(tmp_path / "plan.json"),
        model=str(tmp_path / "llama" / "config.json"),
        cluster=str(tmp_path / "cluster.yaml"),
        steps=3,
        seed=7,
        checkpoint_dir=str(tmp_path / "ckpt"),
        threads=1,
    )
    record = run_local(cfg, timeout_s=240)
    model = load_model(str(tmp_path / "llama" / "config.json"))
    ref, ref_losses = reference_train(model, 8, 3, 7)
    got = checkpoint_params(tmp_path / "ckpt")
    assert got.keys() == ref.keys()
    assert max_relative_error(got, ref) <= 1e-5
    for s, want in zip(record["steps"], ref_losses, strict=True):
        assert s["loss"] == pytest.approx(want, rel=1e-5)
