"""Which checkpoint shards each stage holds, uneven interleaved chunks included."""

from __future__ import annotations

from hetplan.elastic.placement import EMBED, HEAD, layer_unit, stage_units
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage

TINY = ModelSpec("tiny", "gpt", 6, 64, 4, 4, 256, 128, 32)


def _plan(stages: tuple[Stage, ...]) -> Plan:
    return Plan(
        global_batch_size=4,
        micro_batch_size=1,
        pipelines=(Pipeline(4, stages),),
        schedule="Interleaved1F1B",
        virtual_stages=2,
    )


def test_uneven_chunks_place_every_layer_once_in_chunk_order():
    # stage 0 holds chunks of (0, 2) layers, stage 1 (2, 2): model order is
    # s0c0 (none: embedding only), s1c0 (layers 0-1), s0c1 (layers 2-3), s1c1 (layers 4-5)
    plan = _plan((Stage(2, ("n0:0",), chunks=(0, 2)), Stage(4, ("n0:1",), chunks=(2, 2))))
    (units,) = stage_units(plan, TINY)
    assert units[0] == {EMBED, layer_unit(2), layer_unit(3)}
    assert units[1] == {layer_unit(0), layer_unit(1), layer_unit(4), layer_unit(5), HEAD}


def test_even_chunks_alternate_between_stages():
    plan = _plan((Stage(4, ("n0:0",)), Stage(2, ("n0:1",))))
    (units,) = stage_units(plan, TINY)
    # chunk sizes 2 and 1: s0c0 layers 0-1, s1c0 layer 2, s0c1 layers 3-4, s1c1 layer 5
    assert units[0] == {EMBED, layer_unit(0), layer_unit(1), layer_unit(3), layer_unit(4)}
    assert units[1] == {layer_unit(2), layer_unit(5), HEAD}
