"""Buy or rent? Per GPU type of a market, the utilisation at which owning beats renting.

For each offer, the cheapest configuration of that offer alone (``provision``: every node
count planned and ranked by ``estimate``) gives the GPUs a run needs and its hours. Owning
those GPUs costs their purchase price once (amortised over the lifetime) and energy per
training hour; renting costs the rental price per hour. Owning wins above the break-even
utilisation ``purchase / (lifetime x 8760 x (rental - energy))`` (``money``); the
workload's own utilisation is ``runs per year x hours per run / 8760``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hetplan.cost.money import HOURS_PER_YEAR, Ownership, break_even_utilisation
from hetplan.cost.params import CostParams
from hetplan.errors import InputError
from hetplan.market import Market
from hetplan.model import ModelSpec
from hetplan.search.constraints import PlanConstraints
from hetplan.search.provision import provision


@dataclass(frozen=True)
class BuyRow:
    """One GPU type: the run, the prices, the break-even and the verdict."""

    gpu: str
    gpus: int
    hours_per_run: float
    rental_usd_per_gpu_hour: float
    own: Ownership
    break_even: float
    """Utilisation above which owning costs less per training hour (inf: never)."""
    utilisation: float
    """The workload's: runs per year x hours per run / 8,760."""
    runs_per_year: float

    @property
    def verdict(self) -> str:
        """Returns "buy" or "rent" for this workload."""
        return "buy" if self.utilisation >= self.break_even else "rent"

    def rent_usd(self, runs: float) -> float:
        """Returns the rental bill of ``runs`` runs."""
        return runs * self.gpus * self.hours_per_run * self.rental_usd_per_gpu_hour

    def own_usd(self, runs: float) -> float:
        """Returns the purchase of the GPUs plus the energy of ``runs`` runs."""
        energy = runs * self.gpus * self.hours_per_run * self.own.energy_usd_per_hour()
        return self.gpus * self.own.purchase_usd_per_gpu + energy

    def to_json(self) -> dict[str, Any]:
        """Returns the row as `provision --compare-buy --json` prints it."""
        return {
            "gpu": self.gpu,
            "gpus": self.gpus,
            "hours_per_run": self.hours_per_run,
            "rental_usd_per_gpu_hour": self.rental_usd_per_gpu_hour,
            "purchase_usd_per_gpu": self.own.purchase_usd_per_gpu,
            "amortisation_usd_per_gpu_hour": self.own.amortisation_usd_per_hour(),
            "energy_usd_per_gpu_hour": self.own.energy_usd_per_hour(),
            "break_even_utilisation": None if math.isinf(self.break_even) else self.break_even,
            "workload_utilisation": self.utilisation,
            "verdict": self.verdict,
        }


def compare_buy(
    model: ModelSpec,
    market: Market,
    tokens: float,
    global_batch: int,
    precision: str,
    runs_per_year: float,
    params: CostParams | None = None,
    limits: PlanConstraints | None = None,
) -> tuple[list[BuyRow], list[tuple[str, str]]]:
    """Returns a row per offer that can train the model and has a purchase price, and
    (GPU type, why) per offer left out."""
    if runs_per_year <= 0:
        raise InputError("--runs-per-year", f"must be > 0, got {runs_per_year}")
    rows: list[BuyRow] = []
    notes: list[tuple[str, str]] = []
    limits = limits or PlanConstraints()
    wanted = None if limits.gpu_types is None else {t.lower() for t in limits.gpu_types}
    limits = replace(limits, gpu_types=None)  # each offer is provisioned alone
    for offer in market.offers:
        if wanted is not None and offer.gpu.name.lower() not in wanted:
            continue
        if not offer.gpu.supports(precision):
            notes.append((offer.gpu.name, f"no {precision} support"))
            continue
        try:
            own = offer.ownership()
        except InputError as exc:
            key = exc.field.rsplit(".", 1)[-1]
            missing = exc.reason.startswith("no shipped figure")
            why = f"no shipped {key}: state it in the market file" if missing else str(exc)
            notes.append((offer.gpu.name, why))
            continue
        alone = Market((offer,), market.source)
        res = provision(model, alone, tokens, global_batch, precision, objective="cost",
                        params=params, limits=limits)  # fmt: skip
        if res.recommended is None:
            notes.append((offer.gpu.name, res.reason))
            continue
        p = res.recommended
        hours = p.time_to_train_s / 3600.0
        rental = offer.on_demand_usd_per_gpu_hour
        rows.append(
            BuyRow(
                offer.gpu.name,
                sum(p.gpus.values()),
                hours,
                rental,
                own,
                break_even_utilisation(own, rental),
                runs_per_year * hours / HOURS_PER_YEAR,
                runs_per_year,
            )
        )
    return rows, notes


def write_buy_plot(path: Path, rows: list[BuyRow]) -> None:
    """Writes cumulative cost against runs done over each option's lifetime (one line per
    option: rent and buy per GPU type), atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hetplan.report import save_figure

    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, row in enumerate(rows):
        runs = max(1.0, row.runs_per_year * row.own.lifetime_years)
        xs = [runs * k / 50 for k in range(51)]
        color = f"C{i % 10}"
        ax.plot(xs, [row.rent_usd(x) for x in xs], "-", color=color,
                label=f"rent {row.gpus} x {row.gpu}")  # fmt: skip
        ax.plot(xs, [row.own_usd(x) for x in xs], "--", color=color,
                label=f"buy {row.gpus} x {row.gpu}")  # fmt: skip
    ax.set_xlabel("training runs done (over the hardware's lifetime)")
    ax.set_ylabel("cumulative cost (USD)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, "--plot")
