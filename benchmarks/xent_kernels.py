"""The LM loss's cross-entropy over one chunk of logits, XLA's against the fused Pallas kernel, in one process.

Each variant computes the per-token loss and the weighted gradient of the logits (what one chunk of
`fused_lm_loss_sum` does between its GEMMs), timed as `harness.time_chained` times a kernel: the
gradient is the next call's logits, and the weighted loss is summed on the side. GB/s counts what must
move at the least: read the logits, write the gradient.

    python -m benchmarks.xent_kernels --rows 8192 --vocab 50304 --sweep
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import time_chained
from jax3d.kernels import fused_xent
from jax3d.models.layers import token_nll


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--valid", type=int, default=50257, help="real vocabulary columns (the rest is padding)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="also time the kernel over fused_xent.Tuning settings")
    a = p.parse_args(argv)
    k = jax.random.split(jax.random.key(0), 2)
    logits = jax.random.normal(k[0], (1, a.rows, a.vocab), jnp.bfloat16)  # (batch, seq, vocab)
    targets = jax.random.randint(k[1], (1, a.rows), 0, a.valid)
    weights = jnp.ones((1, a.rows), jnp.float32)

    # Each step carries (logits, loss so far): the per-token loss is summed on the side, so neither variant
    # drops the target pick, and neither pays a pass over the logits to keep it.
    def xla(carry):
        lg, total = carry
        nll, dnll = token_nll(lg, targets, a.valid)
        return (dnll * weights[..., None]).astype(lg.dtype), total + jnp.sum(nll * weights)

    def kernel(tuning):
        def step(carry):
            lg, total = carry
            nll, grad = fused_xent.token_nll(lg, targets, weights, a.valid, lg.dtype, tuning)
            return grad, total + jnp.sum(nll * weights)
        return step

    tunings = [fused_xent.DEFAULT]
    if a.sweep:
        grid = [fused_xent.Tuning(rows, block, warps) for rows in (1, 2, 4) for block in (1024, 2048, 4096, 8192)
                for warps in (4, 8, 16)]
        tunings += [t for t in grid if t != fused_xent.DEFAULT and a.rows % t.rows == 0]
    start = (logits, jnp.float32(0))
    base = time_chained(xla, start, a.iters)
    moved = 2 * logits.size * logits.dtype.itemsize
    print(json.dumps({"variant": "xla", "us": round(base * 1e6, 1), "GBps": round(moved / base / 1e9)}), flush=True)
    for t in tunings:
        s = time_chained(kernel(t), start, a.iters)
        print(json.dumps({"variant": "fused", **dataclasses.asdict(t), "us": round(s * 1e6, 1),
                          "GBps": round(moved / s / 1e9), "speedup": round(base / s, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
