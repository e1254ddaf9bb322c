"""Work that heterogeneous searches of one model under one set of cost parameters share
across clusters: provisioning plans many configurations made of the same kinds of nodes
(owned subsets beside every count of rented ones), and each search would otherwise build
the same tables again.

What is shared depends only on what its key names, never on how many nodes a class has:
- a class table's memory caps, stage times and state bytes (``ClassTable``'s caches), by
  the node's hardware (GPU, GPUs per node, links), the TP degree and the knobs;
- peak activations (already keyed by everything they read);
- layer-split frontiers (keyed by the stage arrays' own numbers) and pipeline bounds
  (keyed by their stage times, transfers and micro-batches);
- the single-type baseline's homogeneous search, by the exact nodes, batch, precision,
  search space and flash attention, and that search's memo by the node's hardware and
  the same settings.
A search given a cache of another model or parameters ignores it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hetplan.cluster import Node
from hetplan.cost.params import CostParams
from hetplan.model import ModelSpec
from hetplan.search.homogeneous_memory import SearchMemo

if TYPE_CHECKING:
    from hetplan.search.het_tables import Knobs
    from hetplan.search.het_templates import FrontierCache

TableCaches = tuple[
    dict[tuple[int, bool, bool, bool], int],
    dict[int, tuple[int, ...]],
    dict[tuple[int, bool, bool], tuple[float, ...]],
    dict[tuple[int, bool, bool, bool, int], float],
]
"""A class table's ``_caps``, ``_rows``, ``_times`` and ``_state``."""


@dataclass
class SearchCache:
    """Caches shared by heterogeneous searches of ``model`` under ``params``."""

    model: ModelSpec
    params: CostParams
    acts: dict[tuple[object, ...], float] = field(default_factory=dict)
    tables: dict[tuple[object, ...], TableCaches] = field(default_factory=dict)
    frontiers: FrontierCache = field(default_factory=dict)
    pipes: dict[tuple[object, ...], tuple[list[float], list[float]]] = field(default_factory=dict)
    """Pipelines' last backward ends and gradient-ready times by their stage times
    (``PlanBounds``, ``het_bounds.last_backward_spans``)."""
    homogeneous: dict[tuple[object, ...], object] = field(default_factory=dict)
    """Single-type baselines: the top plan (or None), or the InputError raised."""
    homogeneous_none_under: dict[tuple[object, ...], float] = field(default_factory=dict)
    """Single-type baselines searched under a cutoff that found none: the largest such
    cutoff (no plan of those nodes is at most it)."""
    memos: dict[tuple[object, ...], SearchMemo] = field(default_factory=dict)
    """The homogeneous search's memo per node hardware and search settings."""

    def homogeneous_memo(
        self, node: Node, global_batch: int, precision: str, space: object, flash: bool
    ) -> SearchMemo:
        """Returns the homogeneous search's memo for nodes of ``node``'s hardware (it holds
        across node counts: ``SearchMemo``)."""
        key = (node.gpu, node.gpus, node.intra_node_bytes_per_s, node.network_bytes_per_s,
               global_batch, precision, space, flash)  # fmt: skip
        hit = self.memos.get(key)
        if hit is None:
            hit = self.memos[key] = SearchMemo()
        return hit

    def serves(self, model: ModelSpec, params: CostParams) -> bool:
        """Returns whether this cache holds work of ``model`` under ``params``."""
        return self.params is params and self.model == model

    def table_caches(self, node: Node, tp: int, knobs: Knobs) -> TableCaches:
        """Returns the caches of the class table of ``node``'s hardware at ``tp``."""
        key = (node.gpu, node.gpus, node.intra_node_bytes_per_s, node.network_bytes_per_s,
               tp, knobs)  # fmt: skip
        hit = self.tables.get(key)
        if hit is None:
            hit = self.tables[key] = ({}, {}, {}, {})
        return hit
