"""Money as owners and renters pay it: the parts of a GPU-hour's price.

A rented GPU-hour costs its rental price (on-demand, spot or reserved, as the market states
it; ``MoneyParts.rental_kind`` says which). An owned GPU-hour costs

* **amortisation**: the purchase price (the GPU and its share of the server and network),
  spread linearly over the hours it trains in its lifetime,
  ``purchase / (lifetime_years x 8760 x utilisation)``;
* **energy**: board power x the share of it drawn while training (``power_factor``) x the
  data centre's PUE x the price of a kWh.

Owned nodes are never charged rental. Defaults live in ``data/money.yaml`` with their
sources (board power in ``data/gpu_specs.csv``); each can be overridden per node (cluster
file) or per offer (market file). ``estimate`` prices plans through ``node_parts``.
"""

from __future__ import annotations

import csv
import functools
import io
import math
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

from hetplan.errors import InputError, shown
from hetplan.hardware import GPUType

HOURS_PER_YEAR = 8760.0
"""365 days of 24 hours."""

OWNERSHIP_KEYS = (
    "purchase_usd_per_gpu",
    "lifetime_years",
    "utilisation",
    "board_power_w",
    "power_factor",
    "pue",
    "usd_per_kwh",
)
"""The figures a cluster node or a market offer may state for owning its GPUs."""


@dataclass(frozen=True)
class MoneyParts:
    """Dollars (per hour, per run, per million tokens: the caller says) split by kind."""

    rental: float = 0.0
    amortisation: float = 0.0
    energy: float = 0.0
    rental_kind: str = ""
    """How the rental is charged: on-demand, reserved or spot ("mixed" when parts of
    different kinds were added, empty when there is no rental)."""

    @property
    def total(self) -> float:
        """Returns the sum of the parts."""
        return self.rental + self.amortisation + self.energy

    def __add__(self, other: MoneyParts) -> MoneyParts:
        kinds = {k for k in (self.rental_kind, other.rental_kind) if k}
        return MoneyParts(
            self.rental + other.rental,
            self.amortisation + other.amortisation,
            self.energy + other.energy,
            "mixed" if len(kinds) > 1 else next(iter(kinds), ""),
        )

    def scaled(self, k: float) -> MoneyParts:
        """Returns every part times ``k``."""
        return MoneyParts(self.rental * k, self.amortisation * k, self.energy * k, self.rental_kind)

    def to_json(self) -> dict[str, float | str]:
        """Returns the parts, their total and the rental's kind."""
        return {
            "rental": self.rental,
            "rental_kind": self.rental_kind,
            "amortisation": self.amortisation,
            "energy": self.energy,
            "total": self.total,
        }


@dataclass(frozen=True)
class Ownership:
    """What one owned GPU costs: its price, life and power."""

    purchase_usd_per_gpu: float
    lifetime_years: float
    utilisation: float
    """Share of the lifetime's hours the GPU trains (the amortisation is spread over them)."""
    board_power_w: float
    power_factor: float
    """Mean draw while training as a share of board power."""
    pue: float
    usd_per_kwh: float

    def amortisation_usd_per_hour(self) -> float:
        """Returns the purchase price per training hour."""
        return self.purchase_usd_per_gpu / (self.lifetime_years * HOURS_PER_YEAR * self.utilisation)

    def energy_usd_per_hour(self) -> float:
        """Returns the electricity of one training hour, data-centre overhead included."""
        return self.board_power_w / 1000.0 * self.power_factor * self.pue * self.usd_per_kwh

    def parts(self) -> MoneyParts:
        """Returns one owned GPU-hour's cost by part (no rental)."""
        return MoneyParts(0.0, self.amortisation_usd_per_hour(), self.energy_usd_per_hour())


def break_even_utilisation(own: Ownership, rental_usd_per_hour: float) -> float:
    """Returns the utilisation above which owning a GPU costs less per training hour than
    renting it: ``purchase / (lifetime x 8760 x u) + energy = rental`` solved for u
    (``inf`` where the rental does not even pay the energy)."""
    margin = rental_usd_per_hour - own.energy_usd_per_hour()
    if margin <= 0:
        return math.inf
    return own.purchase_usd_per_gpu / (own.lifetime_years * HOURS_PER_YEAR * margin)


