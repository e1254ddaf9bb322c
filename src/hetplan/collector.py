"""The cyclic garbage collector's pace for hetplan's own processes.

The searches (the plan and provisioning searches, the SPMD synthesis) are pure Python
building many small containers (tuples, dicts, frozensets), most of which live on in their
memo tables. At CPython's default thresholds (a young collection every 700 new containers,
a middle one every ten of those, a full one every ten of those) the collector walks those
tables again and again. ``hetplan plan`` of GPT-2 on 3 A100 nodes of 4 + 1 T4 node of 2 ran
1,071 young, 98 middle and 7 full collections, 0.4-0.7 s of collector time; at a young
threshold of 10,000 (a megabyte or so of containers) it runs 113, 10 and none, 0.13-0.25 s,
and the whole command took 4.2-4.7 s against 4.7-5.3 s (five alternating runs each; the
memo tables stay warmer in cache too). ``spmd plan`` of a two-layer BERT: 10.7 s against
12.0 s (medians of three). The memory held is the same (cyclic garbage is still collected,
a little later), and nothing else changes: the collector decides when memory is freed,
never what a computation returns.

Only the command line sets it (``cli.main``), and the test suite for its own processes: a
library call leaves the embedding program's collector as it is.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
"""New containers before a young collection (CPython's default: 700)."""


def pace_collector() -> None:
    """Sets the young generation's threshold to ``YOUNG_THRESHOLD``, keeping the older
    generations' (each collected after ten of the one before, by default)."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
