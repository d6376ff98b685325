"""A fingerprint of each Pallas kernel as it runs at the 1.3B shapes, and of the whole train step as a
GPU runs it: the hash of its jaxpr.

A kernel (or step) timed on a GPU at one commit is the same at another when these hashes agree, which a
machine without a GPU can check (run this in a worktree of each commit and compare). Source lines and
names do not enter the hash; the operations, their order, dtypes and block shapes do. The step is the
1.3B preset cut to two layers, traced here with the kernel policy of one GPU (every kernel where its shapes fit)
but this machine's platform and attention implementation (`as_on_one_gpu`).

    python -m benchmarks.kernel_jaxprs
    python -m benchmarks.kernel_jaxprs --step --shape tiny --ablate fused_qkv
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import SHAPES, Run, config_for, kernel_policy, kernel_tuning
from jax3d.kernels import KERNELS, fp8_cast, fused_gelu, fused_norm, fused_qkv, fused_xent


def cases(tokens: int = 32768, d: int = 2048, ffn: int = 8192, vocab: int = 50304, chunk: int = 8192,
          heads: int = 16) -> dict:
    """name -> (function, example arguments): each kernel, forward and backward, at the step's shapes."""
    bf = jnp.bfloat16
    h, b = jnp.zeros((tokens, ffn), bf), jnp.zeros((ffn,), bf)
    x, s = jnp.zeros((tokens, d), bf), jnp.ones((d,), bf)
    y, qkv_b = jnp.zeros((1, tokens, 3, heads, d // heads), bf), jnp.zeros((3, heads, d // heads), bf)
    q = jnp.zeros((1, tokens, heads, d // heads), bf)
    logits, targets, weights = jnp.zeros((chunk, vocab), bf), jnp.zeros((chunk,), jnp.int32), jnp.ones((chunk,))

    def vjp(f, *args):
        return lambda *a: jax.vjp(f, *a[:len(args)])[1](a[-1])

    def norm(x, s, b):
        return fused_norm.fused_layer_norm(x, s, b, 1e-5)

    return {
        "fused_gelu_fwd": (fused_gelu.gelu_bias, (h, b)),
        "fused_gelu_bwd": (vjp(fused_gelu.gelu_bias, h, b), (h, b, h)),
        "fused_layer_norm_fwd": (norm, (x, s, s)),
        "fused_layer_norm_bwd": (vjp(norm, x, s, s), (x, s, s, x)),
        "fused_qkv_bwd": (vjp(fused_qkv.split_bias, y, qkv_b), (y, qkv_b, (q, q, q))),
        "fused_xent": (lambda lg, t, w: fused_xent.token_nll(lg, t, w, vocab - 47, bf), (logits, targets, weights)),
        "fp8_cast_transpose": (lambda a: fp8_cast.cast_transpose(a, jnp.float32(1), jnp.float8_e4m3fn), (x,)),
    }


def fingerprint(f, args) -> str:
    return _sha1(jax.make_jaxpr(f)(*args))


def _sha1(jaxpr) -> str:
    return hashlib.sha1(re.sub(r"name=\S+", "", str(jaxpr)).encode()).hexdigest()[:16]


def as_on_one_gpu(run: Run):
    """`run`'s kernel policy of one GPU, with the platform and attention implementation of a trace on this
    machine: the step a GPU runs, kernels included, traced where no GPU is."""
    platform = jax.devices()[0].platform
    return dataclasses.replace(kernel_policy(run, "gpu", 1), platform=platform,
                               attention="cudnn" if platform == "gpu" else "xla")


def step_fingerprint(shape: str = "1.3b-b16", ablate: tuple[str, ...] = (), layers: int = 2,
                     tunings: tuple[tuple[str, str], ...] = (), fp8: str = "") -> str:
    """The hash of the train step's jaxpr at `shape` (cut to `layers`), with the Pallas kernels taken as
    on one GPU (`as_on_one_gpu`), but for those in `ablate`; `tunings` and `fp8` as `harness.Run`'s."""
    from jax3d.parallel.plan import resolve
    from jax3d.train.step import abstract_batch, abstract_state, build_steps

    run = Run(shape, ablate=ablate, tunings=tunings, fp8=fp8)
    cfg = config_for(run)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers))
    steps = build_steps(resolve(cfg, 1, kernels=as_on_one_gpu(run)))
    with jax.set_mesh(steps.mesh):
        return _sha1(steps.train_step.fn.trace(abstract_state(steps),
                                               abstract_batch(steps, steps.model.sample_shapes())).jaxpr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step", action="store_true", help="also fingerprint the whole train step")
    p.add_argument("--shape", default="1.3b-b16", choices=list(SHAPES), help="the step's shape (harness.SHAPES)")
    p.add_argument("--ablate", action="append", default=[], choices=KERNELS,
                   help="the step with this Pallas kernel left out (repeatable)")
    p.add_argument("--fp8", default="", choices=["hybrid", "e4m3"], help="the step with FP8 GEMMs")
    p.add_argument("--tune", action="append", default=[], metavar="KERNEL:FIELD=V[,FIELD=V]",
                   help="the step with these kernel settings (repeatable), as throughput.py's --tune")
    a = p.parse_args(argv)
    tunings = tuple(tuple(t.partition(":")[::2]) for t in a.tune)
    for kernel, fields in tunings:
        try:
            kernel_tuning(kernel, fields)
        except ValueError as e:
            p.error(f"--tune {kernel}:{fields}: {e}")
    for name, (f, args) in cases().items():
        print(json.dumps({"kernel": name, "jaxpr_sha1": fingerprint(f, args)}), flush=True)
    if a.step:
        print(json.dumps({"step": a.shape, "ablate": a.ablate, **({"tune": a.tune} if a.tune else {}),
                          **({"fp8": a.fp8} if a.fp8 else {}),
                          "jaxpr_sha1": step_fingerprint(a.shape, tuple(a.ablate), tunings=tunings, fp8=a.fp8)}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
