"""Lowering a schedule table to the per-tick instructions the loop executes.

The loop needs, for every tick and stage, more than the schedule's (action, micro-batch, chunk):
which pass to run (F, B and W differ at the first and last virtual stage: a branch index), which
buffer slots the pass reads and writes, and into which slot the activation or grad arriving from a
neighbour at the end of the tick goes. All of it is static, so it is worked out here in numpy, once,
at trace time.

Slots are allocated by interval colouring, one pool per buffer and stage:
- an input activation, from the end of its producer's tick (when the ppermute delivers it) until its
  own F reads it;
- F's stored residuals, from F until B (fused schedules) or W (split ones);
- an output grad, from its arrival (at the last virtual stage, from its own F) until B or W;
- in split schedules, B's side of the cut, from B until W.
The slot count is the peak occupancy, which for 1F1B-family schedules does not grow with the number
of micro-batches.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax3d.pipeline.schedules import IDLE, F, B, W, Schedule

# Columns of Program.table
BRANCH, MB, CHUNK, ACT_SLOT, GRAD_SLOT, RECV_ACT, RECV_GRAD, RES_SLOT, CUT_SLOT = range(9)


@dataclasses.dataclass(frozen=True)
class Program:
    """Static instructions: table (ticks, stages, 9) int32 and the branch each index stands for;
    sends (ticks, 2) bool: whether any stage sends forward / backward at the end of each tick."""

    table: np.ndarray
    branches: tuple  # (kind, is_first_virtual_stage, is_last_virtual_stage) per branch index
    act_slots: int
    grad_slots: int
    res_slots: int
    cut_slots: int
    sends: np.ndarray


def _colour(intervals):
    """Assign the lowest free slot to each (start, end, key); an interval [start, end] of ticks is
    busy from the end of tick `start` through tick `end` inclusive. Returns ({key: slot}, count)."""
    slot_free_after = []  # per slot: last tick it is read in
    out = {}
    for start, end, key in sorted(intervals):
        for j, last in enumerate(slot_free_after):
            if last <= start:  # read at or before the tick whose end brings the new value
                slot_free_after[j] = end
                out[key] = j
                break
        else:
            out[key] = len(slot_free_after)
            slot_free_after.append(end)
    return out, len(slot_free_after)


def lower(sched: Schedule) -> Program:
    """Work out branches and buffer slots for every tick and stage of `sched`."""
    p, v = sched.stages, sched.virtual_stages
    last_vs = p * v - 1
    when = {}
    for t in range(sched.ticks):
        for s in range(p):
            k = int(sched.kind[t, s])
            if k != IDLE:
                when[(k, int(sched.microbatch[t, s]), int(sched.chunk[t, s]) * p + s)] = t
    release = W if sched.split_backward else B

    act_iv = [[] for _ in range(p)]
    grad_iv = [[] for _ in range(p)]
    res_iv = [[] for _ in range(p)]
    cut_iv = [[] for _ in range(p)]
    for (k, i, vs), t in when.items():
        s = vs % p
        if k == F and vs > 0:  # input arrives from virtual stage vs-1 at the end of its F tick
            act_iv[s].append((when[(F, i, vs - 1)], t, (i, vs)))
        if k == F:
            res_iv[s].append((t, when[(release, i, vs)], (i, vs)))
        if k == B:  # the output grad comes from upstream's B, or from this stage's own F at the end
            start = when[(B, i, vs + 1)] if vs < last_vs else when[(F, i, vs)]
            grad_iv[s].append((start, when[(release, i, vs)], (i, vs)))
        if k == B and sched.split_backward and vs > 0:  # what W reads from B's side of the cut
            cut_iv[s].append((t, when[(W, i, vs)], (i, vs)))
    act_slot, grad_slot, res_slot, cut_slot = [], [], [], []
    n_act = n_grad = n_res = n_cut = 1  # at least one slot so buffers are never empty arrays
    for s in range(p):
        a, na = _colour(act_iv[s])
        g, ng = _colour(grad_iv[s])
        r, nr = _colour(res_iv[s])
        u, nu = _colour(cut_iv[s])
        act_slot.append(a)
        grad_slot.append(g)
        res_slot.append(r)
        cut_slot.append(u)
        n_act, n_grad, n_res, n_cut = max(n_act, na), max(n_grad, ng), max(n_res, nr), max(n_cut, nu)

    branches = [(IDLE, False, False)]
    table = np.full((sched.ticks, p, 9), -1, dtype=np.int32)
    table[..., BRANCH] = 0
    for t in range(sched.ticks):
        for s in range(p):
            k, i, c = int(sched.kind[t, s]), int(sched.microbatch[t, s]), int(sched.chunk[t, s])
            if k == IDLE:
                continue
            vs = c * p + s
            first, last = vs == 0, vs == last_vs
            if sched.split_backward and k == B and first:
                continue  # nothing upstream needs this grad; W does the weight work
            key = (k, first, last)
            if key not in branches:
                branches.append(key)
            row = table[t, s]
            row[BRANCH], row[MB], row[CHUNK] = branches.index(key), i, c
            if k == F and not first:
                row[ACT_SLOT] = act_slot[s][(i, vs)]
            row[RES_SLOT] = res_slot[s][(i, vs)]
            if (i, vs) in cut_slot[s] and k != F:
                row[CUT_SLOT] = cut_slot[s][(i, vs)]
            if k != F or last:
                row[GRAD_SLOT] = grad_slot[s][(i, vs)]
            # what this action sends lands on the neighbour at the end of this tick
            if k == F and not last:
                table[t, (vs + 1) % p, RECV_ACT] = act_slot[(vs + 1) % p][(i, vs + 1)]
            if k == B and not first:
                table[t, (vs - 1) % p, RECV_GRAD] = grad_slot[(vs - 1) % p][(i, vs - 1)]
    sends = np.stack([(table[..., RECV_ACT] >= 0).any(1), (table[..., RECV_GRAD] >= 0).any(1)], 1)
    return Program(table, tuple(branches), n_act, n_grad, n_res, n_cut, sends)
