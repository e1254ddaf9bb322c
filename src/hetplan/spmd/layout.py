"""Tensor layouts across ranks (replicated, sharded, partial) and integer shard sizes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetplan.errors import InputError


@dataclass(frozen=True, order=True)
class Layout:
    """How a tensor is held: 'R' replicated, 'P' partial sums, 'S' sharded along ``dim``.

    A sharded dimension is cut into whole *granules* of ``granule`` elements (1 unless
    the tensor came from merging dimensions), shared out by the program's ratios. ``SFB``
    marks a replicated linear weight whose gradient comes from sufficient factors.
    """

    kind: str
    dim: int = -1
    granule: int = 1

    def __str__(self) -> str:
        if self.kind == "S":
            return f"S{self.dim}" if self.granule == 1 else f"S{self.dim}/{self.granule}"
        return self.kind


REPLICATED = Layout("R")
PARTIAL = Layout("P")
SFB = Layout("SFB")


def shard(dim: int, granule: int = 1) -> Layout:
    """Returns the layout sharded along ``dim`` in granules of ``granule`` elements."""
    return Layout("S", dim, granule)


def parse_layout(text: str) -> Layout:
    """Returns the Layout printed as ``text`` ('R', 'P', 'SFB', 'S1', 'S0/16')."""
    if text in ("R", "P", "SFB"):
        return Layout(text)
    if text.startswith("S"):
        dim, _, gran = text[1:].partition("/")
        return shard(int(dim), int(gran or 1))
    raise InputError("layout", f"unknown layout {text!r}")


def split_units(units: int, ratios: Sequence[float]) -> list[int]:
    """Returns integer counts summing to ``units``, each within one unit of ratio x units.

    Largest-remainder rounding: floor every share, then hand the leftover units to the
    largest fractional parts (ties to the lower rank).
    """
    total = float(sum(ratios))
    if units < 0 or total <= 0:
        raise InputError("ratios", "need a positive sum of ratios and a non-negative size")
    exact = [units * r / total for r in ratios]
    counts = [int(e) for e in exact]
    left = units - sum(counts)
    order = sorted(range(len(ratios)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return counts


def shard_sizes(size: int, granule: int, ratios: Sequence[float]) -> list[int]:
    """Returns each rank's element count along a dimension of ``size`` cut in granules."""
    if granule <= 0 or size % granule:
        raise InputError("granule", f"size {size} is not a multiple of granule {granule}")
    return [u * granule for u in split_units(size // granule, ratios)]


def shard_offsets(sizes: Sequence[int]) -> list[int]:
    """Returns the starting offset of each rank's shard."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out
