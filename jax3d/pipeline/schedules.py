"""Pipeline schedules as data.

A schedule is a table with one row per tick and one column per stage. Each cell holds an action
(IDLE, F, B or W), the micro-batch it works on and the virtual chunk of the stage it runs. Chunk ``c``
on stage ``s`` is virtual stage ``c * p + s``; micro-batches flow through virtual stages in order.

For fused schedules (gpipe, 1f1b, interleaved) B is the whole backward pass (input and weight grads).
For split schedules (zb-h1) B is the input-grad pass only, on the critical path, and W is the weight
grad pass, deferred into what would otherwise be bubbles.

Every schedule is first built as one ordered list of actions per stage; a unit-time simulation then
places each action at the earliest tick its dependencies allow. The same orders, replayed with costs
(T_F, T_B, T_W), give the bubble figures. Orders do not depend on the costs.

Live activations: a micro-batch is live on a stage from its F until the pass that last reads the
residuals F stored: its B for fused schedules, its W for split ones (W reads the stored linear inputs
and what B left it, so both stay until W).

Costs: the loop does what `simulate` charges. F runs the forward once and stores residuals, a fused B
is the backward alone (T_B + T_W), a split B the input-grad half (T_B) and W the weight-grad half (T_W).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jax3d.parallel.pipeline_spec import (CHUNKS_NOT_INTERLEAVED, FEW_MICROBATCHES, TOO_FEW_CHUNKS,
                                          UNEVEN_MICROBATCHES, broken_rules)

IDLE, F, B, W = 0, 1, 2, 3
ACTION_LETTERS = {IDLE: ".", F: "F", B: "B", W: "W"}


class ScheduleError(ValueError):
    """A schedule cannot be built for the arguments given, or a table breaks a rule."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule table.

    kind, microbatch and chunk are int32 arrays of shape (ticks, stages); microbatch and chunk are -1
    where kind is IDLE. ``split_backward`` is True when B is input-grad only and W carries weight grads.
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray

    @property
    def ticks(self) -> int:
        return int(self.kind.shape[0])

    def stage_order(self, stage: int) -> list[tuple[int, int, int]]:
        """Non-idle actions of one stage in tick order, as (kind, microbatch, chunk)."""
        rows = np.nonzero(self.kind[:, stage] != IDLE)[0]
        return [(int(self.kind[t, stage]), int(self.microbatch[t, stage]), int(self.chunk[t, stage]))
                for t in rows]


# ---------------------------------------------------------------------------------------------
# Per-stage orders


def _gpipe_orders(p, m):
    return [[(F, i, 0) for i in range(m)] + [(B, i, 0) for i in range(m)] for _ in range(p)]


def _1f1b_orders(p, m):
    orders = []
    for s in range(p):
        warm = min(p - s - 1, m)
        order = [(F, i, 0) for i in range(warm)]
        for i in range(m - warm):  # steady state: one forward, one backward
            order += [(F, warm + i, 0), (B, i, 0)]
        order += [(B, i, 0) for i in range(m - warm, m)]
        orders.append(order)
    return orders


