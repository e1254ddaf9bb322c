"""GPU markets for provisioning: offers with availability, on-demand, reserved and spot
prices."""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from hetplan.cluster import Cluster, Node, check_node_name
from hetplan.cost.money import OWNERSHIP_KEYS, Ownership, check_figure, ownership
from hetplan.errors import InputError, invalid_yaml, shown
from hetplan.hardware import GPUType, get_gpu
from hetplan.units import parse_bandwidth_bytes_per_s, parse_duration_s

PRICINGS = ("on-demand", "reserved", "spot")
"""How rented GPUs are paid for: the offer's on-demand, reserved (committed-use) or spot
price."""


def pricing_name(pricing: bool | str) -> str:
    """Returns one of PRICINGS for ``pricing`` (True: spot, False: on-demand)."""
    if isinstance(pricing, bool):
        return "spot" if pricing else "on-demand"
    if pricing not in PRICINGS:
        raise InputError("--pricing", f"'{pricing}' is not on-demand, reserved or spot")
    return pricing


@dataclass(frozen=True)
class Offer:
    """Nodes of one GPU type that can be rented, up to ``max_nodes``."""

    name: str
    gpu: GPUType
    gpus_per_node: int
    max_nodes: int
    on_demand_usd_per_gpu_hour: float
    spot_usd_per_gpu_hour: float | None
    network_bytes_per_s: float
    intra_node_bytes_per_s: float
    preemption_rate_per_node_hour: float = 0.0
    """Expected spot preemptions per node-hour."""
    restart_s: float = 600.0
    """Time to get going again after a preemption (new node, reload, warm-up)."""
    reserved_usd_per_gpu_hour: float | None = None
    """Committed-use (reserved) price where the market states one."""
    buy: tuple[tuple[str, float], ...] = ()
    """Figures for buying these GPUs instead (keys of ``money.OWNERSHIP_KEYS``), over the
    shipped defaults."""

    def ownership(self) -> Ownership:
        """Returns what owning one of these GPUs costs (defaults with the offer's figures)."""
        return ownership(self.gpu, dict(self.buy), f"offers.{self.name}")

    def cluster(self, nodes: int, spot: bool | str = False) -> Cluster:
        """Returns a cluster of ``nodes`` nodes of this offer, charged at ``spot``'s pricing
        (True: spot, False: on-demand, or a name of PRICINGS)."""
        price = self.price(spot)
        kind = pricing_name(spot)
        return Cluster(
            tuple(
                Node(
                    f"{self.name}-{i}",
                    self.gpu,
                    self.gpus_per_node,
                    self.intra_node_bytes_per_s,
                    self.network_bytes_per_s,
                    price,
                    rental_kind=kind,
                )
                for i in range(nodes)
            )
        )

    def price(self, spot: bool | str) -> float:
        """Returns the price per GPU-hour at ``spot``'s pricing (True: spot, False:
        on-demand, or a name of PRICINGS)."""
        kind = pricing_name(spot)
        if kind == "spot":
            if self.spot_usd_per_gpu_hour is None:
                raise InputError(f"offers.{self.name}.spot_usd_per_gpu_hour", "no spot price")
            return self.spot_usd_per_gpu_hour
        if kind == "reserved":
            if self.reserved_usd_per_gpu_hour is None:
                raise InputError(
                    f"offers.{self.name}.reserved_usd_per_gpu_hour", "no reserved price"
                )
            return self.reserved_usd_per_gpu_hour
        return self.on_demand_usd_per_gpu_hour

    def has_price(self, pricing: bool | str) -> bool:
        """Returns whether the offer states a price for ``pricing``."""
        kind = pricing_name(pricing)
        if kind == "spot":
            return self.spot_usd_per_gpu_hour is not None
        if kind == "reserved":
            return self.reserved_usd_per_gpu_hour is not None
        return True


@dataclass(frozen=True)
class Market:
    """All offers, with where the prices come from."""

    offers: tuple[Offer, ...]
    source: str = ""


