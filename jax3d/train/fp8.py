"""FP8 delayed scaling: the amax history of every FP8 GEMM operand, the scales it gives and its update each step.

Transformer Engine's recipe (`DelayedScaling`), with Megatron-DeepSpeed's flags: each GEMM of the blocks
(jax3d.models.fp8) quantizes x, w and the output gradient g with a scale taken from amaxes of earlier steps,
never from the tensor being quantized, so the quantization needs no reduction over the tensor first and fuses
with the producer. Delayed rather than current scaling: current scaling would put a global max (an all-reduce
under tensor parallelism) in front of every GEMM.

The state (`TrainState.fp8`) is a tree shaped like the blocks' scales leaves plus a trailing history dim:
(layers, 3, history) per GEMM, rows x, w, g, entry 0 the latest step's amax, entry i the amax of i steps
before. The step reads the scales off it (`scales`), the model reports the amaxes it saw (the scales'
"gradients", max-reduced over micro-batches, data shards and pipeline stages' micro-batches), and `update`
pushes them in. A step that is skipped (non-finite gradients) leaves the history as it was. The first step
quantizes with scale 1, as Transformer Engine's does: its gradients, far below e5m2's normal range, mostly
round to zero (with Megatron's warm-up its learning rate is 0 anyway), and every later step has amaxes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jax3d.config import PrecisionConfig
from jax3d.models import fp8 as fp8_ops
from jax3d.xla_options import unless_in_xla_flags

# XLA autotunes each FP8 GEMM (cuBLASLt's and Triton's candidates) while it compiles, and at its default level, 4,
# checks every candidate's output against a reference GEMM. Level 3 keeps the autotuning and its buffer
# initialisation and leaves out the check: on one H100, gpt-1.3b at batch 2 with full recompute, the FP8 step
# compiled in 17.2 s against 62.8 s and ran at the same speed (docs/performance.md). A bf16 step has few GEMM
# candidates and is left at XLA's default. XLA_FLAGS=--xla_gpu_autotune_level=4 brings the check back.
FP8_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 3}


def compiler_options(precision: PrecisionConfig, env=os.environ) -> dict:
    """The train step's XLA options: FP8_COMPILER_OPTIONS in FP8 (less what XLA_FLAGS sets), else none."""
    return unless_in_xla_flags(FP8_COMPILER_OPTIONS, env) if precision.fp8 else {}


def autotuning_off_note(precision: PrecisionConfig, env=os.environ) -> str | None:
    """A line for the run's header when XLA_FLAGS turns GEMM autotuning off under FP8: XLA then chose no FP8 GEMM,
    and the 1.3B step ran at 0.05x (one H100, docs/performance.md)."""
    if precision.fp8 and re.search(r"--xla_gpu_autotune_level=0(\s|$)", env.get("XLA_FLAGS", "")):
        return ("jax3d: XLA_FLAGS sets --xla_gpu_autotune_level=0, with which XLA picks no FP8 GEMM and the FP8 "
                "step runs about 20x slower on a GPU; drop it (jax3d compiles FP8 steps at level 3)")
    return None


@dataclass(frozen=True)
class Recipe:
    """The delayed-scaling recipe of a run: format, margin, history length and how the history gives an amax."""

    format: str
    margin: int = 0
    history: int = 1
    algorithm: str = "most_recent"

    @classmethod
    def of(cls, precision: PrecisionConfig) -> "Recipe | None":
        """The run's recipe, or None when FP8 is off."""
        if not precision.fp8:
            return None
        return cls(precision.fp8, precision.fp8_margin, precision.fp8_amax_history_len,
                   precision.fp8_amax_compute_algo)

    def _largest(self):
        fwd, grad = fp8_ops.FORMATS[self.format]
        return jnp.asarray([fp8_ops.largest(fwd), fp8_ops.largest(fwd), fp8_ops.largest(grad)], jnp.float32)

    def init(self, scales_tree):
        """A fresh history (zeros: scale 1 until an amax is seen) for a tree of (..., 3) scales leaves (abstract)."""
        return jax.tree.map(lambda a: jnp.zeros((*a.shape, self.history), jnp.float32), scales_tree)

    def scales(self, history):
        """The dequantizing scales of a history: amax * 2**margin / the format's largest value, rounded up to a
        power of two, where the history holds a positive finite amax, else 1. A power of two divides exactly and
        makes the product of two scales, which multiplies an FP8 GEMM's bf16 output, exact (jax3d.models.fp8);
        rounding up keeps amax / scale within the format's range, at most one binade below its top."""
        top = self._largest()

        def one(h):
            ref = h[..., 0] if self.algorithm == "most_recent" else jnp.max(h, axis=-1)
            ok = (ref > 0) & jnp.isfinite(ref)
            return jnp.where(ok, power_of_two_above(ref * (2.0 ** self.margin) / top), 1.0)
        return jax.tree.map(one, history)

    @staticmethod
    def update(history, amaxes):
        """The history with this step's amaxes in front and the oldest entry dropped."""
        return jax.tree.map(lambda h, a: jnp.concatenate([a.astype(h.dtype)[..., None], h[..., :-1]], axis=-1),
                            history, amaxes)


def power_of_two_above(v):
    """The least power of two >= v, for positive finite v (exact: frexp, not a rounded log2); at least the
    smallest normal float, so that a scale is never zero."""
    # v = mantissa * 2**exponent, mantissa in [0.5, 1): a power of two has mantissa 0.5
    mantissa, exponent = jnp.frexp(jnp.maximum(v, jnp.finfo(v.dtype).tiny))
    return jnp.ldexp(jnp.ones_like(v), jnp.where(mantissa == 0.5, exponent - 1, exponent))


def history_specs(scales_specs):
    """PartitionSpecs of the history: those of the scales leaves, the history dim unsharded."""
    return jax.tree.map(lambda s: jax.sharding.PartitionSpec(*s, None), scales_specs,
                        is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
