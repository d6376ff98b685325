"""Simulated step time per schedule from per-action costs, e.g. those benchmarks/stage_times.py measured.

The loop's actions cost what the simulator charges (jax3d.pipeline.schedules.simulate): F is T_F, a fused
backward T_B + T_W, ZB-H1's B is T_B and its W is T_W (passes.py: stored residuals, no forward re-run,
B and W on two sides of one cut). Costs are for a whole stage; an interleaved chunk takes 1/v of each.

    python -m benchmarks.schedule_table --costs 10.0,10.5,9.8
    python -m benchmarks.schedule_table --stage-times stage_times.json
"""
from __future__ import annotations

import argparse
import json

from jax3d.pipeline.schedules import make_schedule, simulate


def table(costs, stages=(4, 8), per_stage=(2, 4), virtual=2):
    rows = []
    for p in stages:
        for mult in per_stage:
            m = mult * p
            base = simulate(make_schedule("1f1b", p, m), costs)[0]
            row = {"stages": p, "microbatches": m, "1f1b": round(base, 2)}
            for name, v in (("gpipe", 1), ("interleaved", virtual), ("zb-h1", 1)):
                t = simulate(make_schedule(name, p, m, v), costs)[0]
                row[name] = round(t, 2)
                row[f"{name}_over_1f1b"] = round(t / base, 3)
            rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--costs", default="1,1,1", help="T_F,T_B,T_W (any unit)")
    p.add_argument("--stage-times", default="", help="a JSON line from stage_times.py (its T_F_ms, T_B_ms, T_W_ms)")
    a = p.parse_args()
    if a.stage_times:
        with open(a.stage_times) as f:
            st = next(json.loads(line) for line in f if '"T_F_ms"' in line)
        costs = (st["T_F_ms"], st["T_B_ms"], st["T_W_ms"])
    else:
        costs = tuple(float(c) for c in a.costs.split(","))
    print(json.dumps({"costs_T_F_T_B_T_W": costs}))
    for row in table(costs):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
