"""Sharding ratios: a linear program over one program's affine instruction costs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.optimize import linprog
from scipy.sparse import lil_matrix

from hetplan.spmd.costmodel import Devices
from hetplan.spmd.program import Instr


def solve_ratios(
    instrs: Sequence[Instr],
    devs: Devices,
    rep_bytes: float = 0.0,
    shard_bytes: float = 0.0,
    memory_limit: bool = True,
) -> tuple[list[float], float] | None:
    """Returns the ratios minimising the program's time, and that time; None if infeasible.

    Variables: b_1..b_n (shares), m (largest share), and u_k >= b_i t_ki for every
    sharded compute instruction k. Minimise const + coef x m + sum u_k subject to
    sum b = 1, b_i <= m, and rep_bytes + b_i x shard_bytes <= capacity_i. Solved with
    HiGHS.
    """
    n = devs.n
    const = sum(x.cost.const_s for x in instrs)
    coef_m = sum(x.cost.max_share_s for x in instrs)
    shard = [x.cost.shard_s for x in instrs if x.cost.shard_s is not None]
    k = len(shard)
    nvar = n + 1 + k
    c = np.zeros(nvar)
    c[n] = coef_m
    c[n + 1 :] = 1.0
    mem_rows = [i for i in range(n) if np.isfinite(devs.capacity_bytes[i])]
    if not (memory_limit and shard_bytes > 0):
        mem_rows = []
    rows = n + n * k + len(mem_rows)
    a = lil_matrix((rows, nvar))
    ub = np.zeros(rows)
    r = 0
    for i in range(n):
        a[r, i], a[r, n] = 1.0, -1.0
        r += 1
    for j, t in enumerate(shard):
        for i in range(n):
            a[r, i], a[r, n + 1 + j] = t[i], -1.0
            r += 1
    for i in mem_rows:
        a[r, i] = shard_bytes
        ub[r] = devs.capacity_bytes[i] - rep_bytes
        r += 1
    a_eq = np.zeros((1, nvar))
    a_eq[0, :n] = 1.0
    bounds = [(0.0, 1.0)] * n + [(0.0, None)] * (1 + k)
    res = linprog(c, A_ub=a.tocsr(), b_ub=ub, A_eq=a_eq, b_eq=[1.0], bounds=bounds, method="highs")
    if res.status != 0:
        return None
    b = np.clip(res.x[:n], 0.0, None)
    b = b / b.sum()
    return [float(x) for x in b], float(res.fun + const)
