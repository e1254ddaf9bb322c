"""Every search's first plan against an exhaustive enumeration scored by ``estimate`` itself.

The enumerators here are written from the definitions of each search's plan space, not from
its code: they build ``Plan`` objects with the ``Stage``/``Pipeline``/``Plan`` constructors,
lay devices out themselves, keep what ``validate_plan`` accepts, score every plan with
``estimate`` and take the least ``iteration_time_s`` of those that fit. Nothing here calls
``enumerate_candidates``, ``candidate_plan``, ``uniform_plan``, ``even_layer_split``,
``divisors``, ``device_classes`` or any other search helper, so a search that skips part of
its own space, or ranks by anything but ``estimate``, shows up as a gap:
``gap = search_first_s / brute_best_s - 1`` (goal 0, negative when the search finds a plan
outside the enumerated space).

Homogeneous space (``search_homogeneous`` docstrings and SearchSpace): Megatron-layout plans
on every GPU, TP inside a node (tp divides the GPUs per node), then DP, then PP (rank
``(stage * dp + replica) * tp + t`` is the rank-th device in node order), equal batch shares,
layers split as evenly as possible with the extra layers on the stages nearest the middle
(inner stages before the first and last, ties to the earlier stage), at most one stage per
layer; every micro-batch dividing the replica's batch, recomputation, ZeRO stage (ZeRO only
with two replicas or more, ZeRO-2/3 only without pipelining, as the search documents),
1F1B or Interleaved1F1B with 2..max virtual stages (pipelined plans only; where the stages'
layers do not split into equal chunks, Llama 3's layout when ``layers + 2 = pp * v * n``,
n >= 1: chunks of n layers, the first stage's first and the last stage's last one lighter),
and sequence parallelism (with TP > 1 only).

Heterogeneous space (``search_heterogeneous`` docstrings): device classes (same GPU type,
GPUs per node and links), a TP degree per class, micro-batch in (1, 2, 4, 8),
recomputation none or full (flash attention), 1F1B; any number of pipelines on disjoint TP
groups (idle GPUs allowed), each a sequence of stages whose classes form contiguous blocks
in any class order, any contiguous layer split (>= 1 layer per stage), any stage-to-node
placement, any per-pipeline number of micro-batches (>= 1, summing to the batch), ZeRO-1 from
two pipelines on, sequence parallelism where some stage has TP > 1. Its result pool also
holds the best single-type plan (the homogeneous search on each class), so that space is
enumerated too. Two reductions keep this tractable and are checked below: ``estimate`` does
not depend on the order of the pipelines nor on which GPUs of a node a stage gets.

Provisioning (single-type configurations, objectives time and cost): every node count of
every offer, each with the best plan of the homogeneous space at ``PROVISION_SPACE``'s knob
ranges plus ZeRO-0 (which it calls dominated by ZeRO-1: kept, so that the claim is checked,
and so that one-replica plans, where ZeRO-1 is not allowed, are in), time to train and cost
from ``estimate``.

Cases marked xfail fail at commits ebe8d2c and 9d98d76 (the heterogeneous search ranks by
its modelled time, issue 13); at a5c74f7 every homogeneous seed below from 49 on, the
32-GPU issue case, the heterogeneous seeds 16-50 and every provisioning case failed too.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest

from hetplan.cluster import Cluster, Node, parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.cost.estimate_result import Estimate
from hetplan.cost.params import CostParams, default_params
from hetplan.errors import InputError
from hetplan.hardware import get_gpu
from hetplan.market import market_from_dict
from hetplan.model import ModelSpec, load_model
from hetplan.plan import Pipeline, Plan, Stage, validate_plan
from hetplan.search.heterogeneous import search_heterogeneous
from hetplan.search.homogeneous import search_homogeneous
from hetplan.search.homogeneous_candidates import SearchSpace
from hetplan.search.provision import provision

TOL = 1e-9
"""Equal up to float noise."""
XFAIL = "search ranks by closed form; see issue 13"
RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1F1B", "Interleaved1F1B")


# --------------------------------------------------------------------------- definitions


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _middle_first_split(layers: int, stages: int) -> tuple[int, ...]:
    """Layers per stage as even as possible; each extra layer goes to the free stage nearest
    the middle, inner stages before the first and the last, ties to the earlier stage."""
    base, extra = divmod(layers, stages)
    out = [base] * stages
    ends = {0, stages - 1}
    taken: set[int] = set()
    for _ in range(extra):
        best = None
        for i in range(stages):
            if i in taken:
                continue
            rank = (i in ends, abs(2 * i - stages), i)  # |i - stages/2|, doubled
            if best is None or rank < best[0]:
                best = (rank, i)
        assert best is not None
        taken.add(best[1])
        out[best[1]] += 1
    return tuple(out)


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Yields every way to write ``total`` as ``parts`` positive integers, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _device_names(nodes: tuple[Node, ...] | list[Node]) -> list[str]:
    return [f"{n.name}:{i}" for n in nodes for i in range(n.gpus)]


@dataclass
class Brute:
    """The best plan of an exhaustive enumeration, by ``estimate``."""

    best_s: float = math.inf
    best: Plan | None = None
    built: int = 0
    """Plans built (before validation)."""
    scored: int = 0
    """Plans that validated and were scored by estimate."""
    fitting: int = 0
    seconds: float = 0.0

    def offer(
        self,
        plan: Plan,
        model: ModelSpec,
        cluster: Cluster,
        params: CostParams,
        weight: Callable[[Plan], float] | None = None,
    ) -> Estimate | None:
        """Validates and scores one plan (its iteration time, x ``weight(plan)`` where
        given), keeping the best that fits; returns its estimate where it fits."""
        self.built += 1
        try:
            validate_plan(plan, model, cluster)
        except InputError:
            return None
        self.scored += 1
        est = estimate(plan, model, cluster, params, validate=False)
        if not est.fits:
            return None
        self.fitting += 1
        score = est.iteration_time_s * (weight(plan) if weight is not None else 1.0)
        if score < self.best_s:
            self.best_s, self.best = score, plan
        return est

    def merge(self, other: Brute) -> None:
        """Adds another enumeration's counts and best."""
        self.built += other.built
        self.scored += other.scored
        self.fitting += other.fitting
        if other.best_s < self.best_s:
            self.best_s, self.best = other.best_s, other.best


