"""Activations an interleaved 1F1B stage holds, against the textbook count.

Korthikanti et al. 2022 (section 4.2.3) and Narayanan et al. 2021: with ``v`` chunks per
stage, the first stage holds p x (1 + (p-1)/(p v)) micro-batches' worth of its layers at its
peak (Megatron's warm-up of 2 (p-1) + (v-1) p chunk forwards, plus the one before the first
backward), never more than the m micro-batches there are. The embedding outputs the first
stage keeps are counted by hand from the schedule below."""

from __future__ import annotations

import math

from hetplan.cluster import parse_inline_cluster
from hetplan.cost.estimate import estimate
from hetplan.model import ModelSpec
from hetplan.plan import Pipeline, Plan, Stage

MODEL = ModelSpec("gpt-8L-1024", "gpt", 8, 1024, 16, 16, 4096, 50257, 2048)


def _interleaved(m: int) -> Plan:
    """PP 4, v = 2 (one layer a chunk), TP 1, micro-batch 1, m micro-batches."""
    stages = tuple(Stage(2, (f"a100-80gb-0:{j}",)) for j in range(4))
    return Plan(global_batch_size=m, micro_batch_size=1, pipelines=(Pipeline(m, stages),),
                precision="bf16", schedule="Interleaved1F1B", virtual_stages=2)  # fmt: skip


def test_first_stage_holds_the_textbook_micro_batches_and_every_embedding_output():
    p, v, m = 4, 2, 8
    est = estimate(_interleaved(m), MODEL, parse_inline_cluster("A100-80GB:1x4"))
    layer = MODEL.layer_activation_bytes(1, False, "none", True, 2)
    embed = MODEL.embedding_activation_bytes(1, False, 2)
    head = MODEL.head_activation_bytes(1, 2)
    # textbook: p (1 + (p-1)/(p v)) = 4 x 11/8 = 5.5 micro-batches of the stage's 2 layers
    textbook_layers = p * (1 + (p - 1) / (p * v)) * 2
    assert textbook_layers == 11
    # by hand, stage 0's forwards in order: chunk 0 of micro-batches 0-3, chunk 1 of 0-3,
    # chunk 0 of 4-6 (the warm-up: 2 (p-1) + (v-1) p = 10, and one more); then it alternates
    # forward and backward, the next forward being chunk 0 of micro-batch 7 while the
    # backwards start with chunk 1 of 0-3: after it, 11 chunks (11 layers) are in flight
    # and chunk 0 of all 8 micro-batches, each with its embedding output
    st = est.distinct_stages
    assert math.isclose(st[0].memory.activations, 11 * layer + 8 * embed, rel_tol=1e-12)
    # later stages warm up 2 chunks less per rank: 9, 7, 5 chunks; the last adds the head's
    # logits of the one micro-batch between its last chunk's forward and backward
    assert math.isclose(st[1].memory.activations, 9 * layer, rel_tol=1e-12)
    assert math.isclose(st[2].memory.activations, 7 * layer, rel_tol=1e-12)
    assert math.isclose(st[3].memory.activations, 5 * layer + head, rel_tol=1e-12)


def test_in_flight_is_capped_by_the_micro_batches():
    # m = p = 4: the warm-up (10 chunks + 1) exceeds the m v = 8 chunk forwards there are,
    # so stage 0 runs every forward first and holds all 4 micro-batches of both chunks: 8
    # layers, 4 embedding outputs (the textbook's 5.5 micro-batches capped at m = 4)
    est = estimate(_interleaved(4), MODEL, parse_inline_cluster("A100-80GB:1x4"))
    layer = MODEL.layer_activation_bytes(1, False, "none", True, 2)
    embed = MODEL.embedding_activation_bytes(1, False, 2)
    act = est.distinct_stages[0].memory.activations
    assert math.isclose(act, 8 * layer + 4 * embed, rel_tol=1e-12)
