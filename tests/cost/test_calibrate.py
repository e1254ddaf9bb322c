from pathlib import Path

import pytest

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.calibrate import Run, fit, leave_one_out, load_runs
from hetplan.cost.estimate import estimate
from hetplan.cost.params import CostParams, GPUEfficiency
from hetplan.errors import InputError
from hetplan.model import ModelSpec
from hetplan.search.layout import uniform_plan

DATA = Path(__file__).resolve().parents[2] / "src/hetplan/data/calibration"
TRUE = GPUEfficiency(gemm_max=0.55, gemm_half_dim=96.0, mem_efficiency=0.6,
                     kernel_overhead_s=2e-5, link_efficiency=0.5)  # fmt: skip


def _synthetic_runs() -> list[Run]:
    """Runs 'measured' by the cost model itself with known parameters."""
    cluster = parse_inline_cluster("T4:2x4")
    truth = CostParams().with_gpu("T4", TRUE)
    runs = []
    for hidden, tp, pp, dp, mb in [
        (512, 1, 1, 8, 1), (512, 2, 2, 2, 2), (1024, 4, 1, 2, 1), (1024, 1, 4, 2, 4),
        (768, 2, 1, 4, 2), (256, 1, 2, 4, 8), (1024, 1, 1, 8, 2), (512, 4, 2, 1, 1),
    ]:  # fmt: skip
        model = ModelSpec(f"h{hidden}", "gpt", 8, hidden, 8, 8, 4 * hidden, 8192, 512)
        plan = uniform_plan(cluster, 8, tp, pp, dp, mb, 32, precision="fp16",
                            flash_attention=False)  # fmt: skip
        est = estimate(plan, model, cluster, truth)
        runs.append(Run("synthetic", model.name, model, cluster, "iter_time_s",
                        est.iteration_time_s, plan))  # fmt: skip
    return runs


def test_fit_recovers_the_parameters_that_made_the_data():
    runs = _synthetic_runs()
    got = fit(runs).gpu("T4")
    assert got.gemm_max == pytest.approx(TRUE.gemm_max, rel=0.1)
    assert got.link_efficiency == pytest.approx(TRUE.link_efficiency, rel=0.1)
    assert got.kernel_overhead_s == pytest.approx(TRUE.kernel_overhead_s, rel=0.3)
    report = leave_one_out(runs, fit(runs), workers=1)["synthetic"]
    assert report["n"] == len(runs)
    assert report["mae_pct"] < 2.0
    assert report["spearman"] > 0.95


def test_amp_partition_and_oom_rows():
    runs = load_runs(DATA / "amp_t4_homogeneous.csv")
    assert len(runs) == 52
    assert sum(r.measured is None for r in runs) == 5
    pp16 = next(r for r in runs if r.label == "mb1 tp1 dp1 pp16")
    assert pp16.plan is not None
    layers = [s.layers for s in pp16.plan.pipelines[0].stages]
    # 0;4;6;...: stage 0 holds the embedding, the no-op and layers 0-1
    assert layers[:3] == [2, 2, 2] and sum(layers) == 24 and layers[-1] == 1
    node = pp16.cluster.nodes[0]
    assert node.gpus == 4 and node.network_bytes_per_s == pytest.approx(50e9 / 8)


def test_megatron_rows_leave_knobs_to_the_search():
    runs = load_runs(DATA / "megatron_homogeneous.csv")
    assert len(runs) == 19
    first = runs[0]
    assert first.knobs is not None and first.knobs.recompute == ("full",)
    assert first.metric == "hardware_tflops_per_gpu"
    assert runs[-1].metric == "tflops_per_gpu" and runs[-1].knobs is not None
    assert runs[-1].knobs.flash_attention


def _write(tmp_path: Path, header: str, row: str) -> Path:
    path = tmp_path / "runs.csv"
    path.write_text(header + "\n" + row + "\n")
    return path


GENERIC = ("layers,hidden,heads,ffn,vocab,seq,gpu,nodes,gpus_per_node,tp,pp,dp,"
           "micro_batch,global_batch,iter_time_s")  # fmt: skip


def test_generic_format_reads(tmp_path):
    path = _write(tmp_path, GENERIC, "8,512,8,2048,8192,512,A100-80GB,1,8,2,2,2,1,16,0.5")
    (run,) = load_runs(path)
    assert run.measured == 0.5 and run.plan is not None and run.plan.dp == 2


@pytest.mark.parametrize(
    ("row", "column"),
    [
        ("8,512,8,2048,8192,512,A100-80GB,1,8,two,2,2,1,16,0.5", "tp"),
        ("8,512,8,2048,8192,512,A100-80GB,1,8,2,2,2,1,16,-3", "iter_time_s"),
        ("8,,8,2048,8192,512,A100-80GB,1,8,2,2,2,1,16,0.5", "hidden"),
    ],
)
def test_bad_cells_name_their_column(tmp_path, row, column):
    with pytest.raises(InputError) as info:
        load_runs(_write(tmp_path, GENERIC, row))
    assert info.value.field == column


def test_missing_column_is_named(tmp_path):
    header = GENERIC.replace("gpus_per_node,", "")
    with pytest.raises(InputError) as info:
        load_runs(_write(tmp_path, header, "8,512,8,2048,8192,512,A100-80GB,1,2,2,2,1,16,0.5"))
    assert info.value.field == "gpus_per_node"


def test_bad_amp_partition_is_named(tmp_path):
    text = (DATA / "amp_t4_homogeneous.csv").read_text().splitlines()
    bad = text[1].replace(",0;30,", ",0;31,")
    with pytest.raises(InputError) as info:
        load_runs(_write(tmp_path, text[0], bad))
    assert info.value.field == "layer_partition"
