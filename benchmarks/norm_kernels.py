"""Layer norm alone, XLA's against the fused Pallas kernels, forward and forward+backward, in one process.

Each figure is `harness.time_chained`'s: the median over `--iters` calls of one jitted chain that applies
the kernel `REPEAT` times (its output is the next input), divided by `REPEAT`, so dispatch costs no part of
it. GB/s is the bytes a kernel must move at the least (forward: read x, write y; backward: read x and dy,
write dx) over its time.

    python -m benchmarks.norm_kernels --rows 32768 --width 2048 1024
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import time_chained
from jax3d.kernels import fused_norm
from jax3d.models import layers

VARIANTS = {
    "xla": lambda x, s, b: layers.lean_layer_norm(x, s, b, 1e-5),
    "fused": lambda x, s, b: fused_norm.fused_layer_norm(x, s, b, 1e-5),
}


def _sweep(a) -> None:
    """Forward and backward settings (fused_norm.Tuning), each kernel timed alone at each width."""
    tune = fused_norm.Tuning
    for d in a.width:
        k = jax.random.split(jax.random.key(0), 2)
        x = jax.random.normal(k[0], (a.rows, d), jnp.bfloat16)
        dy = jax.random.normal(k[1], (a.rows, d), jnp.bfloat16)
        s, b = jnp.ones((d,), jnp.bfloat16), jnp.zeros((d,), jnp.bfloat16)
        _, mean, rstd = fused_norm._forward(x, s, b, 1e-5, fused_norm.DEFAULT, False)
        for rows in (1, 2, 4, 8):
            for warps in (2, 4, 8, 16):
                t = tune(rows_fwd=rows, warps_fwd=warps)
                t = time_chained(lambda x, t=t: fused_norm._forward(x, s, b, 1e-5, t, False)[0], x, a.iters)
                print(json.dumps({"sweep": "fwd", "width": d, "rows": rows, "warps": warps,
                                  "us": round(t * 1e6, 1), "GBps": round(4 * x.size / t / 1e9)}), flush=True)
        for rows in (1, 2, 4):
            for warps in (4, 8, 16):
                for programs in (264, 528, 1056, 2112):
                    t = tune(rows_bwd=rows, warps_bwd=warps, bwd_programs=programs)
                    t = time_chained(lambda dy, t=t: fused_norm._backward(x, dy, s, mean, rstd, t, False)[0], dy,
                                     a.iters)
                    print(json.dumps({"sweep": "bwd", "width": d, "rows": rows, "warps": warps,
                                      "programs": programs, "us": round(t * 1e6, 1),
                                      "GBps": round(6 * x.size / t / 1e9)}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--width", type=int, nargs="+", default=[2048, 1024])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--sweep", action="store_true",
                   help="also time the fused kernels over block shapes and warps (fused_norm's settings)")
    a = p.parse_args(argv)
    if a.sweep:
        _sweep(a)
    for d in a.width:
        k = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(k[0], (a.rows, d), jnp.bfloat16)
        s, b = jnp.ones((d,), jnp.bfloat16), jnp.zeros((d,), jnp.bfloat16)
        base = {}
        for name, ln in VARIANTS.items():
            t_f = time_chained(lambda x, ln=ln: ln(x, s, b), x, a.iters)
            # the cotangent of x (its gradient) is the next input: a forward and a backward pass each time
            t_b = time_chained(lambda x, ln=ln: jax.vjp(lambda x: ln(x, s, b), x)[1](x)[0], x, a.iters)
            base.setdefault("f", t_f)
            base.setdefault("b", t_b)
            print(json.dumps({"variant": name, "rows": a.rows, "width": d, "fwd_us": round(t_f * 1e6, 1),
                              "fwd_bwd_us": round(t_b * 1e6, 1), "fwd_GBps": round(4 * x.size / t_f / 1e9),
                              "speedup_fwd": round(base["f"] / t_f, 3), "speedup_fwd_bwd": round(base["b"] / t_b, 3)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
