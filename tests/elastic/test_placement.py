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


def test_a_tied_head_is_saved_once_in_the_embedding_shard():
    """By hand, 12 bytes a parameter (bf16/fp32 weights, fp32 Adam moments as the runtime
    saves them): TINY (hidden 64, vocab 128, 32 positions, GPT: two-vector norms). Tied, the
    head shard is the final norm alone, as the runtime's head.pt holds; it counted the
    vocab x hidden table a second time."""
    from dataclasses import replace

    from hetplan.elastic.placement import shard_bytes

    untied = shard_bytes(TINY)
    tied = shard_bytes(replace(TINY, tie_embeddings=True))
    assert untied[EMBED] == tied[EMBED] == 12 * (128 * 64 + 32 * 64)
    assert untied[HEAD] == 12 * (2 * 64 + 128 * 64)
    assert tied[HEAD] == 12 * 2 * 64
