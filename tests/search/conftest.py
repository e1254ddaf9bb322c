"""Markets shared by the provisioning floor tests."""

from hetplan.market import Offer, market_from_dict

MIX_MARKET = market_from_dict(
    {
        "offers": [
            {"gpu": "A100-80GB", "gpus_per_node": 4, "max_nodes": 3,
             "on_demand_usd_per_gpu_hour": 3.43},
            {"gpu": "T4", "gpus_per_node": 2, "max_nodes": 4, "on_demand_usd_per_gpu_hour": 0.53},
            {"gpu": "V100-32GB", "gpus_per_node": 4, "max_nodes": 2,
             "on_demand_usd_per_gpu_hour": 0.9},
        ]
    }
)  # fmt: skip
"""Three small offers whose two-type mixes the floor tests enumerate against real plans."""
MIX_LARGEST = max(o.gpus_per_node for o in MIX_MARKET.offers)
"""The most GPUs a node of ``MIX_MARKET`` holds: its floors charge data-parallel reductions
(``TypeFloor.reduce_tp``) spanning nodes by it."""


def one_offer(gpu: str, per: int, nodes: int) -> Offer:
    """Returns an offer of ``nodes`` nodes of ``per`` GPUs of type ``gpu`` at $1/GPU-hour."""
    return market_from_dict(
        {"offers": [{"gpu": gpu, "gpus_per_node": per, "max_nodes": nodes,
                     "on_demand_usd_per_gpu_hour": 1.0}]}
    ).offers[0]  # fmt: skip
