"""Per-device temp memory of the compiled train step by pipeline schedule and micro-batch count.

Runs `--dry-run`'s compile on an emulated (1, 4, 1) mesh: nothing is allocated, so it runs on a laptop.

    python benchmarks/pipeline_memory.py --microbatches 8 16 32
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's jax3d

from jax3d.mesh import emulate_cpu_devices


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zb-h1"])
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="what F stores for B (ModelConfig.recompute: jax.checkpoint policy per layer)")
    a = p.parse_args()
    emulate_cpu_devices(a.stages)
    from jax3d.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from jax3d.plan import resolve
    from jax3d.train.dry_run import dry_run

    rows = []
    for m in a.microbatches:
        for sched in a.schedules:
            cfg = Config(model=ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=8,
                                           seq_length=a.seq_length, vocab_size=1024, hidden_dropout=0.0,
                                           attention_dropout=0.0, recompute=a.recompute),
                         parallel=ParallelConfig(pipeline_parallel=a.stages, pipeline_schedule=sched),
                         train=TrainConfig(micro_batch_size=a.micro_batch_size,
                                           global_batch_size=a.micro_batch_size * m))
            plan = resolve(cfg, a.stages)
            r = dry_run(plan.cfg, plan.mesh, plan.mesh.build())
            row = {"schedule": sched, "microbatches": m, "recompute": a.recompute, "temp_mib": round(r["temp"] / 2**20, 1),
                   "peak_mib": round(r["peak"] / 2**20, 1), "peak_live_activations": r["peak_live_activations"],
                   "bubble_fraction": r["bubble_fraction"], "ticks": r["ticks"]}
            print(json.dumps(row), flush=True)
            rows.append(row)


if __name__ == "__main__":
    main()
