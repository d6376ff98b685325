"""Times one pipeline stage's work on the current device: T_F, T_B (input grad) and T_W (weight grad).

The stage runs `--num-layers / --stages` blocks of the preset on one micro-batch. The pipeline loop
recomputes a chunk's forward inside B and W, so the raw costs it pays are F, F+B and F+W (F+B+W for
fused schedules); T_B and T_W below are those minus T_F.

    python benchmarks/stage_times.py --preset gpt-1.3b --stages 4 --micro-batch-size 4 --bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.models import build_model, get_preset


def _time(fn, *args, reps=10):
    out = fn(*args)
    jax.block_until_ready(out)
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    a = p.parse_args()
    cfg, _ = get_preset(a.preset)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0,
                              seq_length=a.seq_length or cfg.seq_length)
    layers = cfg.num_layers // a.stages
    model = build_model(cfg)
    dtype = jnp.bfloat16 if a.bf16 else jnp.float32
    keys = jax.random.split(jax.random.key(0), layers)
    blocks = jax.jit(jax.vmap(lambda k: model.block.init(k, model._dummy_x())["params"]))(keys)
    blocks = jax.tree.map(lambda w: w.value.astype(dtype) if hasattr(w, "value") else w.astype(dtype), blocks,
                          is_leaf=lambda w: hasattr(w, "value"))
    x = jax.random.normal(jax.random.key(1), (a.micro_batch_size, cfg.seq_length, cfg.hidden_size), dtype)
    g = jnp.ones_like(x)
    run = lambda w, x: model.run_blocks(w, x)
    fwd = jax.jit(run)
    f_b = jax.jit(lambda w, x, g: jax.vjp(lambda x: run(w, x), x)[1](g))
    f_w = jax.jit(lambda w, x, g: jax.vjp(lambda w: run(w, x), w)[1](g))
    f_bw = jax.jit(lambda w, x, g: jax.vjp(run, w, x)[1](g))
    t_f, t_fb, t_fw, t_fbw = (_time(fwd, blocks, x), _time(f_b, blocks, x, g), _time(f_w, blocks, x, g),
                              _time(f_bw, blocks, x, g))
    out = {"device": jax.devices()[0].device_kind, "preset": a.preset, "layers_per_stage": layers,
           "micro_batch": a.micro_batch_size, "seq": cfg.seq_length, "dtype": str(jnp.dtype(dtype)),
           "T_F_ms": t_f * 1e3, "T_F_plus_B_ms": t_fb * 1e3, "T_F_plus_W_ms": t_fw * 1e3,
           "T_F_plus_BW_ms": t_fbw * 1e3, "T_B_ms": (t_fb - t_f) * 1e3, "T_W_ms": (t_fw - t_f) * 1e3,
           "T_BW_fused_ms": (t_fbw - t_f) * 1e3}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
