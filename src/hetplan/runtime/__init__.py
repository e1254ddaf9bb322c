"""Run plans on torch.distributed and profile devices into the cost model.

Modules that need torch import it themselves; ``config``, ``layout``, ``checkpoint``,
``launch`` and ``cli`` import without it.
"""
