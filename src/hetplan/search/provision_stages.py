"""A tighter spot time bound for mixes: the fewest stages of any pipeline of the plan.

A spot run's slowdown grows with its checkpoint time C, and C is large when the plan's
pipelines are short: one pipeline of p stages spreads every checkpoint shard over at most p
stages, each stage's shards all on each of its nodes, so some node holds at least the
state over p (``spot.checkpoint_floor_s``). Every stage pays its fixed costs per
micro-batch (``estimate.stage_times``), so plans whose pipelines all have at least p stages
take at least the iteration floor with p stages' fixed costs on each micro-batch's path
and in each pipeline's device-seconds (``provision_bounds.iteration_floor_s``), and the
batch floors with at least p stages per pipeline (``provision_batch``; type-aware:
``provision_mixbatch``).

Let p* be the fewest stages of any pipeline of a plan: its time to train is at least the
iteration floor with p* stages x the slowdown's floor at C's floor for p*. The first grows
with p* and the second falls, and C's floor stops falling once it reaches the largest shard
(or the state over the node count): past that, every p* is bounded by the last. Over a
grid g_0 = 1 < g_1 < ... of stage counts, a plan with p* in [g_k, g_(k+1)) takes at least
the iteration floor at g_k x the slowdown's floor at g_(k+1) - 1, and the bound is the
least of these (every p* falls in one interval).
"""

from __future__ import annotations

import math

import numpy as np

from hetplan.elastic.placement import shard_bytes
from hetplan.market import Offer
from hetplan.model import ModelSpec
from hetplan.search.provision_batch import batch_floor_s
from hetplan.search.provision_bounds import TypeFloor, iteration_floor_s
from hetplan.search.provision_mixbatch import mix_batch_floor_s
from hetplan.search.spot import SpotTerms, checkpoint_floor_s, mixed_load, offer_load, slowdowns

GRID = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256)
"""Stage counts whose intervals the bound takes the least over (past the last, one more)."""


def stage_grid(model: ModelSpec) -> list[int]:
    """Returns the grid's stage counts up to the one past which C's floor stops falling (the
    state over the largest shard, at most the number of shards)."""
    sizes = shard_bytes(model).values()
    last = min(math.ceil(sum(sizes) / max(sizes)), len(sizes))
    return [g for g in GRID if g < last] + [last]


def mix_iteration_floor_s(
    model: ModelSpec,
    global_batch: int,
    floors: tuple[TypeFloor, TypeFloor],
    ga: np.ndarray,
    gb: np.ndarray,
    stages: int = 1,
    aware: bool = True,
) -> np.ndarray:
    """Returns the iteration floor of ``ga`` GPUs of type ``floors[0]`` with ``gb`` of
    ``floors[1]``, every pipeline of at least ``stages`` stages: a plan has one micro-batch
    size, so at each size the largest of the throughput, path and coupled floors
    (``iteration_floor_s``), the batch floor (``batch_floor_s``) and, with ``aware``, the
    type-aware batch floor (``mix_batch_floor_s``), and the least of that over the sizes."""
    it = np.maximum(
        iteration_floor_s(model, global_batch, list(floors), [ga, gb], stages, per_size=True),
        batch_floor_s(model, global_batch, list(floors), ga + gb, stages, per_size=True),
    )
    if aware:
        it = np.maximum(it, mix_batch_floor_s(model, global_batch, floors, ga, gb, stages,
                                              per_size=True))  # fmt: skip
    return np.asarray(it.min(axis=0))


def mix_time_floor_s(
    model: ModelSpec,
    global_batch: int,
    iterations: float,
    terms: SpotTerms,
    offers: tuple[Offer, Offer],
    floors: tuple[TypeFloor, TypeFloor],
    na: np.ndarray,
    nb: np.ndarray,
    step_s: np.ndarray | float = 0.0,
) -> np.ndarray:
    """Returns the lower bound of the time to train of ``na`` nodes of ``offers[0]`` with
    ``nb`` of ``offers[1]`` (arrays of equal length) on spot, over the fewest stages of any
    pipeline (module docstring); ``iterations`` the run's iteration count; ``step_s``: what
    every plan bounded adds to each iteration beyond the iteration floors
    (``provision_mixes.spread_floor_s``)."""
    a, b = offers
    la = np.array([offer_load(a, int(n), terms) for n in na]).reshape(-1, 2)
    lb = np.array([offer_load(b, int(n), terms) for n in nb]).reshape(-1, 2)
    load = mixed_load([(la[:, 0], la[:, 1]), (lb[:, 0], lb[:, 1])])
    gpus = [na * a.gpus_per_node, nb * b.gpus_per_node]
    grid = stage_grid(model)
    best = np.full(np.shape(na), np.inf)
    for k, g in enumerate(grid):
        it = mix_iteration_floor_s(model, global_batch, floors, gpus[0], gpus[1], g)
        # p* in [g, next): C's floor at next - 1 stages; past the last, any count of stages
        upper = grid[k + 1] - 1 if k + 1 < len(grid) else None
        slow = slowdowns(*load, terms, checkpoint_floor_s(model, na + nb, upper), True)
        best = np.minimum(best, iterations * (it + step_s) * slow)
    return best
