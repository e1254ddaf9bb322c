"""The homogeneous search's lower bound against estimate() on every fitting candidate of
clusters where its terms matter: single-GPU nodes (every transfer and reduction across the
network, data-parallel degrees that do not divide the batch), data-parallel groups that
straddle nodes, ZeRO-2/3 reducing every micro-batch, interleaving and lightened stages."""

import pytest

from hetplan.cost.estimate import estimate
from hetplan.cost.params import default_params
from hetplan.market import market_from_dict
from hetplan.model import load_model
from hetplan.search.homogeneous import score_candidates
from hetplan.search.homogeneous_candidates import SearchSpace
from hetplan.search.homogeneous_memory import SearchMemo
from hetplan.search.homogeneous_scoring import Scorer

CASES = [
    ("RTX 4090", 1, 37, "gpt3-1.3b", 96, "fp16"),
    ("L4", 1, 24, "gpt3-1.3b", 64, "fp16"),
    ("T4", 4, 6, "gpt3-1.3b", 64, "fp16"),
    ("V100-32GB", 8, 5, "gpt3-2.7b", 128, "fp16"),
    ("A100-80GB", 8, 3, "gpt3-2.7b", 48, "bf16"),
    ("RTX 4090", 1, 96, "gpt3-6.7b", 128, "fp16"),
]
SPACES = [
    SearchSpace(zero_stages=(0, 1, 2, 3), max_virtual_stages=4),
    SearchSpace(zero_stages=(1, 3), overlap_grad_reduce=False, overlap_tp_comm=True),
]


def _pairs(gpu, gpn, nodes, name, batch, precision, space):
    offer = {"gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1}
    cluster = market_from_dict({"offers": [offer]}).offers[0].cluster(nodes, "on-demand")
    model, params = load_model(name), default_params()
    scorer = Scorer(model, cluster, precision, batch, params, True, SearchMemo(), space)
    scored = score_candidates(model, cluster, batch, precision, params, space, True,
                              scorer=scorer, sync=False)  # fmt: skip
    assert scored.ranked
    for first, c in scored.ranked:
        plan = scorer.knob_plan(c)
        est = estimate(plan, model, cluster, params, validate=False).iteration_time_s
        yield c, first, scorer.bound_s(c), est


def _scorer(gpu, gpn, nodes, name, batch, precision, space):
    offer = {"gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1}
    cluster = market_from_dict({"offers": [offer]}).offers[0].cluster(nodes, "on-demand")
    model = load_model(name)
    return Scorer(model, cluster, precision, batch, default_params(), True, SearchMemo(), space)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[2]}" for c in CASES])
@pytest.mark.parametrize("space", SPACES, ids=["zero0-3", "no-overlap"])
def test_bound_holds_on_every_candidate_and_is_exact_without_pipelining(case, space):
    # below estimate() on every fitting candidate; the first step below the whole bound; a
    # single stage has no bubble and no transfer, so there the bound is the estimate itself
    # (m micro-batches back to back, ZeRO's per-micro-batch collectives, the reduction's
    # exposed tail, the optimizer step): before the bound priced ZeRO-2/3's per-micro-batch
    # reduce-scatter, it sat 5-9x below estimate() on those plans
    single = 0
    gpn, nodes = case[1], case[2]
    for c, first, bound, est in _pairs(*case, space):
        assert first <= bound <= est, (c, first, bound, est)
        if c.pp == 1:
            single += 1
            assert bound == pytest.approx(est, rel=1e-8), c
    assert single > 0 or (gpn == 1 and nodes > 64)  # (none fits on 96 RTX 4090s)


def test_bound_prices_the_reduction_behind_the_last_backward():
    # tp1 pp11 on 572 single-GPU nodes (52 replicas, the batch not divided): the gradient
    # reduction crosses the network and only the last backward hides it. With an unbounded
    # overlap window the bound sat 12-15% below estimate() on the ten best candidates; the
    # window of the last backward leaves only the pipeline's waits out
    case = ("RTX 4090", 1, 572, "gpt3-13b", 1024, "fp16")
    space = SearchSpace(zero_stages=(1,), max_virtual_stages=1)
    pairs = sorted(_pairs(*case, space), key=lambda x: x[1])[:10]
    assert min(bound / est for _, _, bound, est in pairs) > 0.9


def test_bound_holds_the_steady_state_of_one_f_one_b():
    # tp1 pp12 dp8 on 96 single-GPU nodes, 8 micro-batches of 2 per replica, full
    # recomputation: in 1F1B stage j starts micro-batch i + (12 - j) only after i's backward,
    # which waits for i's forward through the later stages, their backwards and two
    # transfers per hop; that cycle sets the replay's pace. Fill + m x own time + drain sat
    # 2.5% below estimate(); with the cycle the bound meets it
    case = ("RTX 4090", 1, 96, "gpt3-6.7b", 128, "fp16")
    space = SearchSpace(zero_stages=(1,), max_virtual_stages=1, recompute=("full",))
    pairs = [x for x in _pairs(*case, space) if (x[0].pp, x[0].micro_batch) == (12, 2)]
    assert len(pairs) == 1
    _, _, bound, est = pairs[0]
    assert 0.995 * est <= bound <= est


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[2]}" for c in CASES])
def test_replay_bound_holds_on_every_candidate(case):
    # the third step: pipeline 0's replay (the busiest replica's) on estimate's own chunk
    # times and transfers, plus the tails bound_s bounds: between bound_s and estimate() on
    # every fitting candidate, interleaved ones included; None only where it is not proven
    # (one stage, lightened chunks) or estimate() extrapolates its replay
    space = SearchSpace(zero_stages=(0, 1, 2, 3), max_virtual_stages=4)
    scorer = _scorer(*case, space)
    replayed = pipelined = 0
    for c, _, bound, est in _pairs(*case, space):
        pipelined += c.pp > 1 and not c.lightened
        rb = scorer.replay_bound_s(c)
        if rb is None:
            assert c.pp == 1 or c.lightened, c
            continue
        replayed += 1
        assert bound <= rb <= est, (c, bound, rb, est)
    assert replayed == pipelined