def _count(entry: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = entry.get(key, default)
    if value is None:
        raise InputError(f"{where}.{key}", "required")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InputError(f"{where}.{key}", f"expected a positive integer, got {shown(value)}")
    return value


def _positive(
    entry: dict[str, Any],
    key: str,
    where: str,
    default: float | None = None,
    allow_zero: bool = False,
) -> float:
    value = entry.get(key, default)
    if value is None:
        raise InputError(f"{where}.{key}", "required")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(f"{where}.{key}", f"expected a number, got {shown(value)}")
    if not math.isfinite(value):
        raise InputError(f"{where}.{key}", f"expected a finite number, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise InputError(
            f"{where}.{key}", f"must be {'>= 0' if allow_zero else '> 0'}, got {value}"
        )
    return float(value)


_OFFER_KEYS = {
    "name",
    "gpu",
    "gpus_per_node",
    "max_nodes",
    "on_demand_usd_per_gpu_hour",
    "spot_usd_per_gpu_hour",
    "network_bandwidth",
    "intra_node_bandwidth",
    "preemption_rate_per_node_hour",
    "restart_time",
    "reserved_usd_per_gpu_hour",
    *OWNERSHIP_KEYS,
}


def market_from_dict(data: Any) -> Market:
    """Returns the Market of a parsed market file."""
    if not isinstance(data, dict) or not isinstance(data.get("offers"), list):
        raise InputError("offers", "the market file needs a list 'offers'")
    if not data["offers"]:
        raise InputError("offers", "the market has no offers")
    offers = []
    for i, entry in enumerate(data["offers"]):
        where = f"offers[{i}]"
        if not isinstance(entry, dict):
            raise InputError(where, "each offer must be a mapping")
        unknown = set(entry) - _OFFER_KEYS
        if unknown:
            raise InputError(f"{where}.{sorted(unknown)[0]}", "unknown key")
        if "gpu" not in entry:
            raise InputError(f"{where}.gpu", "required")
        gpu = get_gpu(str(entry["gpu"]), field=f"{where}.gpu")
        spot = entry.get("spot_usd_per_gpu_hour")
        offers.append(
            Offer(
                name=check_node_name(
                    str(entry.get("name", gpu.name.lower().replace(" ", "-"))), f"{where}.name"
                ),
                gpu=gpu,
                gpus_per_node=_count(entry, "gpus_per_node", where, 8),
                max_nodes=_count(entry, "max_nodes", where),
                on_demand_usd_per_gpu_hour=_positive(entry, "on_demand_usd_per_gpu_hour", where),
                spot_usd_per_gpu_hour=None
                if spot is None
                else _positive(entry, "spot_usd_per_gpu_hour", where),
                network_bytes_per_s=parse_bandwidth_bytes_per_s(
                    entry["network_bandwidth"], f"{where}.network_bandwidth"
                )
                if "network_bandwidth" in entry
                else gpu.network_bytes_per_s,
                intra_node_bytes_per_s=parse_bandwidth_bytes_per_s(
                    entry["intra_node_bandwidth"], f"{where}.intra_node_bandwidth"
                )
                if "intra_node_bandwidth" in entry
                else gpu.intra_node_bytes_per_s,
                preemption_rate_per_node_hour=_positive(
                    entry, "preemption_rate_per_node_hour", where, 0.0, allow_zero=True
                ),
                restart_s=parse_duration_s(entry.get("restart_time", 600), f"{where}.restart_time"),
                reserved_usd_per_gpu_hour=None
                if entry.get("reserved_usd_per_gpu_hour") is None
                else _positive(entry, "reserved_usd_per_gpu_hour", where),
                buy=tuple(
                    (k, check_figure(k, entry[k], where)) for k in OWNERSHIP_KEYS if k in entry
                ),
            )
        )
    names = [o.name for o in offers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InputError(
                f"offers[{i}].name",
                f"{shown(name)} is also offers[{names.index(name)}]'s name: names are unique",
            )
    return Market(tuple(offers), str(data.get("source", "")))


def load_market(path: str | None) -> Market:
    """Returns the market in ``path``, or the default market shipped in the package."""
    if path is None:
        text = resources.files("hetplan.data").joinpath("market.yaml").read_text()
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise InputError("--market", f"cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InputError("--market", invalid_yaml(path, exc)) from None
    return market_from_dict(data)