def gap(search_s: float, brute_s: float) -> float:
    """Returns how much slower the search's first plan is than the exhaustive best."""
    if math.isinf(brute_s):
        return 0.0 if math.isinf(search_s) else -1.0
    return search_s / brute_s - 1.0


def rescore(plan: Plan, model: ModelSpec, cluster: Cluster, params: CostParams) -> Estimate:
    """Returns estimate() of a search's plan, validated here rather than trusted."""
    validate_plan(plan, model, cluster)
    est = estimate(plan, model, cluster, params)
    assert est.fits
    return est


# --------------------------------------------------------------------------- homogeneous


@dataclass(frozen=True)
class Knobs:
    """Knob ranges shared by the enumerator and the search's SearchSpace."""

    recompute: tuple[str, ...] = RECOMPUTE
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    max_virtual_stages: int = 8
    sequence_parallel: tuple[bool, ...] = (False, True)
    micro_batch: tuple[int, ...] | None = None
    schedules: tuple[str, ...] = SCHEDULES

    def space(self) -> SearchSpace:
        """Returns the search's SearchSpace with the same ranges."""
        return SearchSpace(
            recompute=self.recompute,
            zero_stages=self.zero_stages,
            max_virtual_stages=self.max_virtual_stages,
            sequence_parallel=self.sequence_parallel,
            micro_batch=self.micro_batch,
            schedules=self.schedules,
        )


