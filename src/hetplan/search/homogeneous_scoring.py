"""Scoring of the homogeneous search's candidates: each point's per-GPU memory peak
(``homogeneous_memory``) and a proven lower bound of its ``estimate()`` time, from
``estimate``'s own building blocks (``stage_times``, ``grad_sync_times``, ``exposed_sync_s``,
the optimizer step), with the caches (``SearchMemo``) that calls on clusters of one node
type share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from hetplan.chunk_layout import lightened_chunks
from hetplan.cluster import Node
from hetplan.cost.comm import p2p_s, step_collectives_s
from hetplan.cost.dp_sync import (
    SyncLayout,
    grad_sync_times,
    layout_classes,
    sharded_microbatch_s,
    uniform_sync_layout,
    zero2_buffer_s,
)
from hetplan.cost.estimate import (
    StageKey,
    chunk_split,
    memo_replay,
    p2p_wait_s,
    part_split,
    stage_times,
)
from hetplan.cost.memory import (
    stage_params,
)
from hetplan.cost.sharding import bucket_count, deferred_sync, exposed_sync_s
from hetplan.plan import Plan, element_bytes
from hetplan.search.het_bounds import chunk_times, replay_is_exact
from hetplan.search.homogeneous_candidates import (
    Candidate,
    lighten,
    most_micro_batches,
)
from hetplan.search.homogeneous_memory import MemoryScorer
from hetplan.search.layout import replica_shares, uniform_plan


@dataclass
class _Layout:
    """The device layout of a (tp, pp, dp) triple: the nodes of one pipeline's stages and the
    data-parallel groups, for the bound; its plan with default knobs once one is estimated."""

    plan: Plan | None
    nodes: list[Node]
    sync: SyncLayout
    holds: list[list[int]]
    """Per stage of pipeline 0: the indices of the sync groups (layer segments) it holds."""
    buckets: list[int]
    """Per sync group: its gradient buckets (``bucket_count``, as estimate() counts them)."""
    sync_s: dict[int, tuple[list[float], bool]] = field(default_factory=dict)
    """Per ZeRO stage: per sync group its reduction time (``grad_sync_times``), and whether
    the plan's ZeRO-2/3 is deferred to once a step (``deferred_sync``)."""
    sharded: dict[tuple[object, ...], tuple[float, float]] = field(default_factory=dict)
    """Per ZeRO stage, stage of pipeline 0 and its compute: ZeRO-2/3's collectives per
    micro-batch and after the step (``sharded_microbatch_s``, ZeRO-2's buffer work in)."""


@dataclass
class _Terms:
    """Per stage of a candidate's pipeline 0, the lower-bounded times its bounds combine."""

    sends: list[float]
    """The quickest transfer out of each stage (0 out of the last without interleaving)."""
    fwd: list[float] = field(default_factory=list)
    b_side: list[float] = field(default_factory=list)
    """Backward, recomputation, TP collectives and ZeRO-2/3's per-micro-batch collectives."""
    fills: list[float] = field(default_factory=list)
    per: list[float] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    drain: list[float] = field(default_factory=list)
    tails: list[float] = field(default_factory=list)
    """After the last backward: the reduction's exposed part, the optimizer step, ZeRO-2's
    parameter gather."""
    scalar: float = 0.0
    """The step's all-reduces of one number."""


