"""Per-device bytes of `--dry-run` for ZeRO stages under pipelining, on emulated CPU devices.

Nothing is allocated: the train step compiles from abstract shapes (jax3d.train.dry_run), like
`launch/train.py --dry-run`, once per ZeRO stage.

    python benchmarks/zero_memory.py --preset gpt-125m --seq-length 256 --mesh 4 2 1 --zero 1 2 3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.mesh import emulate_cpu_devices


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-125m")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--mesh", type=int, nargs=3, default=[4, 2, 1], metavar=("DATA", "STAGE", "MODEL"))
    p.add_argument("--zero", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--micro-batch-size", type=int, default=0)
    p.add_argument("--global-batch-size", type=int, default=0)
    a = p.parse_args()
    data, stage, model = a.mesh
    emulate_cpu_devices(data * stage * model)
    from jax3d.config import Config, ParallelConfig, TrainConfig
    from jax3d.plan import resolve
    from jax3d.models import get_preset
    from jax3d.train.dry_run import dry_run

    mcfg, batch = get_preset(a.preset)
    mcfg = dataclasses.replace(mcfg, seq_length=a.seq_length, recompute=a.recompute)
    micro = a.micro_batch_size or batch["micro_batch_size"]
    global_ = a.global_batch_size or batch["global_batch_size"]
    mib = 2**20
    for zero in a.zero:
        cfg = Config(model=mcfg, parallel=ParallelConfig(tensor_parallel=model, pipeline_parallel=stage,
                                                         zero_stage=zero, pipeline_schedule=a.schedule),
                     train=TrainConfig(micro_batch_size=micro, global_batch_size=global_))
        plan = resolve(cfg, data * stage * model)
        r = dry_run(plan.cfg, plan.mesh, plan.mesh.build())
        print(json.dumps({"zero": zero, "mesh": a.mesh, "schedule": a.schedule, "recompute": a.recompute,
                          "micro_batches": r["micro_batches"],
                          **{f"{k}_mib": round(r[k] / mib, 1)
                             for k in ("params", "opt_state", "grads", "temp", "peak")}}), flush=True)


if __name__ == "__main__":
    main()
