"""An FP8 GEMM operand quantized in both layouts, with its amax, in one pass: a Pallas (Triton) kernel.

Hopper's FP8 GEMMs take both operands with the contracted dimension minor ("TN"). A GEMM of x (T, K) and
w (K, N) needs x with K minor for the forward and with T minor for the weight gradient, w with K minor
(transposed) for the forward and with N minor for the input gradient, and the output gradient g (T, N) in both
layouts too. jax3d.models.fp8 left those transposes of the f8 arrays to XLA, whose unfused transposing kernels and
separate quantizes and amaxes took back most of what the FP8 GEMMs saved (docs/performance.md, "Kernel notes").

Here one program per (rows, cols) tile reads the bf16 tile once and writes the f8 tile, its transpose and the
tile's amax: `cast_transpose`. It runs by default on one GPU wherever the GEMM's sizes are whole tiles
(`DEFAULT`, the kernel policy of one GPU); a policy that leaves it out (`KernelPolicy.resolve(..., off=["fp8_cast"])`)
gives jax3d.models.fp8's einsum of the f8 arrays and XLA's transposes, which ran slower (docs/performance.md).

XLA's own casts do not do it: quantizing the bf16 operand and its transpose separately (a variant this module
had), XLA merged the two quantizes and transposed the f8 result again. Compiled for an H100 without one
(benchmarks/gpu_compile.py), the step still had hundreds of kernels that transpose with that variant, and none with
this kernel (docs/performance.md).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import check_powers_of_two, compiler_params


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The tile (rows x cols of the (T, K) view) each program quantizes, and its warps."""

    rows: int = 64
    cols: int = 64
    warps: int = 4

    def __post_init__(self):
        check_powers_of_two(self, "rows", "cols", "warps")


DEFAULT = Tuning()


def supported(shape: tuple[int, int], tuning: Tuning = DEFAULT) -> bool:
    """Whether `cast_transpose` takes a 2-D operand of `shape`: in whole tiles."""
    return shape[0] % tuning.rows == 0 and shape[1] % tuning.cols == 0


def largest(f8) -> float:
    """The largest finite value of an f8 format (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(f8).max)


def to_f8(v, f8):
    """v clipped to the f8 format's range, in f8."""
    top = largest(f8)
    return jnp.clip(v, -top, top).astype(f8)


def quantize(a, scale, f8):
    """a / scale, clipped to the format's range, in f8 (computed in a's dtype)."""
    return to_f8(a / scale.astype(a.dtype), f8)


def reference(a_tk, scale, f8):
    """What `cast_transpose` computes, in plain JAX: (quantized a, its transpose, max |a|)."""
    q = quantize(a_tk, scale, f8)
    return q, q.T, jnp.max(jnp.abs(a_tk)).astype(jnp.float32)


def _kernel(inverse_ref, a_ref, q_ref, qt_ref, amax_ref):
    a = a_ref[...]
    # Times the scale's inverse, not divided by the scale: Triton's fp32 division may be approximate, and the
    # product is exact for a power-of-two scale (jax3d.parallel.precision.Recipe), so the codes are quantize's: a / scale is
    # exact in bf16 and fp32 alike, its rounding to f8 the same from either.
    q = to_f8(a.astype(jnp.float32) * inverse_ref[0], q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = q.T
    amax_ref[...] = jnp.max(jnp.abs(a.astype(jnp.float32))).reshape(1, 1)


@functools.partial(jax.jit, static_argnames=("f8", "tuning", "interpret"))
def cast_transpose(a_tk, scale, f8, tuning: Tuning = Tuning(), interpret: bool = False):
    """(a / scale clipped and in `f8` (T, K), the same transposed (K, T), max |a| as fp32) of a 2-D `a_tk`
    whose sizes are multiples of the tile's; `scale` a scalar. `interpret=True` runs it in Pallas'
    interpreter, on any backend (for tests)."""
    t, k = a_tk.shape
    r, c = tuning.rows, tuning.cols
    if t % r or k % c:
        raise ValueError(f"a ({t}, {k}) operand is not a whole number of {tuning}'s tiles")
    q, qt, amax = pl.pallas_call(
        _kernel,
        out_shape=(jax.ShapeDtypeStruct((t, k), f8), jax.ShapeDtypeStruct((k, t), f8),
                   jax.ShapeDtypeStruct((t // r, k // c), jnp.float32)),
        grid=(t // r, k // c),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), pl.BlockSpec((r, c), lambda i, j: (i, j))],
        out_specs=(pl.BlockSpec((r, c), lambda i, j: (i, j)), pl.BlockSpec((c, r), lambda i, j: (j, i)),
                   pl.BlockSpec((1, 1), lambda i, j: (i, j))),
        compiler_params=compiler_params(tuning.warps, interpret),
        interpret=interpret,
        name="fp8_cast_transpose",
    )(jnp.reshape(1.0 / scale.astype(jnp.float32), (1,)), a_tk)
    return q, qt, jnp.max(amax)


register("fp8_cast", Tuning, DEFAULT, supported, cast_transpose, reference)
