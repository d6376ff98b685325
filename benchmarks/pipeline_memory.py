"""Per-device memory of the compiled train step over pipeline schedules, micro-batch counts and ZeRO stages.

Runs `--dry-run`'s compile (jax3d.train.dry_run) on emulated CPU devices, once per (micro-batches,
schedule, ZeRO stage): nothing is allocated, so it runs on a laptop. One JSON line each, in MiB per device.
The model is `--preset`'s, or without one a small GPT (`--num-layers`, `--hidden-size`, no dropout).

    python -m benchmarks.pipeline_memory --microbatches 8 16 32                       # schedules on (1, 4, 1)
    python -m benchmarks.pipeline_memory --preset gpt-125m --seq-length 256 --mesh 4 2 1 --schedules 1f1b \\
        --micro-batch-size 4 --microbatches 16 --zero 1 2 3                           # ZeRO under pipelining
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from jax3d.parallel.mesh import emulate_cpu_devices


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", type=int, nargs=3, default=[1, 4, 1], metavar=("DATA", "STAGE", "MODEL"))
    p.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32],
                   help="micro-batches per step (the global batch: micro-batch size x these x DATA)")
    p.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "zb-h1"])
    p.add_argument("--zero", type=int, nargs="+", default=[0], help="ZeRO stages")
    p.add_argument("--preset", default="", help="a jax3d.models preset (else the small GPT below)")
    p.add_argument("--num-layers", type=int, default=8)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--seq-length", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"],
                   help="what F stores for B (ModelConfig.recompute: jax.checkpoint policy per layer)")
    a = p.parse_args(argv)
    data, stage, model = a.mesh
    emulate_cpu_devices(data * stage * model)
    from jax3d.config import Config, ModelConfig, ParallelConfig, TrainConfig
    from jax3d.models import get_preset
    from jax3d.parallel.plan import resolve
    from jax3d.train.dry_run import dry_run

    if a.preset:
        mcfg = dataclasses.replace(get_preset(a.preset)[0], seq_length=a.seq_length, recompute=a.recompute)
    else:
        mcfg = ModelConfig(num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=8,
                           seq_length=a.seq_length, vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0,
                           recompute=a.recompute)
    for m in a.microbatches:
        for schedule in a.schedules:
            for zero in a.zero:
                cfg = Config(model=mcfg,
                             parallel=ParallelConfig(tensor_parallel=model, pipeline_parallel=stage, zero_stage=zero,
                                                     pipeline_schedule=schedule),
                             train=TrainConfig(micro_batch_size=a.micro_batch_size,
                                               global_batch_size=a.micro_batch_size * m * data))
                plan = resolve(cfg, data * stage * model)
                r = dry_run(plan, plan.mesh.build())
                print(json.dumps({"mesh": a.mesh, "schedule": schedule, "microbatches": r["micro_batches"],
                                  "zero": zero, "recompute": a.recompute,
                                  **{f"{k}_mib": round(r[k] / 2**20, 1)
                                     for k in ("params", "opt_state", "grads", "temp", "peak")},
                                  **{k: r[k] for k in ("peak_live_activations", "bubble_fraction", "ticks") if k in r}}),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