def megatron_plan(
    nodes: tuple[Node, ...] | list[Node],
    layers: int,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    global_batch: int,
    **options: object,
) -> Plan:
    """Returns the Megatron-layout plan: rank ``(s * dp + r) * tp + t`` is the rank-th device
    in node order (TP innermost, then DP, then PP). Where ``dp`` does not divide the batch,
    replica r runs M // dp micro-batches, one more for the first M % dp (M = batch / mb)."""
    devs = _device_names(nodes)
    total = global_batch // micro_batch
    shares = (
        [global_batch // dp] * dp
        if global_batch % dp == 0
        else [(total // dp + (r < total % dp)) * micro_batch for r in range(dp)]
    )
    split = _middle_first_split(layers, pp)
    v = int(options.get("virtual_stages", 1))  # type: ignore[call-overload]
    chunks: list[tuple[int, ...] | None] = [None] * pp
    if v > 1 and any(x % v for x in split):
        # Llama 3's layout: pp * v chunks of n layers, the first stage's first chunk and the
        # last stage's last chunk one lighter (layers + 2 = pp * v * n)
        n = (layers + 2) // (pp * v)
        chunks = [(n,) * v for _ in range(pp)]
        chunks[0] = (n - 1,) + (n,) * (v - 1)
        chunks[-1] = (n,) * (v - 1) + (n - 1,)
    pipelines = []
    for r in range(dp):
        stages = []
        for s in range(pp):
            rank0 = (s * dp + r) * tp
            devices = tuple(devs[rank0 + t] for t in range(tp))
            stages.append(Stage(split[s], devices, chunks[s]))
        pipelines.append(Pipeline(shares[r], tuple(stages)))
    return Plan(
        global_batch_size=global_batch,
        micro_batch_size=micro_batch,
        pipelines=tuple(pipelines),
        **options,  # type: ignore[arg-type]
    )


def homogeneous_plans(
    model: ModelSpec,
    nodes: tuple[Node, ...] | list[Node],
    global_batch: int,
    precision: str,
    knobs: Knobs,
    flash: bool = True,
) -> Iterator[Plan]:
    """Yields every plan of the homogeneous space (validation left to the caller)."""
    n = sum(x.gpus for x in nodes)
    gpn = nodes[0].gpus
    for tp in _divisors(gpn):
        for pp in _divisors(n // tp):
            if pp > model.layers:
                continue
            dp = n // (tp * pp)
            if dp > global_batch:
                continue
            split = _middle_first_split(model.layers, pp)
            # every micro-batch size whose micro-batches leave no replica idle (dp need not
            # divide the batch: then the replicas' counts differ by one)
            for mb in _divisors(global_batch):
                if global_batch // mb < dp or (
                    global_batch % dp == 0 and (global_batch // dp) % mb
                ):
                    continue
                if knobs.micro_batch is not None and mb not in knobs.micro_batch:
                    continue
                total = global_batch // mb
                counts = {total // dp, -(-total // dp)}
                schedules = []
                if "1F1B" in knobs.schedules:
                    schedules.append(("1F1B", 1))
                # PyTorch's ScheduleInterleaved1F1B runs m micro-batches in max(1, m // pp)
                # rounds of equal groups, at least pp of them (its docstring's rule)
                if ("Interleaved1F1B" in knobs.schedules and pp > 1
                        and all(m >= pp and m % max(1, m // pp) == 0 for m in counts)):  # fmt: skip
                    for v in range(2, knobs.max_virtual_stages + 1):
                        if all(x % v == 0 for x in split):
                            schedules.append(("Interleaved1F1B", v))
                        elif (model.layers + 2) % (pp * v) == 0:
                            schedules.append(("Interleaved1F1B", v))  # first/last lighter
                zeros = [z for z in knobs.zero_stages if (z == 0 or dp > 1) and (z < 2 or pp == 1)]
                for rc in knobs.recompute:
                    for zero in zeros:
                        for sched, v in schedules:
                            for sp in knobs.sequence_parallel:
                                if sp and tp == 1:
                                    continue
                                yield megatron_plan(
                                    nodes, model.layers, tp, pp, dp, mb, global_batch,
                                    precision=precision, recompute=rc, zero_stage=zero,
                                    schedule=sched, virtual_stages=v, sequence_parallel=sp,
                                    flash_attention=flash,
                                )  # fmt: skip


def brute_homogeneous(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    knobs: Knobs,
    params: CostParams | None = None,
    nodes: tuple[Node, ...] | None = None,
    flash: bool = True,
) -> Brute:
    """Returns the best homogeneous plan on ``nodes`` (default: every node) by estimate."""
    params = params or default_params()
    start = time.perf_counter()
    out = Brute()
    on = nodes if nodes is not None else cluster.nodes
    for plan in homogeneous_plans(model, on, global_batch, precision, knobs, flash):
        out.offer(plan, model, cluster, params)
    out.seconds = time.perf_counter() - start
    return out


@dataclass(frozen=True)
class HomCase:
    """One homogeneous case: model, cluster, batch, precision and knob ranges."""

    model: str | ModelSpec
    cluster: str
    batch: int
    precision: str
    knobs: Knobs = field(default_factory=Knobs)

    def name(self) -> str:
        """Returns a short label."""
        m = self.model if isinstance(self.model, str) else self.model.name
        return f"{m} {self.cluster} b{self.batch} {self.precision}"

    def spec(self) -> ModelSpec:
        """Returns the model."""
        return load_model(self.model) if isinstance(self.model, str) else self.model


@dataclass
class Outcome:
    """A search's first plan against the exhaustive best."""

    case: str
    brute: Brute
    search_s: float
    search_seconds: float
    gap: float


def run_homogeneous(case: HomCase, params: CostParams | None = None) -> Outcome:
    """Runs the search and the enumeration on one case."""
    params = params or default_params()
    model, cluster = case.spec(), parse_inline_cluster(case.cluster)
    brute = brute_homogeneous(model, cluster, case.batch, case.precision, case.knobs, params)
    start = time.perf_counter()
    res = search_homogeneous(model, cluster, case.batch, case.precision, top_k=1,
                             params=params, space=case.knobs.space())  # fmt: skip
    took = time.perf_counter() - start
    first = res.ranked[0][0] if res.ranked else None
    search_s = (
        math.inf if first is None else rescore(first, model, cluster, params).iteration_time_s
    )
    return Outcome(case.name(), brute, search_s, took, gap(search_s, brute.best_s))


HOM_GPUS = ("T4", "V100-16GB", "V100-32GB", "A10", "L4", "A100-40GB", "A100-80GB", "H100-80GB")
HOM_MODELS = ("gpt2", "gpt2-medium", "gpt3-350m", "gpt3-760m", "gpt3-1.3b", "gpt3-2.7b")


def random_hom_case(seed: int, max_gpus: int = 32) -> HomCase:
    """Returns a seeded random homogeneous case (<= ``max_gpus`` GPUs); every other case
    narrows the knob ranges (the same ranges go to the search's SearchSpace)."""
    rng = random.Random(seed)
    gpu = rng.choice(HOM_GPUS)
    gpn = rng.choice([2, 4, 8])
    nodes = rng.choice([n for n in (1, 2, 3, 4, 8, 16) if n * gpn <= max_gpus])
    batch = rng.choice([16, 32, 64, 128, 256])
    precision = rng.choice(
        [p for p in ("fp16", "bf16", "fp32", "tf32") if get_gpu(gpu).supports(p)]
    )
    knobs = Knobs()
    if rng.random() < 0.5:
        knobs = Knobs(
            recompute=tuple(rng.sample(RECOMPUTE, rng.choice([1, 2, 3]))),
            zero_stages=tuple(sorted(rng.sample((0, 1, 2, 3), rng.choice([2, 3, 4])))),
            max_virtual_stages=rng.choice([2, 4, 8]),
            sequence_parallel=rng.choice([(False,), (False, True)]),
            micro_batch=rng.choice([None, (1, 2, 4, 8)]),
        )
    return HomCase(rng.choice(HOM_MODELS), f"{gpu}:{nodes}x{gpn}", batch, precision, knobs)


# --------------------------------------------------------------------------- heterogeneous

HET_MICRO_BATCHES = (1, 2, 4, 8)


def node_classes(cluster: Cluster, precision: str) -> list[tuple[Node, ...]]:
    """Returns the nodes grouped by (GPU type, GPUs per node, links), in order of first
    appearance, leaving out GPU types without ``precision``."""
    by_key: dict[tuple[object, ...], list[Node]] = {}
    for node in cluster.nodes:
        key = (node.gpu.name, node.gpus, node.intra_node_bytes_per_s, node.network_bytes_per_s)
        by_key.setdefault(key, []).append(node)
    return [tuple(v) for v in by_key.values() if v[0].gpu.supports(precision)]


@dataclass(frozen=True)
class PlacedPipeline:
    """One pipeline's shape: per stage, the node it runs on and its layers."""

    nodes: tuple[int, ...]
    """Index of each stage's node in the cluster."""
    layers: tuple[int, ...]


def _class_sequences(counts: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Yields stage class sequences with ``counts[k]`` stages of class k, each class one
    contiguous block, blocks in every order."""
    used = [k for k, c in enumerate(counts) if c]
    for order in itertools.permutations(used):
        yield tuple(k for k in order for _ in range(counts[k]))


def placed_pipelines(
    classes: list[tuple[int, ...]], tps: tuple[int, ...], gpus: list[int], layers: int
) -> list[PlacedPipeline]:
    """Returns every pipeline shape that fits the cluster on its own: class counts, block
    order, a node per stage, and a layer split with >= 1 layer per stage.

    ``classes[k]``: node indices of class k; ``tps[k]``: its TP degree; ``gpus[i]``: GPUs
    of node i."""
    most = [sum(gpus[i] // tps[k] for i in nodes) for k, nodes in enumerate(classes)]
    out = []
    for counts in itertools.product(*(range(min(m, layers) + 1) for m in most)):
        p = sum(counts)
        if not 1 <= p <= layers:
            continue
        for seq in _class_sequences(counts):
            for place in itertools.product(*(classes[k] for k in seq)):
                used: dict[int, int] = {}
                for k, i in zip(seq, place, strict=True):
                    used[i] = used.get(i, 0) + tps[k]
                if any(used[i] > gpus[i] for i in used):
                    continue
                for split in _compositions(layers, p):
                    out.append(PlacedPipeline(place, split))
    return out


def _multisets(
    shapes: list[PlacedPipeline], node_tp: dict[int, int], gpus: list[int], most: int
) -> Iterator[tuple[int, ...]]:
    """Yields multisets (sorted shape indices) of 1..``most`` pipelines whose stages fit
    the nodes together."""
    need = [{i: sum(node_tp[i] for j in s.nodes if j == i) for i in set(s.nodes)} for s in shapes]
    free = list(gpus)

    def rec(start: int, chosen: list[int]) -> Iterator[tuple[int, ...]]:
        if chosen:
            yield tuple(chosen)
        if len(chosen) == most:
            return
        for idx in range(start, len(shapes)):
            if all(free[i] >= g for i, g in need[idx].items()):
                for i, g in need[idx].items():
                    free[i] -= g
                chosen.append(idx)
                yield from rec(idx, chosen)
                chosen.pop()
                for i, g in need[idx].items():
                    free[i] += g

    yield from rec(0, [])


def _batch_splits(chosen: tuple[int, ...], total: int) -> Iterator[tuple[int, ...]]:
    """Yields micro-batches per pipeline (>= 1, summing to ``total``), once per distinct
    assignment up to swapping pipelines of the same shape."""
    seen: set[tuple[tuple[int, int], ...]] = set()
    for ms in _compositions(total, len(chosen)):
        key = tuple(sorted(zip(chosen, ms, strict=True)))
        if key not in seen:
            seen.add(key)
            yield ms


@dataclass(frozen=True)
class HetKnobs:
    """Per-plan knob ranges of the heterogeneous space. The default is the space the
    committed search documents (recomputation none or full, ZeRO-1 from two pipelines on,
    sequence parallelism wherever a stage has TP > 1, 1F1B); ``WIDE_HET`` adds selective
    recomputation, ZeRO 0-3, sequence parallelism off, and Interleaved1F1B."""

    micro_batches: tuple[int, ...] = HET_MICRO_BATCHES
    recompute: tuple[str, ...] = ("none", "full")
    multi_zero: tuple[int, ...] = (1,)
    """ZeRO stages of plans with two pipelines or more (one pipeline: ZeRO-0)."""
    sequence_parallel: tuple[bool, ...] | None = None
    """None: on exactly where some stage has TP > 1; else these, on only with TP > 1."""
    max_virtual_stages: int = 1


WIDE_HET = HetKnobs(
    recompute=RECOMPUTE, multi_zero=(0, 1, 2, 3), sequence_parallel=(False, True),
    max_virtual_stages=8,
)  # fmt: skip


def heterogeneous_plans(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    knobs: HetKnobs = HetKnobs(),
    flash: bool = True,
) -> Iterator[Plan]:
    """Yields every plan of the heterogeneous space (see the module docstring)."""
    nodes = list(cluster.nodes)
    index = {n.name: i for i, n in enumerate(nodes)}
    gpus = [n.gpus for n in nodes]
    classes = [tuple(index[n.name] for n in c) for c in node_classes(cluster, precision)]
    for tps in itertools.product(*(_divisors(gpus[c[0]]) for c in classes)):
        node_tp = {i: t for c, t in zip(classes, tps, strict=True) for i in c}
        shapes = placed_pipelines(classes, tps, gpus, model.layers)
        for mb in knobs.micro_batches:
            if global_batch % mb:
                continue
            total = global_batch // mb
            for chosen in _multisets(shapes, node_tp, gpus, total):
                for ms in _batch_splits(chosen, total):
                    nxt = [0] * len(nodes)
                    pipes = []
                    for idx, m in zip(chosen, ms, strict=True):
                        stages = []
                        for i, x in zip(shapes[idx].nodes, shapes[idx].layers, strict=True):
                            t = node_tp[i]
                            devs = tuple(f"{nodes[i].name}:{nxt[i] + g}" for g in range(t))
                            nxt[i] += t
                            stages.append(Stage(x, devs))
                        pipes.append(Pipeline(m * mb, tuple(stages)))
                    yield from _het_variants(pipes, global_batch, mb, precision, knobs, flash)


def _het_variants(
    pipes: list[Pipeline],
    global_batch: int,
    mb: int,
    precision: str,
    knobs: HetKnobs,
    flash: bool,
) -> Iterator[Plan]:
    """Yields the plans of one set of pipelines under every per-plan knob."""
    any_tp = any(s.tp > 1 for p in pipes for s in p.stages)
    sps = (any_tp,) if knobs.sequence_parallel is None else knobs.sequence_parallel
    schedules = [("1F1B", 1)]
    for v in range(2, knobs.max_virtual_stages + 1):
        # every stage's layers split into v chunks; pipelined ones run their m micro-batches
        # in PyTorch's equal groups: m >= p and m a multiple of max(1, m // p) (the
        # ScheduleInterleaved1F1B docstring's rule, checked here to save work)
        def groups(m: int, p: int) -> bool:
            return m >= p and m % max(1, m // p) == 0

        if all(
            s.layers % v == 0 and (len(p.stages) == 1 or groups(p.batch_size // mb, len(p.stages)))
            for p in pipes
            for s in p.stages
        ):
            schedules.append(("Interleaved1F1B", v))
    for rc in knobs.recompute:
        for zero in (0,) if len(pipes) == 1 else knobs.multi_zero:
            for sp in sps:
                if sp and not any_tp:
                    continue
                for sched, v in schedules:
                    yield Plan(
                        global_batch_size=global_batch,
                        micro_batch_size=mb,
                        pipelines=tuple(pipes),
                        precision=precision,
                        recompute=rc,
                        zero_stage=zero,
                        schedule=sched,
                        virtual_stages=v,
                        sequence_parallel=sp,
                        flash_attention=flash,
                    )


def brute_heterogeneous(
    model: ModelSpec,
    cluster: Cluster,
    global_batch: int,
    precision: str,
    params: CostParams | None = None,
    single_type: bool = True,
    flash: bool = True,
    knobs: HetKnobs = HetKnobs(),
) -> Brute:
    """Returns the best plan of the heterogeneous space by estimate; with ``single_type``
    also of the homogeneous space on each class (the search's own single-type pool)."""
    params = params or default_params()
    start = time.perf_counter()
    out = Brute()
    for plan in heterogeneous_plans(model, cluster, global_batch, precision, knobs, flash):
        out.offer(plan, model, cluster, params)
    if single_type:
        for nodes in node_classes(cluster, precision):
            out.merge(
                brute_homogeneous(
                    model, cluster, global_batch, precision, Knobs(), params, nodes, flash
                )
            )
    out.seconds = time.perf_counter() - start
    return out


@dataclass(frozen=True)
class HetCase:
    """One heterogeneous case."""

    model: ModelSpec
    cluster: str
    batch: int
    precision: str = "fp16"

    def name(self) -> str:
        """Returns a short label."""
        return f"{self.model.name} {self.cluster} b{self.batch} {self.precision}"


def run_heterogeneous(
    case: HetCase, params: CostParams | None = None, knobs: HetKnobs = HetKnobs()
) -> Outcome:
    """Runs the heterogeneous search and the enumeration on one case."""
    params = params or default_params()
    cluster = parse_inline_cluster(case.cluster)
    brute = brute_heterogeneous(case.model, cluster, case.batch, case.precision, params,
                                knobs=knobs)  # fmt: skip
    start = time.perf_counter()
    res = search_heterogeneous(case.model, cluster, case.batch, case.precision, top_k=1,
                               params=params)  # fmt: skip
    took = time.perf_counter() - start
    search_s = (
        rescore(res.ranked[0][0], case.model, cluster, params).iteration_time_s
        if res.ranked
        else math.inf
    )
    return Outcome(case.name(), brute, search_s, took, gap(search_s, brute.best_s))


def tiny_model(layers: int, hidden: int, heads: int = 16, seq: int = 2048) -> ModelSpec:
    """Returns a GPT-shaped model with few layers (names say layers and width)."""
    return ModelSpec(f"gpt-{layers}L-{hidden}", "gpt", layers, hidden, heads, heads, 4 * hidden,
                     50257, seq)  # fmt: skip


HET_GPUS = ("A100-80GB", "A100-40GB", "V100-32GB", "V100-16GB", "T4", "A10", "L4")


def random_het_case(seed: int, one_node_per_type: bool = True) -> HetCase:
    """Returns a seeded random tiny mixed case: 2-3 GPU types, 2-6 GPUs, 2-8 layers.

    With ``one_node_per_type`` every type sits on one node, so where a stage runs is
    fixed by its type (the search maps stages to nodes in two fixed ways only)."""
    rng = random.Random(seed)
    k = rng.choice([2, 2, 3])
    types = rng.sample(HET_GPUS, k)
    shapes = ["1x1", "1x2"] if one_node_per_type else ["1x1", "1x2", "2x1"]
    while True:
        spec = ",".join(f"{t}:{rng.choice(shapes)}" for t in types)
        if parse_inline_cluster(spec).num_gpus <= (6 if k == 2 else 5):
            break
    model = tiny_model(rng.choice([2, 3, 4, 6, 8]), rng.choice([1024, 2048, 4096, 5120]))
    return HetCase(model, spec, rng.choice([4, 8, 16]))


# --------------------------------------------------------------------------- provisioning

PROVISION_KNOBS = Knobs(zero_stages=(0, 1, 2, 3), max_virtual_stages=4)
"""The provisioning search's SearchSpace ranges (ZeRO 1-3, up to 4 virtual stages) plus
ZeRO-0, which it calls dominated by ZeRO-1: kept, so that the claim is checked too."""


@dataclass(frozen=True)
class ProvisionCase:
    """A small market (single-type configurations only) and a training run."""

    model: str | ModelSpec
    offers: tuple[tuple[str, int, int, float], ...]
    """(GPU, GPUs per node, most nodes, on-demand $/GPU-hour) per offer."""
    batch: int
    precision: str = "fp16"
    tokens: float = 1e9

    def name(self) -> str:
        """Returns a short label."""
        m = self.model if isinstance(self.model, str) else self.model.name
        offers = ",".join(f"{g}:<={n}x{k}" for g, k, n, _ in self.offers)
        return f"{m} market[{offers}] b{self.batch} {self.precision}"

    def spec(self) -> ModelSpec:
        """Returns the model."""
        return load_model(self.model) if isinstance(self.model, str) else self.model

    def market_dict(self) -> dict[str, object]:
        """Returns the market file's mapping."""
        return {
            "offers": [
                {"gpu": g, "gpus_per_node": k, "max_nodes": n, "on_demand_usd_per_gpu_hour": usd}
                for g, k, n, usd in self.offers
            ]
        }


@dataclass
class ProvisionOutcome:
    """The provisioning search's recommendations against the exhaustive best."""

    case: str
    brute: Brute
    brute_time_s: float
    brute_cost_usd: float
    search_time_s: float
    search_cost_usd: float
    time_gap: float
    cost_gap: float
    search_seconds: float
    configurations: int


def run_provision(case: ProvisionCase, params: CostParams | None = None) -> ProvisionOutcome:
    """Runs provisioning (objectives time and cost) and the enumeration of every node count
    of every offer."""
    params = params or default_params()
    model = case.spec()
    market = market_from_dict(case.market_dict())
    tokens_per_iter = case.batch * model.seq
    brute = Brute()
    best_t, best_c, configs = math.inf, math.inf, 0
    start = time.perf_counter()
    for offer in market.offers:
        if not offer.gpu.supports(case.precision):
            continue
        price = offer.on_demand_usd_per_gpu_hour
        for count in range(1, offer.max_nodes + 1):
            configs += 1
            nodes = tuple(
                Node(f"{offer.name}-{i}", offer.gpu, offer.gpus_per_node,
                     offer.intra_node_bytes_per_s, offer.network_bytes_per_s, price)
                for i in range(count)
            )  # fmt: skip
            cluster = Cluster(nodes)
            one = brute_homogeneous(
                model, cluster, case.batch, case.precision, PROVISION_KNOBS, params
            )
            brute.merge(one)
            if math.isinf(one.best_s):
                continue
            t = case.tokens / tokens_per_iter * one.best_s
            best_t = min(best_t, t)
            best_c = min(best_c, t / 3600 * price * count * offer.gpus_per_node)
    brute.seconds = time.perf_counter() - start
    out = []
    start = time.perf_counter()
    for objective in ("time", "cost"):
        res = provision(model, market, case.tokens, case.batch, case.precision,
                        objective=objective, params=params, mixes=False)  # fmt: skip
        p = res.recommended
        if p is None or p.plan is None or p.cluster is None:
            out.append((math.inf, math.inf))
            continue
        est = rescore(p.plan, model, p.cluster, params)
        t = case.tokens / est.tokens_per_s
        out.append((t, t / 3600 * p.usd_per_hour))
    took = time.perf_counter() - start
    (t_time, _), (_, c_cost) = out
    return ProvisionOutcome(
        case.name(), brute, best_t, best_c, t_time, c_cost, gap(t_time, best_t),
        gap(c_cost, best_c), took, configs,
    )  # fmt: skip


# --------------------------------------------------------------------------- tests


def _params(seeds: list[int], failing: set[int]) -> list[object]:
    return [
        pytest.param(s, id=f"seed{s}", marks=pytest.mark.xfail(strict=False, reason=XFAIL))
        if s in failing
        else pytest.param(s, id=f"seed{s}")
        for s in seeds
    ]


def _check(out: Outcome) -> None:
    assert out.brute.scored > 0, f"{out.case}: the enumeration is empty"
    assert math.isinf(out.search_s) == math.isinf(out.brute.best_s), (
        f"{out.case}: search {out.search_s} s, exhaustive best {out.brute.best_s} s"
    )
    assert out.gap <= TOL, (
        f"{out.case}: search's first plan {out.search_s:.6g} s, exhaustive best "
        f"{out.brute.best_s:.6g} s over {out.brute.fitting} fitting plans ({out.gap:+.3%}): "
        f"{out.brute.best}"
    )


HOM_SEEDS = [*range(16), 49, 66, 91, 160, 168, 178, 295, 372, 390, 9002]
"""Seeds 0-15, and those of 16-399 whose case failed at a5c74f7 (closed-form ranking, gaps of
0.5% to 13.5%); all of 0-399 pass at ebe8d2c. 9002 (``bench_search_gap --wide --seed
9000``): its space leaves ZeRO-1 out (ZeRO 0, 2, 3), and the search still dropped ZeRO-3
plans whose replicas run unequal micro-batch counts as dominated by their ZeRO-1 twin, which
that space does not have (8.1% slower than the exhaustive best before that was fixed)."""
HOM_FAILING_TODAY: set[int] = set()


@pytest.mark.parametrize("seed", _params(HOM_SEEDS, HOM_FAILING_TODAY))
def test_homogeneous_first_plan_is_the_exhaustive_best(seed):
    _check(run_homogeneous(random_hom_case(seed)))


def test_homogeneous_issue_case_at_32_gpus():
    """The issue's gpt3-2.7b on V100-16GB with batch 256, on 4 nodes instead of 8."""
    _check(run_homogeneous(HomCase("gpt3-2.7b", "V100-16GB:4x8", 256, "fp16")))


HET_SEEDS = [2, 5, 11, 16, 18, 21, 22, 30, 40, 43, 47, 50]
"""Cases of up to ~6,500 plans. Of seeds 0-59, 5, 10, 22, 40, 43, 50 and 58 fail at ebe8d2c
(10 and 58, of 30,000 and 12,000 plans, are left to the bench); 16, 21 and 30 failed at
a5c74f7."""
HET_FAILING_TODAY: set[int] = set()


@pytest.mark.parametrize("seed", _params(HET_SEEDS, HET_FAILING_TODAY))
def test_heterogeneous_first_plan_is_the_exhaustive_best(seed):
    _check(run_heterogeneous(random_het_case(seed)))


def test_estimate_ignores_pipeline_order_and_which_gpus_of_a_node():
    """The two reductions of the heterogeneous enumeration: pipelines as a multiset, and a
    stage's GPUs taken in order inside its node."""
    model = tiny_model(4, 1024)
    cluster = parse_inline_cluster("A100-80GB:1x4,V100-32GB:2x2,T4:1x2")
    params = default_params()
    flip = {n.name: list(reversed(range(n.gpus))) for n in cluster.nodes}

    def moved(d: str) -> str:
        node, _, i = d.rpartition(":")
        return f"{node}:{flip[node][int(i)]}"

    checked = 0
    for k, plan in enumerate(heterogeneous_plans(model, cluster, 8, "fp16")):
        if k % 97 or plan.dp < 2:
            continue
        other = replace(
            plan,
            pipelines=tuple(
                Pipeline(p.batch_size, tuple(Stage(s.layers, tuple(map(moved, s.devices)))
                                             for s in p.stages))
                for p in reversed(plan.pipelines)
            ),
        )  # fmt: skip
        a = estimate(plan, model, cluster, params)
        b = estimate(other, model, cluster, params)
        assert a.fits == b.fits
        assert b.iteration_time_s == pytest.approx(a.iteration_time_s, rel=1e-12)
        checked += 1
        if checked == 60:
            break
    assert checked == 60


def test_estimate_ignores_pipeline_order_under_zero_2_and_3_on_mixed_types():
    """ZeRO-2/3's per-micro-batch collectives on a data-parallel group of two GPU types:
    the share of them that runs beside compute was the first listed member's, so listing
    the A100-40GB replica first (its fitted share near 0) or the A100-80GB one (0.85)
    moved the prediction by up to 46% on these plans (336 of 7,982 pairs over 60 seeded
    cases). A collective ends for every member together: the group's least share."""
    model = tiny_model(6, 1024)
    cluster = parse_inline_cluster("A100-40GB:2x1,A100-80GB:1x2")
    params = default_params()
    a40, a80 = params.gpu("A100-40GB").grad_overlap, params.gpu("A100-80GB").grad_overlap
    assert abs(a40 - a80) > 0.1  # else this case could not tell the order apart
    checked = seen = 0
    for plan in heterogeneous_plans(model, cluster, 8, "fp16", WIDE_HET):
        kinds = {cluster.device_node(p.stages[0].devices[0]).gpu.name for p in plan.pipelines}
        if plan.zero_stage < 2 or len(kinds) < 2:
            continue
        seen += 1
        if seen % 3:
            continue
        other = replace(plan, pipelines=tuple(reversed(plan.pipelines)))
        a = estimate(plan, model, cluster, params)
        b = estimate(other, model, cluster, params)
        assert b.iteration_time_s == pytest.approx(a.iteration_time_s, rel=1e-12), plan
        checked += 1
        if checked == 40:
            break
    assert checked == 40


def test_heterogeneous_first_plan_with_wide_knobs_on_two_a100_types():
    """``bench_search_gap --wide`` seed 4262 (1 A100-40GB + 1 A100-80GB, ZeRO 0-3): the
    search's first plan was 3.8% slower than the exhaustive best, the same plan with its
    replicas listed the other way round (see the test above)."""
    _check(run_heterogeneous(random_het_case(4262), knobs=WIDE_HET))


def test_the_enumerations_cover_what_they_claim():
    """Spot checks of the enumerators themselves, so that a gap of 0 means something."""
    model = tiny_model(4, 1024)
    # homogeneous: 8 GPUs on 2 nodes, batch 8, every knob
    cl = parse_inline_cluster("A100-80GB:2x4")
    plans = list(homogeneous_plans(model, cl.nodes, 8, "bf16", Knobs()))
    degrees = {(p.pipelines[0].stages[0].tp, len(p.pipelines[0].stages), p.dp) for p in plans}
    assert degrees == {(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1),
                       (4, 1, 2), (4, 2, 1)}  # fmt: skip
    assert {p.schedule for p in plans} == {"1F1B", "Interleaved1F1B"}
    assert {p.zero_stage for p in plans} == {0, 1, 2, 3}
    tp2pp2 = next(p for p in plans if p.pipelines[0].stages[0].tp == 2 and p.dp == 2
                  and len(p.pipelines[0].stages) == 2)  # fmt: skip
    # TP innermost, then DP, then PP: replica 1's first stage follows replica 0's
    assert tp2pp2.pipelines[0].stages[0].devices == ("a100-80gb-0:0", "a100-80gb-0:1")
    assert tp2pp2.pipelines[1].stages[0].devices == ("a100-80gb-0:2", "a100-80gb-0:3")
    assert tp2pp2.pipelines[0].stages[1].devices == ("a100-80gb-1:0", "a100-80gb-1:1")
    for plan in plans:
        validate_plan(plan, model, cl)
    assert _middle_first_split(10, 4) == (2, 3, 3, 2)
    assert _middle_first_split(9, 4) == (2, 2, 3, 2)
    # heterogeneous: 1 A100 + 2 T4s, 3 layers, batch 2, micro-batch 1 only
    cl = parse_inline_cluster("A100-80GB:1x1,T4:1x2")
    few = HetKnobs(micro_batches=(1,), recompute=("none",))
    shapes = set()
    for plan in heterogeneous_plans(tiny_model(3, 1024), cl, 2, "fp16", few):
        validate_plan(plan, tiny_model(3, 1024), cl)
        assert plan.zero_stage == (1 if plan.dp > 1 else 0)
        shapes.add(
            tuple(sorted(
                (p.batch_size, tuple((s.layers, s.devices[0][0], s.tp) for s in p.stages))
                for p in plan.pipelines
            ))
        )  # fmt: skip
    assert ((2, ((3, "a", 1),)),) in shapes  # one pipeline on the A100
    assert ((2, ((1, "t", 1), (2, "a", 1))),) in shapes  # the T4 block first
    assert ((2, ((2, "a", 1), (1, "t", 1))),) in shapes  # or last
    assert ((2, ((1, "t", 1), (1, "t", 1), (1, "a", 1))),) in shapes  # two T4 stages
    assert ((2, ((1, "t", 2), (2, "a", 1))),) in shapes  # T4s at TP 2
    assert ((1, ((1, "a", 1), (2, "t", 1))), (1, ((3, "t", 1),))) in shapes  # two pipelines
    assert ((1, ((3, "a", 1),)), (1, ((3, "t", 1),))) in shapes
    # a pipeline's stages of one type form one block: never T4, A100, T4
    seqs = {"".join(st[1] for st in stages) for key in shapes for _, stages in key}
    assert "tat" not in seqs and {"at", "ta", "att", "tta"} <= seqs


PROVISION_CASES = [  # every one failed at a5c74f7 (gaps of 1% to 27%); they pass at ebe8d2c
    ProvisionCase("gpt2-medium", (("A100-80GB", 8, 2, 3.43), ("T4", 4, 3, 0.526)), 64),
    ProvisionCase("gpt3-350m", (("V100-16GB", 8, 4, 2.48), ("A10", 4, 4, 1.0)), 128),
    ProvisionCase("gpt3-2.7b", (("V100-16GB", 8, 4, 2.48), ("T4", 4, 4, 0.526)), 128),
    # bench_search_gap --wide --seed 21000: the cheapest configuration (one 4-GPU V100 node)
    # is best as one pipeline (tp2 pp2, ZeRO-0, its only choice); provisioning's space left
    # ZeRO-0 out everywhere as dominated by ZeRO-1, so it priced that node 0.6% dearer
    ProvisionCase("gpt3-2.7b", (("V100-16GB", 4, 1, 3.48), ("L4", 4, 3, 2.74)), 64),
]


@pytest.mark.parametrize("case", PROVISION_CASES, ids=lambda c: c.name().split()[0])
@pytest.mark.slow
def test_provisioning_recommends_the_exhaustive_best(case):
    out = run_provision(case)
    assert out.brute.fitting > 0
    assert out.time_gap <= TOL, (
        f"{out.case}: objective time {out.search_time_s:.6g} s, exhaustive {out.brute_time_s:.6g}"
    )
    assert out.cost_gap <= TOL, (
        f"{out.case}: objective cost ${out.search_cost_usd:.6g}, exhaustive "
        f"${out.brute_cost_usd:.6g}"
    )


def test_homogeneous_first_plan_with_lightened_layouts_is_the_exhaustive_best():
    """GPT-3 2.7B cut to 30 layers on 8 T4: 30 + 2 = 32 fills pp * v chunks of n >= 1 layers
    for (pp, v) of (2, 2), (2, 4), (2, 8), (4, 2), (4, 4), (8, 2), and with one layer a chunk
    (the first holding only the embedding, the last only the head) (4, 8), (8, 4); the best
    plan is one of them (pp 4, v 4 at the time of writing), against the enumeration written
    here."""
    spec = replace(load_model("gpt3-2.7b"), layers=30, name="gpt3-2.7b-30L")
    out = run_homogeneous(HomCase(spec, "T4:2x4", 32, "fp16"))
    _check(out)
    assert out.brute.best is not None
    assert out.brute.best.pipelines[0].stages[0].chunks is not None


SPOT_CASES = [  # (model, offer: GPU, GPUs per node, nodes; batch); a preemption every 5 node-hours
    ("gpt3-350m", ("T4", 1, 12), 64),
    ("gpt3-760m", ("L4", 2, 5), 32),
    ("gpt2-medium", ("V100-16GB", 4, 3), 48),
]


@pytest.mark.parametrize("case", SPOT_CASES, ids=lambda c: f"{c[0]}-{c[1][0]}")
def test_spot_weighted_search_is_the_exhaustive_best(case):
    """On spot a plan trains at its iteration time x its own slowdown (its checkpoint: its
    fullest node's shards). The homogeneous search ranking by that product in one pass
    (``weight``, the proven slowdown floor as ``weight_floor``), and ``best_spot_plan``
    asking it for more plans by iteration time, both return the least product of every plan
    this module enumerates, each estimated and slowed by ``checkpoint_time_s``; 48 ranks
    (batch 48) leave DP degrees that do not divide the batch too."""
    from hetplan.search.spot import (
        SpotTerms,
        best_spot_plan,
        checkpoint_floor_s,
        checkpoint_time_s,
        offer_load,
        slowdowns,
    )

    name, (gpu, gpn, nodes), batch = case
    model = load_model(name)
    market = market_from_dict({"offers": [{
        "gpu": gpu, "gpus_per_node": gpn, "max_nodes": nodes, "on_demand_usd_per_gpu_hour": 1.0,
        "spot_usd_per_gpu_hour": 0.5, "preemption_rate_per_node_hour": 0.2,
        "restart_time": "10m"}]})  # fmt: skip
    offer = market.offers[0]
    terms = replace(SpotTerms(), state_bytes=12.0 * model.total_params())
    load = offer_load(offer, nodes, terms)
    cluster = offer.cluster(nodes, "spot")
    params = default_params()

    def slow(plan: Plan) -> float:
        return float(slowdowns(*load, terms, checkpoint_time_s(plan, model)))

    brute, weights = Brute(), set()
    for plan in homogeneous_plans(model, cluster.nodes, batch, "fp16", Knobs()):
        if brute.offer(plan, model, cluster, params, weight=slow) is not None:
            weights.add(round(slow(plan), 9))
    best = brute.best_s
    assert math.isfinite(best) and len(weights) > 1  # the weight tells plans apart
    floor = float(slowdowns(*load, terms, checkpoint_floor_s(model, nodes), True))
    assert 1.0 <= floor <= min(weights)
    space = Knobs().space()

    def ranked_by(k: int, weight=None):
        return search_homogeneous(model, cluster, batch, "fp16", k, params, space,
                                  weight=weight, weight_floor=floor).ranked  # fmt: skip

    plan, est = ranked_by(1, slow)[0]
    assert est.iteration_time_s * slow(plan) == pytest.approx(best, rel=1e-9)
    again = best_spot_plan(ranked_by, slow, floor)
    assert again is not None
    assert again[1].iteration_time_s * again[2] == pytest.approx(best, rel=1e-9)
