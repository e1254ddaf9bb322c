"""HAP-style SPMD program synthesis for any PyTorch model on devices of different speeds.

Capture (torch.fx) -> instruction set (per-operator sharding rules + collectives) ->
A* over programs at fixed ratios <-> LP over the ratios -> per-rank fx programs.

Importing this package does not import torch; ``synthesize`` and ``Synthesis`` load
``hetplan.spmd.synth`` (and torch) on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hetplan.spmd.synth import Synthesis, synthesize

__all__ = ["Synthesis", "synthesize"]


def __getattr__(name: str) -> Any:
    """Loads the synthesis entry points lazily (keeps torch out of ``import hetplan.spmd``)."""
    if name in __all__:
        from hetplan.spmd import synth

        return getattr(synth, name)
    raise AttributeError(f"module 'hetplan.spmd' has no attribute {name!r}")
