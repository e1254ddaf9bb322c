"""The batch floors charge each stage's layers their gradient reduction among the fewest
pipelines a plan can have (``provision_batch.Sync``): by hand on made-up times, and below
every plan the searches rank where the charge raises the floor."""

import numpy as np
import pytest

from hetplan.cost.params import default_params
from hetplan.model import load_model
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.provision_batch import STEP, batch_floor_s, fewest_pipelines
from hetplan.search.provision_bounds import TypeFloor, iteration_floor_s, type_floor

from .conftest import one_offer


def _synthetic(batch: int, layer_s: float, reduce_s: float) -> TypeFloor:
    """One type at micro-batch size 1: TP 1 only, a layer in ``layer_s``, no fixed cost, a
    free embedding and head, and ``reduce_s`` a layer for its gradient reduction among two
    holders or more (none alone)."""
    table = ((0.0, 0.0) + (reduce_s,) * (batch - 1),)
    return TypeFloor((1,), (1.0,), (layer_s,), (0.0,), (0.0,), 0.0, (1,), ((layer_s,),),
                     ((0.0,),), ((0.0,),), (), table)  # fmt: skip


def test_fewest_pipelines_by_hand():
    """32 micro-batches; a stage holding a layer is busy at least 1 s a micro-batch, so a
    pipeline runs at most T of them: 3 pipelines at least within 12 or 14 s (32 / 14 > 2),
    2 within 16 s, 1 from 32 s on."""
    got = fewest_pipelines(32, 1.0, np.array([12.0, 14.0, 16.0, 32.0, 40.0]))
    assert got.tolist() == [3.0, 3.0, 2.0, 1.0, 1.0]


def test_reduction_raises_the_batch_floor_by_hand():
    """GPT-2's 12 layers at 1 s each, 32 micro-batches on 32 GPUs, 2 s a layer to reduce its
    gradients. Below 32 s some pipelines share the batch (one runs at most T micro-batches),
    so each stage of l layers and m micro-batches is busy l (m + 2) s. One GPU a micro-batch
    takes 12 x 3 = 36 s; m micro-batches on m GPUs need 12 / m layers a stage: 2 x 6 x 4 =
    24 s for m = 2, 4 x 5 = 20, 3 x 6 = 18, 2 x 8 = 16 and, for m = 12, 14 s (m = 24 would
    take 26 s): the floor is the last grid time below 14 s. Without the reduction the path,
    12 s, is the floor (12 stages of one layer, 12 micro-batches each)."""
    model = load_model("gpt2")
    assert model.layers == 12
    got = float(batch_floor_s(model, 32, [_synthetic(32, 1.0, 2.0)], np.array(32)))
    assert 14.0 / STEP <= got < 14.0
    free = float(batch_floor_s(model, 32, [_synthetic(32, 1.0, 0.0)], np.array(32)))
    assert free == pytest.approx(12.0, rel=1e-9)


def test_one_pipeline_for_the_whole_batch_pays_no_reduction_by_hand():
    """4 micro-batches on 4 GPUs, the same times: within 12 s a single pipeline could run all
    four (4 <= 12 / 1), and one pipeline reduces nothing, so the floor stays the path's 12 s
    however dear the reduction."""
    model = load_model("gpt2")
    got = float(batch_floor_s(model, 4, [_synthetic(4, 1.0, 100.0)], np.array(4)))
    assert got == pytest.approx(12.0, rel=1e-9)


@pytest.mark.parametrize(
    "name,gpu,per,batch,nodes",
    [
        ("gpt2", "V100-16GB", 2, 32, 16),
        ("gpt2", "RTX 3090", 1, 16, 16),
        ("gpt2-medium", "A100-40GB", 1, 16, 16),
    ],
)
def test_reduction_floor_below_every_ranked_plan(name, gpu, per, batch, nodes):
    """Configurations where the reduction raises the floors (slow networks, single-GPU nodes):
    they stay at most every plan the homogeneous search ranks."""
    model = load_model(name)
    offer = one_offer(gpu, per, nodes)
    node = offer.cluster(1).nodes[0]

    def floor(largest):
        f = type_floor(model, offer.gpu, per, batch, default_params(), "fp16", True, node, True,
                       largest)  # fmt: skip
        n = np.array(nodes * per)
        return max(float(batch_floor_s(model, batch, [f], n)),
                   float(iteration_floor_s(model, batch, [f], [n])))  # fmt: skip

    lb = floor(per)
    assert lb > floor(None) * 1.01  # the reduction binds here
    found = search_homogeneous(model, offer.cluster(nodes), batch, "fp16", top_k=40)
    assert found.ranked
    for plan, est in found.ranked:
        assert lb <= est.iteration_time_s * (1 + 1e-12), plan