def test_replay_bound_catches_a_pipeline_paced_by_its_transfers():
    # GPT-3 13B on 12 V100 nodes, tp1 pp24 dp4: two stages a node, so every other hop
    # crosses nodes with all eight GPUs sending over the node's link. The closed forms (fill,
    # m x the busiest stage, the 1F1B cycle) sat 34% below estimate(): the round trips of
    # the transfers, not a stage, set the pace. Pipeline 0 runs the most micro-batches and
    # its replay is estimate()'s own, so the bound meets estimate() and estimate() then
    # reuses that replay instead of making it again
    from hetplan.cost import estimate as est_mod
    from hetplan.search.homogeneous_candidates import Candidate

    case = ("V100-32GB", 8, 12, "gpt3-13b", 256, "fp16")
    scorer = _scorer(*case, SearchSpace(zero_stages=(1,), max_virtual_stages=1))
    c = Candidate(tp=1, pp=24, dp=4, micro_batch=2, recompute="none", zero_stage=1,
                  schedule="1F1B", virtual_stages=1, sequence_parallel=False,
                  lightened=False)  # fmt: skip
    est_mod._REPLAYS.clear()
    bound, rb = scorer.bound_s(c), scorer.replay_bound_s(c)
    replays = len(est_mod._REPLAYS)
    est = estimate(scorer.knob_plan(c), scorer.model, scorer.cluster, scorer.params,
                   validate=False, layout=scorer.layout(c).sync).iteration_time_s  # fmt: skip
    assert bound < 0.7 * est
    assert rb == pytest.approx(est, rel=1e-8) and rb <= est
    assert replays == 1 and len(est_mod._REPLAYS) == 1


@pytest.mark.parametrize("share", [False, True], ids=["fresh-memo", "shared-memo"])
def test_cutoff_keeps_exactly_the_candidates_bounded_below_it(share):
    # under a cutoff, scoring keeps the candidates the uncut scoring ranks at or below it,
    # with the same bounds, whether their first bounds are at hand (a memo another search
    # filled: the memory check is then skipped for those above) or not
    gpu, gpn, nodes, name, batch, precision = CASES[3]
    offer = {"gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1}
    cluster = market_from_dict({"offers": [offer]}).offers[0].cluster(nodes, "on-demand")
    model, params, space = load_model(name), default_params(), SPACES[0]
    memo = SearchMemo()
    full = score_candidates(model, cluster, batch, precision, params, space, True, memo=memo,
                            sync=False)  # fmt: skip
    bounds = sorted(b for b, _ in full.ranked)
    cutoff = bounds[len(bounds) // 3]
    cut = score_candidates(model, cluster, batch, precision, params, space, True,
                           memo=memo if share else SearchMemo(), sync=False,
                           cutoff=cutoff)  # fmt: skip
    want = [(b, c) for b, c in full.ranked if b <= cutoff]
    assert 0 < len(want) < len(full.ranked)
    assert cut.ranked == want