@functools.cache
def _defaults() -> dict[str, Any]:
    text = resources.files("hetplan.data").joinpath("money.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return data


@functools.cache
def _board_power() -> dict[tuple[str, str], float]:
    """Returns tdp_w of gpu_specs.csv by (GPU, form factor)."""
    text = resources.files("hetplan.data").joinpath("gpu_specs.csv").read_text()
    out: dict[tuple[str, str], float] = {}
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("tdp_w"):
            out[(row["gpu"].lower(), row["form_factor"].split()[0].lower())] = float(row["tdp_w"])
    return out


def default_board_power_w(gpu: GPUType) -> float | None:
    """Returns the shipped board power (TDP) of a catalog GPU type, or None if unknown."""
    name = gpu.name.lower()
    table = _board_power()
    if name.endswith("-pcie"):
        return table.get((name.removesuffix("-pcie"), "pcie"))
    for (g, _), watts in table.items():  # the first listed form factor (SXM where both)
        if g == name:
            return watts
    return None


def default_purchase_usd(gpu: GPUType) -> float | None:
    """Returns the shipped purchase price per GPU (with its server share), or None."""
    entry = _defaults()["purchase_usd_per_gpu"].get(gpu.name)
    return None if entry is None else float(entry["value"])


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(where, f"expected a number, got {shown(value)}")
    return float(value)


_RULES: dict[str, tuple[str, Any]] = {
    "purchase_usd_per_gpu": (">= 0", lambda v: v >= 0),
    "lifetime_years": ("> 0", lambda v: v > 0),
    "utilisation": ("in (0, 1]", lambda v: 0 < v <= 1),
    "board_power_w": (">= 0", lambda v: v >= 0),
    "power_factor": ("in [0, 1]", lambda v: 0 <= v <= 1),
    "pue": (">= 1 (power usage effectiveness counts the IT load itself)", lambda v: v >= 1),
    "usd_per_kwh": (">= 0", lambda v: v >= 0),
}


def check_figure(key: str, value: Any, where: str) -> float:
    """Returns a money figure as a float, or raises naming ``where.key`` and the rule."""
    v = _number(value, f"{where}.{key}")
    rule, ok = _RULES[key]
    if not math.isfinite(v) or not ok(v):
        raise InputError(f"{where}.{key}", f"must be {rule}, got {shown(value)}")
    return v


def ownership(gpu: GPUType, overrides: dict[str, Any], where: str) -> Ownership:
    """Returns the ownership figures of ``gpu``: the shipped defaults with ``overrides``
    (keys of OWNERSHIP_KEYS, checked; ``where`` names the entry in messages)."""
    unknown = set(overrides) - set(OWNERSHIP_KEYS)
    if unknown:
        raise InputError(f"{where}.{sorted(unknown)[0]}", "unknown key")
    figures = {k: float(v["value"]) for k, v in _defaults()["defaults"].items()}
    purchase = default_purchase_usd(gpu)
    if purchase is not None:
        figures["purchase_usd_per_gpu"] = purchase
    power = default_board_power_w(gpu)
    if power is not None:
        figures["board_power_w"] = power
    for key, value in overrides.items():
        figures[key] = check_figure(key, value, where)
    for key in ("purchase_usd_per_gpu", "board_power_w"):
        if key not in figures:
            raise InputError(
                f"{where}.{key}", f"no shipped figure for {gpu.name}; state it in the file"
            )
    return Ownership(**{k: figures[k] for k in OWNERSHIP_KEYS})


def node_parts(node: Any) -> MoneyParts | None:
    """Returns one GPU-hour of ``node`` by part: amortisation and energy when owned, rental
    of the node's kind (on-demand, reserved or spot) otherwise (None when the rental price
    is unknown)."""
    own: Ownership | None = getattr(node, "owned", None)
    if own is not None:
        return own.parts()
    if node.usd_per_gpu_hour is None:
        return None
    kind = str(getattr(node, "rental_kind", "on-demand"))
    return MoneyParts(rental=float(node.usd_per_gpu_hour), rental_kind=kind)
