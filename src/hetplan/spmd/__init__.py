"""HAP-style SPMD program synthesis for any PyTorch model on devices of different speeds.

Capture (torch.fx) -> instruction set (per-operator sharding rules + collectives) ->
A* over programs at fixed ratios <-> LP over the ratios -> per-rank fx programs.
"""

from hetplan.spmd.synth import Synthesis, synthesize

__all__ = ["Synthesis", "synthesize"]