@dataclass
class Scorer(MemoryScorer):
    """Memory and a proven lower bound of estimate()'s iteration time for candidates on one
    cluster, from estimate()'s own building blocks (stage times, gradient sync, optimizer)."""

    layouts: dict[tuple[int, int, int], _Layout] = field(default_factory=dict)
    shared: dict[tuple[int, int, int, int], Plan] = field(default_factory=dict)
    """The layout's plan with each replica's share of the batch, per micro-batch size
    (where the DP degree does not divide the batch; one replace per pipeline, built once)."""
    first_nodes: dict[tuple[int, int, int], list[Node]] = field(default_factory=dict)
    """Per (tp, pp, dp): the node of each stage of pipeline 0 (``stage_nodes``)."""
    stubs: dict[tuple[object, ...], Plan] = field(default_factory=dict)
    """Knob-only plans (``knobs``), per knob setting."""

    def layout(self, c: Candidate) -> _Layout:
        """Returns the layout of the candidate's degrees (built once per triple, from node
        indices: ``uniform_sync_layout``)."""
        key = (c.tp, c.pp, c.dp)
        hit = self.layouts.get(key)
        if hit is None:
            split = self.shape(c).split
            sync = uniform_sync_layout(self.cluster.nodes, c.tp, c.pp, c.dp, split, self.model)
            holds: list[list[int]] = [[] for _ in range(c.pp)]
            buckets = []
            for g, (n_params, holders) in enumerate(sync.groups):
                for r, j in holders:
                    if r == 0:
                        holds[j].append(g)
                buckets.append(bucket_count(n_params / c.tp, len(holders)))
            hit = self.layouts[key] = _Layout(None, self.stage_nodes(c), sync, holds, buckets)
        return hit

    def layout_plan(self, c: Candidate) -> Plan:
        """Returns the plan of the candidate's degrees with default knobs (``uniform_plan``,
        whose sync layout ``layout`` holds), built once per triple."""
        lay = self.layout(c)
        if lay.plan is None:
            lay.plan = uniform_plan(self.cluster, self.model.layers, c.tp, c.pp, c.dp, 1,
                                    self.global_batch)  # fmt: skip
        return lay.plan

    def stage_nodes(self, c: Candidate) -> list[Node]:
        """Returns the node of each stage of pipeline 0 in ``uniform_plan``'s placement
        (stage s starts at rank s x dp x tp, ranks in node order over nodes of one size),
        without building the layout."""
        key = (c.tp, c.pp, c.dp)
        hit = self.first_nodes.get(key)
        if hit is None:
            nodes, gpn = self.cluster.nodes, self.cluster.nodes[0].gpus
            hit = self.first_nodes[key] = [nodes[s * c.dp * c.tp // gpn] for s in range(c.pp)]
        return hit

    def knobs(self, c: Candidate) -> Plan:
        """Returns a plan of the candidate's knobs and no pipelines: what ``stage_times``
        and ``part_split`` read (they read no devices)."""
        key = (c.micro_batch, c.recompute, c.zero_stage, c.schedule, c.virtual_stages,
               c.sequence_parallel)  # fmt: skip
        hit = self.stubs.get(key)
        if hit is None:
            sp = self.space
            hit = self.stubs[key] = Plan(
                c.micro_batch, c.micro_batch, (), precision=self.precision,
                recompute=c.recompute, zero_stage=c.zero_stage, schedule=c.schedule,
                virtual_stages=c.virtual_stages, sequence_parallel=c.sequence_parallel,
                flash_attention=self.flash, overlap_grad_reduce=sp.overlap_grad_reduce,
                overlap_tp_comm=sp.overlap_tp_comm,
            )  # fmt: skip
        return hit

    def knob_plan(self, c: Candidate) -> Plan:
        """Returns the candidate's plan (its layout with its knobs)."""
        sp = self.space
        base = self.layout_plan(c)
        if self.global_batch % c.dp:  # uneven: the shares of this micro-batch size
            key = (c.tp, c.pp, c.dp, c.micro_batch)
            hit = self.shared.get(key)
            if hit is None:
                shares = replica_shares(self.global_batch, c.dp, c.micro_batch)
                assert shares is not None
                pipes = tuple(replace(p, batch_size=s)
                              for p, s in zip(base.pipelines, shares, strict=True))  # fmt: skip
                hit = self.shared[key] = replace(base, pipelines=pipes)
            base = hit
        if c.lightened:
            base = lighten(base, c.virtual_stages)
        return replace(
            base,
            micro_batch_size=c.micro_batch,
            precision=self.precision,
            recompute=c.recompute,
            zero_stage=c.zero_stage,
            schedule=c.schedule,
            virtual_stages=c.virtual_stages,
            sequence_parallel=c.sequence_parallel,
            flash_attention=self.flash,
            overlap_grad_reduce=sp.overlap_grad_reduce,
            overlap_tp_comm=sp.overlap_tp_comm,
        )

    def _sync(self, c: Candidate) -> tuple[_Layout, list[float], bool]:
        """Returns the candidate's layout, its sync groups' reduction times under the
        candidate's ZeRO stage and whether that stage is deferred (once per ZeRO stage)."""
        lay = self.layout(c)
        hit = lay.sync_s.get(c.zero_stage)
        if hit is None:
            plan = self._priced(c)
            hit = lay.sync_s[c.zero_stage] = (
                grad_sync_times(lay.sync, plan, self.params),
                deferred_sync(plan),
            )
        return lay, hit[0], hit[1]

    def _priced(self, c: Candidate) -> Plan:
        """Returns the plan the sync and ZeRO prices read: the knob-only plan (they read its
        knobs and, through ``deferred_sync``, whether its ZeRO-2/3 is deferred, which is
        never so for a knob-only plan), or the whole plan where the candidate's ZeRO-2/3 is
        deferred (pipelined, or ZeRO-3 with unequal micro-batch counts)."""
        if self.deferred(c.pp, c.dp, c.zero_stage):
            return self.knob_plan(c)
        return self.knobs(c)

    def _sharded(
        self, c: Candidate, lay: _Layout, j: int, fwd: float, b_side: float
    ) -> tuple[float, float]:
        """Returns stage j of pipeline 0's ZeRO-2/3 collectives exposed per micro-batch (with
        ZeRO-2's buffer work) and its parameter gather after the step, as estimate() prices
        them on the same layout and stage times (zero where the reduction runs once a step)."""
        key = (c.zero_stage, j, c.micro_batch, fwd, b_side)
        hit = lay.sharded.get(key)
        if hit is None:
            group = lay.sync.dp_members.get((0, j))
            hit = (0.0, 0.0)
            if group is not None:
                p, first, last = c.pp, j == 0, j == c.pp - 1
                split = self.shape(c).split
                zero_mb, gather = sharded_microbatch_s(
                    self._priced(c), self.model, split[j], c.tp, first, last, p == 1, group,
                    self.params, lay.sync.concurrency, fwd, b_side,
                )  # fmt: skip
                if c.zero_stage == 2:
                    p_local = stage_params(self.model, split[j], c.tp, first, last, p == 1)
                    node = lay.nodes[j]
                    eff = self.params.gpu(node.gpu.name)
                    zero_mb += zero2_buffer_s(p_local, len(group), node.gpu, eff)
                hit = (zero_mb, gather)
            lay.sharded[key] = hit
        return hit

    def send_range(self, c: Candidate, same_node: bool) -> tuple[float, float]:
        """Returns the least and the most time of one of the candidate's pipeline transfers
        (``comm.p2p_s`` of one micro-batch's activations over its TP group, as estimate()
        sends them) inside a node or between two, over every number of devices that can
        share the node's link: at least the TP group, at most the node's GPUs (or the
        group, where it spans nodes)."""
        node = self.cluster.nodes[0]
        key = (same_node, c.tp, c.micro_batch, self.precision)
        hit = self.memo.sends.get(key)
        if hit is None:
            model = self.model
            act = c.micro_batch * model.seq * model.hidden * element_bytes(self.precision)
            size = act / c.tp
            if same_node:  # (a transfer between nodes needs two of them)
                t = p2p_s(size, node, node, self.params)
                hit = (t, t)
            else:
                other = self.cluster.nodes[1]
                ts = [p2p_s(size, node, other, self.params, k)
                      for k in range(c.tp, max(node.gpus, c.tp) + 1)]  # fmt: skip
                hit = (min(ts), max(ts))
            self.memo.sends[key] = hit
        return hit

    def bound_s(self, c: Candidate, sync: bool = True) -> float:
        """Returns a lower bound of estimate()'s iteration time of the candidate's plan.

        Per stage j, with per-micro-batch forward F, backward side B (backward, recompute,
        TP collectives; ZeRO-2/3's per-micro-batch collectives where they run, priced by
        ``sharded_microbatch_s`` on the layout) from ``stage_times`` and the least time X
        blocked in its own transfers (``p2p_wait_s`` of the quickest transfers
        ``send_range`` allows): its first forward waits for the quickest chunk of every
        earlier stage and the transfers between them, then it computes m (F + B + X). Its
        last backward ends no sooner than that, nor than the next stage's last backward,
        the transfer back and its own quickest backward chunk; under 1F1B without
        interleaving, where the replay is exact, nor than its fill and ceil(m / W) rounds
        of the cycle through the later stages and back (W micro-batches in flight). Then
        the part of its gradient reduction no overlap hides (``exposed_sync_s``), its
        optimizer step and ZeRO-2's gather, and on every stage the step's all-reduces of
        one number (``step_collectives_s``). Other waits only add (left out).

        The overlap window of a gradient reduction is the stage's last backward (estimate's
        replay). Without interleaving that backward is one chunk, B plus half its transfers,
        at most the slowest transfers ``send_range`` allows; with interleaving it is left
        unbounded.

        ``sync`` False: ``_first_bound``, smaller (no reduction, no optimizer, the quickest
        transfer anywhere) and needing no data-parallel layout: the search refines it
        only for candidates it reaches."""
        m = most_micro_batches(self.global_batch, c.dp, c.micro_batch)  # the busiest replica
        if not sync:
            return self._first_bound(c, m)
        return self._combined_s(c, m, self._terms(c, m))

    def _combined_s(self, c: Candidate, m: int, t: _Terms) -> float:
        """Returns ``bound_s`` from the candidate's terms."""
        p, own = c.pp, t.own
        # a stage's last backward ends after its own work, and after the next stage's last
        # backward, the transfer back and its own quickest backward chunk; then its
        # gradient reduction's exposed part, its optimizer step and ZeRO-2's gather
        if c.schedule != "GPipe" and c.virtual_stages == 1 and p > 1 and replay_is_exact(p, m, 1):
            # 1F1B: stage j starts micro-batch i + W (W = p - j in flight at most) only after
            # i's backward, which follows i's forward through the later stages and its
            # backward back: D_j, the per-micro-batch times of stages j.. and two transfers
            # per hop; so its last backward ends no sooner than its fill + ceil(m / W) D_j
            # (proven for the replay, not for its extrapolation of the longest runs)
            own = list(own)
            cycle = 0.0
            for j in range(p - 1, -1, -1):
                cycle += t.per[j] + (2 * t.sends[j] if j < p - 1 else 0.0)
                in_flight = min(p - j, m)
                own[j] = max(own[j], t.fills[j] + -(-m // in_flight) * cycle)
        last_end = bound = 0.0
        for j in range(p - 1, -1, -1):
            last_end = max(own[j], last_end + t.drain[j]) if j < p - 1 else own[j]
            bound = max(bound, last_end + t.tails[j])
        # every rank then waits for the step's all-reduces of one number
        return (bound + t.scalar) * (1.0 - 1e-9)

    def replay_bound_s(self, c: Candidate) -> float | None:
        """Returns ``bound_s`` raised to pipeline 0's replay, where ``estimate`` replays it
        action by action: pipeline 0 runs the most micro-batches (``replica_shares``), and
        its chunk times, transfers (``comm.p2p_s`` with the node links shared as
        ``pipeline_talkers`` counts) and waits are ``estimate``'s own, so its replay is the
        one ``estimate`` makes, memoised for it (``memo_replay``). Each stage then adds its
        tail as ``bound_s`` bounds it (the reduction's exposed part, the optimizer step,
        ZeRO-2's gather) and every rank the step's one-number all-reduces. It catches what
        the closed forms miss, a pipeline whose pace its transfers' round trips set rather
        than its busiest stage. None where it adds nothing or is not proven (one stage,
        lightened chunks, a replay ``estimate`` extrapolates). The search asks it only of
        candidates about to be estimated."""
        m = most_micro_batches(self.global_batch, c.dp, c.micro_batch)
        v, p = c.virtual_stages, c.pp
        if p == 1 or c.lightened or not replay_is_exact(p, m, v):
            return None
        t = self._terms(c, m)
        plan, lay = self.knob_plan(c), self.layout(c)
        talkers, _ = layout_classes(plan, lay.sync, self.cluster.device_node)
        stages = plan.pipelines[0].stages
        nodes = [self.cluster.device_node(st.devices[0]) for st in stages]
        act = plan.micro_batch_size * self.model.seq * self.model.hidden
        act *= element_bytes(plan.precision)
        sends = []
        for j, st in enumerate(stages):
            node, nxt = nodes[j], nodes[(j + 1) % p]
            conc = max(talkers.get(node.name, 0), talkers.get(nxt.name, 0), st.tp)
            sends.append(p2p_s(act / st.tp, node, nxt, self.params, conc))
        fwd_c: list[list[float]] = []
        bwd_c: list[list[float]] = []
        for j, node in enumerate(nodes):
            parts = (0.0, 0.0, 0.0, 0.0)
            if v > 1 and (j == 0 or j == p - 1):
                parts = self._parts(c, plan, j, node)
            wait = p2p_wait_s(sends, j, v, self.params.gpu(node.gpu.name).p2p_exposed)
            fc, bc = chunk_times(t.fwd[j], t.b_side[j], wait, v, parts)
            fwd_c.append(fc)
            bwd_c.append(bc)
        rep = memo_replay(c.schedule, m, v, fwd_c, bwd_c, sends)
        tail = max(e + x for e, x in zip(rep.last_backward_end_s, t.tails, strict=True))
        return max(self._combined_s(c, m, t), (tail + t.scalar) * (1.0 - 1e-9))

    def _terms(self, c: Candidate, m: int) -> _Terms:
        """Returns what ``bound_s`` and ``replay_bound_s`` read, per stage of pipeline 0."""
        model, params, memo = self.model, self.params, self.memo
        plan = self.knobs(c)
        v = c.virtual_stages
        p = c.pp
        shards = c.dp if c.zero_stage >= 1 else 1
        nodes = self.stage_nodes(c)
        lay, sync_s, deferred = self._sync(c)
        per_mb = c.zero_stage >= 2 and not deferred  # ZeRO-2/3 collectives per micro-batch
        lo_sends: list[float] = []
        hi_sends: list[float] = []
        for j in range(p - 1 if v == 1 else p):
            lo, hi = self.send_range(c, nodes[j].name == nodes[(j + 1) % p].name)
            lo_sends.append(lo)
            hi_sends.append(hi)
        if v == 1:  # no transfer out of the last stage
            lo_sends.append(0.0)
            hi_sends.append(0.0)
        split = self.shape(c).split
        t = _Terms(lo_sends)
        f_acc = 0.0
        for j, node in enumerate(nodes):
            layers = split[j]
            first, last = j == 0, j == p - 1
            fwd, bwd, rc, tpc, f_first, b_first = self._stage(c, plan, j, node)
            blocked = params.gpu(node.gpu.name).p2p_exposed
            wait = p2p_wait_s(lo_sends, j, v, blocked)
            zero_mb = gather = 0.0
            if per_mb:
                zero_mb, gather = self._sharded(c, lay, j, fwd, bwd + rc + tpc)
            f_first += wait / 2 / v
            b_first += (zero_mb + wait / 2) / v
            p_local = stage_params(model, layers, c.tp, first, last, p == 1)
            okey = (node.gpu.name, c.tp, layers, first, last, self.precision, shards)
            opt = memo.optimizer.get(okey)
            if opt is None:
                pieces = [("layer", layers), ("embed", int(first)), ("head", int(last))]
                opt = memo.optimizer[okey] = params.compute.optimizer_s(
                    model, node.gpu, params.gpu(node.gpu.name), c.tp, self.precision, pieces,
                    p_local, shards,
                )[0]  # fmt: skip
            exposed = 0.0
            window = math.inf
            if v == 1:  # the last backward, one chunk: at most the slowest transfers
                window = bwd + rc + tpc + zero_mb + p2p_wait_s(hi_sends, j, v, blocked) / 2
            share = params.gpu(node.gpu.name).grad_overlap
            overlap = self.space.overlap_grad_reduce
            for g in lay.holds[j]:
                exposed += exposed_sync_s(sync_s[g], window, share, overlap, lay.buckets[g])
            t.fwd.append(fwd)
            t.b_side.append(bwd + rc + tpc + zero_mb)
            t.fills.append(f_acc)
            t.per.append(fwd + bwd + rc + tpc + zero_mb + wait)
            t.own.append(f_acc + m * t.per[-1])
            t.drain.append(b_first + lo_sends[j])
            t.tails.append(exposed + opt + gather)
            f_acc += f_first + lo_sends[j]  # its first chunk, then the transfer onward
        t.scalar = step_collectives_s(*lay.sync.spread, params)
        return t

    def _stage(
        self, c: Candidate, plan: Plan, j: int, node: Node
    ) -> tuple[float, float, float, float, float, float]:
        """Returns stage j's per-micro-batch forward, backward, recomputation and TP
        collectives (``stage_times``), and the forward and backward-side time of its quickest
        chunk without transfers (the fill and drain run it)."""
        p, v, layers = c.pp, c.virtual_stages, self.shape(c).split[j]
        first, last = j == 0, j == p - 1
        skey = (node.gpu.name, node.intra_node_bytes_per_s, c.tp, layers, first, last,
                c.micro_batch, c.recompute, v, self.precision, self.flash,
                self.space.overlap_tp_comm, c.sequence_parallel)  # fmt: skip
        times = self.memo.stages.get(skey)
        if times is None:
            key = StageKey(node.gpu, node.intra_node_bytes_per_s, c.tp, layers, first, last,
                           p == 1)  # fmt: skip
            times = stage_times(plan, self.model, key, node, self.params)[:5]
            self.memo.stages[skey] = times
        fwd, bwd, rc, tpc, _ = times
        if c.lightened:  # its quickest chunk, with its part
            f_first, b_first = self._quickest_chunk(c, plan, j, node, layers, skey, times)
        else:
            f_first, b_first = fwd / v, (bwd + rc + tpc) / v
        return fwd, bwd, rc, tpc, f_first, b_first

    def _first_key(self, c: Candidate) -> tuple[object, ...]:
        """Returns the key of the candidate's ``_first_bound`` terms in ``SearchMemo.first``."""
        multi = len(self.cluster.nodes) > 1
        return (c.tp, c.pp, c.micro_batch, c.recompute, c.virtual_stages, c.sequence_parallel,
                c.lightened, multi, self.precision, self.flash,
                self.space.overlap_tp_comm)  # fmt: skip

    def known_first_bound(self, c: Candidate) -> float | None:
        """Returns ``bound_s(c, sync=False)`` where its terms are already kept (another
        candidate of the same TP, PP and knobs asked for them), else None: free to ask
        before the memory check, which it may spare."""
        hit = self.memo.first.get(self._first_key(c))
        if hit is None:
            return None
        return _first_at(hit, most_micro_batches(self.global_batch, c.dp, c.micro_batch))

    def _first_bound(self, c: Candidate, m: int) -> float:
        """Returns ``bound_s`` without the gradient reduction, the optimizer step and the
        step's one-number all-reduces, every transfer at the least any placement allows:
        max over stages j of (its fill + m x its per-micro-batch time + the drain back to
        stage 0). The sums depend on the degrees only through m, so they are kept per
        (TP, PP, knobs) across data-parallel degrees and node counts, and the bound per m
        (``SearchMemo.first``)."""
        key = self._first_key(c)
        hit = self.memo.first.get(key)
        if hit is None:
            p, v = c.pp, c.virtual_stages
            multi = len(self.cluster.nodes) > 1
            lo = self.send_range(c, True)[0]
            if multi:
                lo = min(lo, self.send_range(c, False)[0])
            sends = [lo] * (p - 1) + [lo if v > 1 else 0.0]
            plan, node = self.knobs(c), self.cluster.nodes[0]
            blocked = self.params.gpu(node.gpu.name).p2p_exposed
            const, per = [], []
            fill = drain = 0.0
            # stages of one layer count and end share their times, and with these uniform
            # transfers their waits depend only on being the first or the last (lightened
            # stages' chunks differ: each asked on its own)
            split = self.shape(c).split
            times: dict[tuple[int, bool, bool], tuple[float, ...]] = {}
            waits: dict[tuple[bool, bool], float] = {}
            for j in range(p):
                first, last = j == 0, j == p - 1
                tkey = (split[j], first, last)
                hit_t = None if c.lightened else times.get(tkey)
                if hit_t is None:
                    hit_t = times[tkey] = self._stage(c, plan, j, node)
                fwd, bwd, rc, tpc, f_first, b_first = hit_t
                wait = waits.get((first, last))
                if wait is None:
                    wait = waits[(first, last)] = p2p_wait_s(sends, j, v, blocked)
                const.append(fill + drain)
                per.append(fwd + bwd + rc + tpc + wait)
                fill += f_first + wait / 2 / v + sends[j]
                drain += b_first + wait / 2 / v + sends[j]
            # of stages with one per-micro-batch time only the largest constant can make the
            # maximum (a + m x b rounds monotonically in a)
            most: dict[float, float] = {}
            for a, b in zip(const, per, strict=True):
                if a > most.get(b, -math.inf):
                    most[b] = a
            const, per = list(most.values()), list(most)
            hit = self.memo.first[key] = (const, per, {})
        return _first_at(hit, m)

    def _parts(
        self, c: Candidate, plan: Plan, j: int, node: Node
    ) -> tuple[float, float, float, float]:
        """Returns the embedding's and the head's forward and backward times on stage ``j``
        (``estimate.part_split``; zero for what the stage does not hold), memoised."""
        first, last = j == 0, j == c.pp - 1
        key = ("parts", node.gpu.name, c.tp, first, last, c.micro_batch, self.precision,
               self.flash)  # fmt: skip
        hit = self.memo.stages.get(key)
        if hit is None:
            ef, eb, hf, hb = part_split(plan, self.model, node.gpu, c.tp, first, last, self.params)
            hit = self.memo.stages[key] = (ef, eb, hf, hb, 0.0)
        return hit[0], hit[1], hit[2], hit[3]

    def _quickest_chunk(
        self,
        c: Candidate,
        plan: Plan,
        j: int,
        node: Node,
        layers: int,
        skey: tuple[object, ...],
        times: tuple[float, float, float, float, float],
    ) -> tuple[float, float]:
        """Returns the least forward and backward-side time of any chunk of stage ``j`` of a
        lightened candidate, as estimate() splits them (without transfers)."""
        memo, p, v = self.memo, c.pp, c.virtual_stages
        first, last = j == 0, j == p - 1
        ekey = (*skey[:3], 0, *skey[4:])
        empty = memo.stages.get(ekey)
        if empty is None:
            key = StageKey(node.gpu, node.intra_node_bytes_per_s, c.tp, 0, first, last, p == 1)
            empty = memo.stages[ekey] = stage_times(plan, self.model, key, node, self.params)[:5]
        ef, eb, hf, hb = self._parts(c, plan, j, node)
        fwd, bwd, rc, tpc, _ = times
        chunks = lightened_chunks(self.shape(c).split, v)[j]
        fs = chunk_split(fwd - ef - hf, empty[0] - ef - hf, layers, chunks)
        bs = chunk_split(bwd + rc + tpc - eb - hb, sum(empty[1:4]) - eb - hb, layers, chunks)
        ends = [(ef if k == 0 else 0.0) + (hf if k == v - 1 else 0.0) for k in range(v)]
        endb = [(eb if k == 0 else 0.0) + (hb if k == v - 1 else 0.0) for k in range(v)]
        return (
            min(f + e for f, e in zip(fs, ends, strict=True)),
            min(b + e for b, e in zip(bs, endb, strict=True)),
        )


def _first_at(terms: tuple[list[float], list[float], dict[int, float]], m: int) -> float:
    """Returns ``Scorer._first_bound`` at m micro-batches from its kept terms (memoised)."""
    const, per, at = terms
    bound = at.get(m)
    if bound is None:
        bound = at[m] = max(a + m * b for a, b in zip(const, per, strict=True)) * (1.0 - 1e-9)
    return bound