def _interleaved_orders(p, m, v):
    # Megatron's interleaved 1F1B: micro-batches go in groups of p through chunk 0, then the same
    # group through chunk 1, and so on; backward visits chunks in reverse.
    total = m * v

    def fwd(k):
        return (F, (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k):
        return (B, (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    orders = []
    for s in range(p):
        warm = min((p - s - 1) * 2 + (v - 1) * p, total)
        order = [fwd(k) for k in range(warm)]
        for k in range(total - warm):
            order += [fwd(warm + k), bwd(k)]
        order += [bwd(k) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def _zb_h1_orders(p, m):
    # ZB-H1 keeps 1F1B's order of F and B passes. Simulated in unit time, a stage runs a deferred W
    # whenever its next F or B cannot go: its input has not arrived, or an F would make more than p
    # micro-batches live on the stage (1F1B's peak). W passes left at the end run in the cool-down,
    # where 1F1B would idle.
    fb = _1f1b_orders(p, m)
    f_done = np.full((m, p), -1)
    b_done = np.full((m, p), -1)
    pos = [0] * p
    pending_w = [[] for _ in range(p)]
    live = [0] * p
    orders = [[] for _ in range(p)]
    t, remaining = 0, 3 * m * p
    while remaining:
        chosen = []
        for s in range(p):
            go = None
            if pos[s] < len(fb[s]):
                k, i, _ = fb[s][pos[s]]
                if k == F:
                    ok = (s == 0 or 0 <= f_done[i, s - 1] < t) and live[s] < p
                else:
                    ok = 0 <= f_done[i, s] < t and (s == p - 1 or 0 <= b_done[i, s + 1] < t)
                if ok:
                    go = (k, i, 0)
            if go is None and pending_w[s]:
                go = (W, pending_w[s][0], 0)
            if go is not None:
                chosen.append((s, go))
        for s, (k, i, c) in chosen:  # commit after all stages decided: a tick is simultaneous
            orders[s].append((k, i, c))
            if k == F:
                f_done[i, s] = t
                live[s] += 1
                pos[s] += 1
            elif k == B:
                b_done[i, s] = t
                pending_w[s].append(i)
                pos[s] += 1
            else:
                pending_w[s].pop(0)
                live[s] -= 1
        remaining -= len(chosen)
        t += 1
    return orders


# ---------------------------------------------------------------------------------------------
# Orders -> tick table


def _deps(kind, mb, vs, p, v):
    """Actions (kind, mb, virtual stage) that must finish in an earlier tick."""
    last = p * v - 1
    if kind == F:
        return [(F, mb, vs - 1)] if vs > 0 else []
    if kind == B:
        return [(F, mb, vs)] + ([(B, mb, vs + 1)] if vs < last else [])
    return [(B, mb, vs)]


def _place(orders, p, v):
    """Unit-time ASAP placement of per-stage orders into a tick table."""
    done = {}
    pos = [0] * p
    rows = []
    t = 0
    while any(pos[s] < len(orders[s]) for s in range(p)):
        row = [(IDLE, -1, -1)] * p
        for s in range(p):
            if pos[s] == len(orders[s]):
                continue
            k, i, c = orders[s][pos[s]]
            if all(done.get(d, t) < t for d in _deps(k, i, c * p + s, p, v)):
                row[s] = (k, i, c)
        if all(a[0] == IDLE for a in row):
            raise ScheduleError("the per-stage orders deadlock: no stage can make progress")
        for s, (k, i, c) in enumerate(row):
            if k != IDLE:
                done[(k, i, c * p + s)] = t
                pos[s] += 1
        rows.append(row)
        t += 1
    arr = np.array(rows, dtype=np.int32).reshape(len(rows), p, 3)
    return arr[..., 0], arr[..., 1], arr[..., 2]


# Each schedule: its per-stage orders from (stages, micro-batches, virtual stages), and whether it splits the
# backward into B (input grads) and W (weight grads).
_BUILDERS = {
    "gpipe": (lambda p, m, v: _gpipe_orders(p, m), False),
    "1f1b": (lambda p, m, v: _1f1b_orders(p, m), False),
    "interleaved": (_interleaved_orders, False),
    "zb-h1": (lambda p, m, v: _zb_h1_orders(p, m), True),
}
SCHEDULES = tuple(_BUILDERS)
# How make_schedule words each rule of the pipeline's shape (jax3d.parallel.pipeline_spec decides them).
_REFUSALS = {
    FEW_MICROBATCHES: "--microbatches {m} must be at least --stages {p}",
    TOO_FEW_CHUNKS: "--virtual-stages {v} must be at least 2 for the interleaved schedule",
    UNEVEN_MICROBATCHES: "--microbatches {m} must be divisible by --stages {p} for the interleaved schedule",
    CHUNKS_NOT_INTERLEAVED: "--virtual-stages {v} is only supported by the interleaved schedule",
}


def make_schedule(name: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Build the schedule table `name` for `stages` stages, `microbatches` micro-batches and
    `virtual_stages` chunks per stage (interleaved only). Raises ScheduleError on bad arguments."""
    p, m, v = stages, microbatches, virtual_stages
    if name not in _BUILDERS:
        raise ScheduleError(f"--schedule {name!r} is not one of {', '.join(SCHEDULES)}")
    if p < 1:
        raise ScheduleError(f"--stages {p} must be at least 1")
    broken = broken_rules(name, p, m, v)
    if broken:
        raise ScheduleError(_REFUSALS[broken[0]].format(p=p, m=m, v=v))
    orders, split = _BUILDERS[name]
    kind, mb, chunk = _place(orders(p, m, v), p, v)
    sched = Schedule(name, p, m, v, split, kind, mb, chunk)
    validate(sched)
    return sched


# ---------------------------------------------------------------------------------------------
# Validation and figures


def live_activations(sched: Schedule) -> np.ndarray:
    """Peak number of micro-batch activations live on each stage, shape (stages,).

    Live from the F until the B (fused) or the W (split), counted at the end of each tick."""
    release = W if sched.split_backward else B
    peak = np.zeros(sched.stages, dtype=np.int64)
    for s in range(sched.stages):
        col = sched.kind[:, s]
        live = np.cumsum(col == F) - np.cumsum(col == release)
        # the action that releases a micro-batch still needs it during its own tick
        peak[s] = int(np.max(live + (col == release), initial=0))
    return peak


def validate(sched: Schedule, max_live: int | None = None) -> None:
    """Raise ScheduleError unless every action runs exactly once and after its dependencies.

    Checks: F before B before W on the same stage and chunk; F of virtual stage k after F of k-1 and
    B of k after B of k+1, each in an earlier tick; W only in split schedules; and, when `max_live`
    is given, at most that many live activations on any stage."""
    p, m, v = sched.stages, sched.microbatches, sched.virtual_stages
    kinds = (F, B, W) if sched.split_backward else (F, B)
    when = {}
    for t in range(sched.ticks):
        for s in range(p):
            k, i, c = int(sched.kind[t, s]), int(sched.microbatch[t, s]), int(sched.chunk[t, s])
            if k == IDLE:
                continue
            if k not in kinds:
                raise ScheduleError(f"tick {t} stage {s}: action {k} is not allowed in {sched.name}")
            if not (0 <= i < m and 0 <= c < v):
                raise ScheduleError(f"tick {t} stage {s}: micro-batch {i} chunk {c} out of range")
            key = (k, i, c * p + s)
            if key in when:
                raise ScheduleError(f"tick {t} stage {s}: {ACTION_LETTERS[k]}{i} chunk {c} runs twice")
            when[key] = t
    for k in kinds:
        for i in range(m):
            for vs in range(p * v):
                key = (k, i, vs)
                if key not in when:
                    raise ScheduleError(f"{ACTION_LETTERS[k]}{i} of virtual stage {vs} never runs")
                for dep in _deps(k, i, vs, p, v):
                    if when[dep] >= when[key]:
                        raise ScheduleError(
                            f"{ACTION_LETTERS[k]}{i} of virtual stage {vs} (tick {when[key]}) does not "
                            f"come after {ACTION_LETTERS[dep[0]]}{i} of virtual stage {dep[2]} "
                            f"(tick {when[dep]})")
    if max_live is not None:
        peak = live_activations(sched)
        if peak.max() > max_live:
            s = int(np.argmax(peak))
            raise ScheduleError(f"stage {s} holds {peak[s]} live activations, more than {max_live}")


def simulate(sched: Schedule, costs=(1.0, 1.0, 1.0)) -> tuple[float, np.ndarray]:
    """Replay each stage's order with durations; returns (makespan, busy time per stage).

    costs = (T_F, T_B, T_W) for a whole stage; a chunk action takes 1/v of it. A fused B costs
    T_B + T_W. Communication is free; each action starts when its stage is free and its inputs exist."""
    t_f, t_b, t_w = (float(c) / sched.virtual_stages for c in costs)
    dur = {F: t_f, B: t_b if sched.split_backward else t_b + t_w, W: t_w}
    p, v = sched.stages, sched.virtual_stages
    orders = [sched.stage_order(s) for s in range(p)]
    pos, free, busy, end = [0] * p, [0.0] * p, np.zeros(p), {}
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                k, i, c = orders[s][pos[s]]
                deps = _deps(k, i, c * p + s, p, v)
                if not all(d in end for d in deps):
                    break
                start = max([free[s]] + [end[d] for d in deps])
                end[(k, i, c * p + s)] = free[s] = start + dur[k]
                busy[s] += dur[k]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("the per-stage orders deadlock under the cost model")
    return max(free), busy


def bubble_fraction(sched: Schedule, costs=(1.0, 1.0, 1.0)) -> float:
    """Idle stage-time over total stage-time (stages x makespan) under the cost model."""
    makespan, busy = simulate(sched, costs)
    return float(1.0 - busy.sum() / (sched.stages * makespan))


def render(sched: Schedule) -> str:
    """Text timeline, one line per stage; cells are e.g. F3, B3, W3 (chunk suffix when v > 1)."""
    width = len(str(sched.microbatches - 1)) + 1 + (2 if sched.virtual_stages > 1 else 0)
    lines = []
    for s in range(sched.stages):
        cells = []
        for t in range(sched.ticks):
            k = int(sched.kind[t, s])
            if k == IDLE:
                cells.append(".".ljust(width))
            else:
                cell = f"{ACTION_LETTERS[k]}{sched.microbatch[t, s]}"
                if sched.virtual_stages > 1:
                    cell += f".{sched.chunk[t, s]}"
                cells.append(cell.ljust(width))
        lines.append(f"stage {s}: " + " ".join(cells).rstrip())
    return "\n".join(lines)


def summary(sched: Schedule, costs=(1.0, 1.0, 1.0)) -> dict:
    """The figures the CLI prints as JSON."""
    return {
        "schedule": sched.name,
        "stages": sched.stages,
        "microbatches": sched.microbatches,
        "virtual_stages": sched.virtual_stages,
        "ticks": sched.ticks,
        "bubble_fraction": round(bubble_fraction(sched, costs), 6),
        "peak_live_activations": int(live_activations(sched).max()),
    }
