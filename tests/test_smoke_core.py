from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.model import load_model
from hetplan.search.layout import uniform_plan


def test_uniform_plan_estimate_runs_and_fits():
    model = load_model("gpt3-1.3b")
    cluster = parse_inline_cluster("A100-80GB:1x8")
    plan = uniform_plan(cluster, model.layers, 2, 2, 2, 1, 16, precision="bf16")
    est = estimate(plan, model, cluster)
    assert est.fits
    assert est.iteration_time_s > 0
    assert sum(v for k, v in est.breakdown.items() if k in {
        "forward_s", "backward_s", "recompute_s", "tensor_parallel_comm_s",
        "pipeline_bubble_s", "data_parallel_sync_s", "optimizer_s"}) == __import__(
        "pytest").approx(est.iteration_time_s)
