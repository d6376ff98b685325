"""The MLP's gelu(h + b), forward and backward each alone: XLA's fusions against the Pallas kernels.

XLA's variants are the model's own maths (GELU in the activations' dtype, bf16) and the same in fp32
maths. Each direction is timed alone, as `harness.time_chained` times a kernel: forward, h ->
gelu(h + b); backward, h -> the gradient of h given h and an incoming gradient equal to h, with the
bias gradient summed on the side (the forward value is unused, so only the backward runs). Each
variant is also timed in a `fori_loop` chain, the harness the earlier kernel sweeps used. GB/s counts
what must move at the least: forward, read h and write the output; backward, read h and the gradient,
write h's gradient.

    python -m benchmarks.gelu_kernels --rows 32768 --ffn 8192 --sweep
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import time_chained
from jax3d.kernels import fused_gelu


def _xla(fp32: bool):
    def gelu(h, b):
        z = h.astype(jnp.float32) + b.astype(jnp.float32) if fp32 else h + b
        return jax.nn.gelu(z, approximate=True).astype(h.dtype)
    return gelu


def _kernel(tuning):
    return lambda h, b: fused_gelu.gelu_bias(h, b, tuning)


def _steps(gelu, b):
    """Forward: h -> gelu(h + b). Backward: (h, db) -> (h's gradient, db + the bias gradient), given h and an
    incoming gradient equal to h; the forward value is unused, so only the backward runs."""
    def bwd(carry):
        h, db = carry
        dh, dbias = jax.vjp(gelu, h, b)[1](h)
        return dh, db + dbias.astype(jnp.float32)
    return (lambda h: gelu(h, b)), bwd


def _time(gelu, h, b, iters: int, unroll: bool = True):
    fwd, bwd = _steps(gelu, b)
    return (time_chained(fwd, h, iters, unroll),
            time_chained(bwd, (h, jnp.zeros(b.shape, jnp.float32)), iters, unroll))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32768, help="tokens")
    p.add_argument("--ffn", type=int, default=8192, help="MLP hidden size")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--sweep", action="store_true", help="also time a grid of fused_gelu.Tuning settings")
    a = p.parse_args(argv)
    k = jax.random.split(jax.random.key(0), 2)
    h = jax.random.normal(k[0], (a.rows, a.ffn), jnp.bfloat16)
    b = (jax.random.normal(k[1], (a.ffn,)) * 0.1).astype(jnp.bfloat16)
    nbytes = h.size * h.dtype.itemsize

    def report(name, fwd, bwd, **extra):
        print(json.dumps({"variant": name, **extra, "fwd_us": round(fwd * 1e6, 1),
                          "fwd_GBps": round(2 * nbytes / fwd / 1e9), "bwd_us": round(bwd * 1e6, 1),
                          "bwd_GBps": round(3 * nbytes / bwd / 1e9)}), flush=True)

    for name, gelu in [("xla_bf16", _xla(False)), ("xla_fp32", _xla(True)), ("kernel", _kernel(fused_gelu.DEFAULT))]:
        for unroll in (True, False):
            report(name, *_time(gelu, h, b, a.iters, unroll), chain="unrolled" if unroll else "fori_loop")
    if a.sweep:
        tune = fused_gelu.Tuning
        for t in [tune(cols_fwd=c, rows_fwd=r, warps_fwd=w) for c in (512, 1024, 2048) for r in (2, 4, 8)
                  for w in (4, 8)]:
            if t.fits(a.rows, a.ffn):
                f = time_chained(_steps(_kernel(t), b)[0], h, a.iters)
                print(json.dumps({"sweep": "fwd", "cols": t.cols_fwd, "rows": t.rows_fwd, "warps": t.warps_fwd,
                                  "us": round(f * 1e6, 1), "GBps": round(2 * nbytes / f / 1e9)}), flush=True)
        for t in [tune(cols_bwd=c, rows_bwd=r, rows_per_program=per, warps_bwd=w) for c in (256, 512, 1024)
                  for r in (4, 8, 16) for per in (64, 128, 256) for w in (4, 8)]:
            if t.fits(a.rows, a.ffn):
                bw = time_chained(_steps(_kernel(t), b)[1], (h, jnp.zeros(b.shape, jnp.float32)), a.iters)
                print(json.dumps({"sweep": "bwd", "cols": t.cols_bwd, "rows": t.rows_bwd,
                                  "per_program": t.rows_per_program, "warps": t.warps_bwd,
                                  "us": round(bw * 1e6, 1), "GBps": round(3 * nbytes / bw / 1e9)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
