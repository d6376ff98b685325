"""Throughput of jax3d's real train step across (data, stage, model) layouts on the devices present.

One JSON line per layout: layout, ZeRO stage, schedule, micro-batches, tokens/s, tokens/s per device,
MFU, step time, peak memory per device and compile time. It runs unchanged on 8 emulated CPU devices
(tiny model) and on N GPUs. A layout is `DATA,STAGE,MODEL[,ZERO[,SCHEDULE[,MICROBATCHES]]]`.

    python -m benchmarks.scaling --cpu-devices 8 --preset gpt-tiny --layouts 8,1,1 2,2,2 1,2,4,0,zb-h1,4
    python -m benchmarks.scaling --preset gpt-1.3b --bf16 --micro-batch-size 4 --layouts 8,1,1,1 2,1,4 1,4,2,1,1f1b,16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from benchmarks.harness import build_config, time_steps


def parse_layout(text: str) -> dict:
    parts = text.split(",")
    if len(parts) < 3:
        raise argparse.ArgumentTypeError(f"layout {text!r} must be DATA,STAGE,MODEL[,ZERO[,SCHEDULE[,MICROBATCHES]]]")
    try:
        data, stage, model = (int(p) for p in parts[:3])
        zero = int(parts[3]) if len(parts) > 3 else None
        micro = int(parts[5]) if len(parts) > 5 else 0
    except ValueError:
        raise argparse.ArgumentTypeError(f"layout {text!r}: sizes, ZeRO stage and micro-batches are integers") from None
    return {"data": data, "stage": stage, "model": model, "zero": zero,
            "schedule": parts[4] if len(parts) > 4 else "1f1b", "microbatches": micro}


def measure(base, layout: dict, steps_timed: int) -> dict:
    import jax
    from jax3d.train.memory import step_peak_bytes
    from jax3d.train.metrics import model_flops_per_token, peak_tflops

    n = layout["data"] * layout["stage"] * layout["model"]
    micro = base.train.micro_batch_size
    m = layout["microbatches"] or max(layout["stage"], 1) * 2
    cfg = base.replace(parallel={"tensor_parallel": layout["model"], "pipeline_parallel": layout["stage"],
                                 "zero_stage": layout["zero"], "pipeline_schedule": layout["schedule"]},
                       train={"global_batch_size": micro * m * layout["data"]})
    steps, state, batch, compiled, compile_s = build_config(cfg, n)
    cfg = steps.cfg
    state, metrics, t0, t1 = time_steps(steps, compiled, state, batch, steps_timed, warmup=2)
    dt = (t1 - t0) / steps_timed
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    tflops = tokens / dt * model_flops_per_token(cfg.model) / n / 1e12
    peak = peak_tflops()
    stats = jax.local_devices()[0].memory_stats() or {}
    mem = stats.get("peak_bytes_in_use") or step_peak_bytes(compiled)  # CPU: the compiled step's own peak
    return {"layout": {"data": steps.mesh_cfg.data, "stage": steps.mesh_cfg.stage, "model": steps.mesh_cfg.model},
            "zero_stage": cfg.parallel.zero_stage, "schedule": cfg.parallel.pipeline_schedule if steps.mesh_cfg.stage > 1 else None, "microbatches": steps.accum_steps, "devices": n,
            "tokens_per_s": round(tokens / dt, 1), "tokens_per_s_per_device": round(tokens / dt / n, 1),
            "mfu": round(tflops / peak, 4) if peak else None, "step_s": round(dt, 5),
            "peak_mem_gb_per_device": round(mem / 2**30, 3), "compile_s": round(compile_s, 1),
            "loss": float(metrics["loss"]), "device": jax.devices()[0].device_kind}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", type=parse_layout, required=True, help="DATA,STAGE,MODEL[,ZERO[,SCHEDULE[,M]]]")
    p.add_argument("--preset", default="gpt-tiny", help="model shape")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=0, help="(default: the preset's)")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16")
    p.add_argument("--steps", type=int, default=5, help="timed steps per layout (after 2 warm-up steps)")
    p.add_argument("--cpu-devices", type=int, default=None, help="emulate N CPU devices")
    a = p.parse_args(argv)
    if a.cpu_devices:
        from jax3d.parallel.mesh import emulate_cpu_devices
        emulate_cpu_devices(a.cpu_devices)
    from jax3d.config import Config, PrecisionConfig, TrainConfig
    from jax3d.models.presets import get_preset

    model, _ = get_preset(a.preset)
    model = dataclasses.replace(model, hidden_dropout=0.0, attention_dropout=0.0,
                                seq_length=a.seq_length or model.seq_length)
    base = Config(model=model, precision=PrecisionConfig(dtype="bfloat16" if a.bf16 else "float32"),
                  train=TrainConfig(micro_batch_size=a.micro_batch_size, global_batch_size=a.micro_batch_size))
    for layout in a.layouts:
        print(json.dumps(measure(base, layout, a.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
