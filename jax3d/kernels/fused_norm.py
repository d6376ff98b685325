"""Layer norm as two Pallas (Triton) kernels, forward and backward, for one GPU.

XLA splits a layer norm into several kernels: the forward pass reads its input once per reduction and
again to normalise; the backward pass computes the input's gradient (a row reduction) and the scale
and bias gradients (column reductions) in separate kernels that each read the input and the incoming
gradient. Here each direction is one kernel over blocks of rows: the forward pass reads x once and
writes y and the per-row mean and inverse deviation; the backward pass reads x and dy once, writes dx,
and leaves per-program partial sums of the scale and bias gradients, which XLA adds up (a few MB).

The maths is `layers.layer_norm`'s: fp32 statistics, two-pass variance, output in x's dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import block_width, check_powers_of_two, compiler_params

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block shapes and warps. The defaults are the best of a sweep of them (docs/performance.md,
    "Kernel notes"); `benchmarks.throughput --tune fused_norm:FIELD=V` times others in the step."""

    rows_fwd: int = 2  # rows per forward program
    warps_fwd: int = 4
    rows_bwd: int = 1  # rows per step of a backward program's loop
    warps_bwd: int = 4
    bwd_programs: int = 1024  # at most: fewer partial sums to write, enough to fill the GPU

    def __post_init__(self):
        check_powers_of_two(self, "rows_fwd", "warps_fwd", "rows_bwd", "warps_bwd")
        if self.bwd_programs < 1:
            raise ValueError(f"fused_norm.{self}: bwd_programs must be at least 1")


DEFAULT = Tuning()


def supported(x, tuning: Tuning = DEFAULT) -> bool:
    """Whether `fused_layer_norm` takes this input: a width of 128 to 8192, whole backward row blocks. The
    forward takes any rows (`_rows_per_program`)."""
    d = x.shape[-1]
    rows = x.size // d if d else 0
    return 128 <= d <= 8192 and rows > 0 and rows % tuning.rows_bwd == 0


def reference(x, scale, bias, eps: float):
    """What `fused_layer_norm` computes, in plain JAX: layer norm over the last dim in fp32, in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _rows_per_program(rows: int, tuning: Tuning) -> int:
    """The largest power of two up to `tuning.rows_fwd` that divides `rows`: a decode step's one row
    (batch 1) is one program, where XLA's layer norm took three kernels (two reductions and the
    normalisation)."""
    return math.gcd(rows, tuning.rows_fwd)


def _columns(d: int):
    """Which of a row block's columns lie in the array (None where all do): the mask for its loads and
    stores, shaped (1, block)."""
    block = block_width(d)
    return None if d == block else jax.lax.broadcasted_iota(jnp.int32, (1, block), 1) < d


def _load(ref, valid):
    """A block (or a 1-d vector) as fp32, its masked tail read as 0."""
    if valid is None:
        return ref[...].astype(F32)
    return pltriton.load(ref, mask=valid if len(ref.shape) == 2 else valid[0], other=0).astype(F32)


def _store(ref, value, valid):
    value = value.astype(ref.dtype)
    if valid is None:
        ref[...] = value
    else:
        pltriton.store(ref, value, mask=valid if len(ref.shape) == 2 else valid[0])


def _fwd_kernel(x_ref, s_ref, b_ref, y_ref, mean_ref, rstd_ref, *, eps: float, d: int):
    valid = _columns(d)
    x = _load(x_ref, valid)
    mean = jnp.sum(x, axis=1, keepdims=True) / d
    xc = x - mean if valid is None else jnp.where(valid, x - mean, 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(xc * xc, axis=1, keepdims=True) / d + eps)
    _store(y_ref, xc * rstd * _load(s_ref, valid)[None, :] + _load(b_ref, valid)[None, :], valid)
    mean_ref[...] = mean[:, 0]
    rstd_ref[...] = rstd[:, 0]


def _bwd_kernel(x_ref, dy_ref, s_ref, mean_ref, rstd_ref, dx_ref, ds_ref, db_ref, *, d: int, steps: int,
                rows_per_step: int):
    valid = _columns(d)
    scale = _load(s_ref, valid)[None, :]

    def step(i, acc):
        ds, db = acc
        rows = pl.ds(i * rows_per_step, rows_per_step)
        x = _load(x_ref.at[rows, :], valid)
        dy = _load(dy_ref.at[rows, :], valid)
        xhat = (x - mean_ref[rows][:, None]) * rstd_ref[rows][:, None]  # masked columns meet dy = 0 below
        g = dy * scale
        c1 = jnp.sum(xhat * g, axis=1, keepdims=True) / d
        c2 = jnp.sum(g, axis=1, keepdims=True) / d
        _store(dx_ref.at[rows, :], (g - xhat * c1 - c2) * rstd_ref[rows][:, None], valid)
        return ds + jnp.sum(dy * xhat, axis=0), db + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((x_ref.shape[1],), F32)
    ds, db = jax.lax.fori_loop(0, steps, step, (zeros, zeros))
    _store(ds_ref, ds[None, :], valid)
    _store(db_ref, db[None, :], valid)


def _forward(x2, scale, bias, eps, tuning: Tuning, interpret: bool):
    rows, d = x2.shape
    block, per = block_width(d), _rows_per_program(rows, tuning)
    row_block = pl.BlockSpec((per, block), lambda i: (i, 0))
    vec = pl.BlockSpec((block,), lambda i: (0,))
    stat = pl.BlockSpec((per,), lambda i: (i,))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, eps=eps, d=d),
        grid=(rows // per,),
        in_specs=[row_block, vec, vec],
        out_specs=[row_block, stat, stat],
        out_shape=[jax.ShapeDtypeStruct((rows, d), x2.dtype), jax.ShapeDtypeStruct((rows,), F32),
                   jax.ShapeDtypeStruct((rows,), F32)],
        compiler_params=compiler_params(tuning.warps_fwd, interpret),
        interpret=interpret,
        name="fused_layer_norm_fwd",
    )(x2, scale, bias)


def _backward(x2, dy2, scale, mean, rstd, tuning: Tuning, interpret: bool):
    rows, d = x2.shape
    block = block_width(d)
    blocks = rows // tuning.rows_bwd
    programs = next(p for p in range(min(tuning.bwd_programs, blocks), 0, -1) if blocks % p == 0)
    per = rows // programs
    row_block = pl.BlockSpec((per, block), lambda i: (i, 0))
    stat = pl.BlockSpec((per,), lambda i: (i,))
    part = pl.BlockSpec((1, block), lambda i: (i, 0))
    dx, ds, db = pl.pallas_call(
        functools.partial(_bwd_kernel, d=d, steps=per // tuning.rows_bwd, rows_per_step=tuning.rows_bwd),
        grid=(programs,),
        in_specs=[row_block, row_block, pl.BlockSpec((block,), lambda i: (0,)), stat, stat],
        out_specs=[row_block, part, part],
        out_shape=[jax.ShapeDtypeStruct((rows, d), x2.dtype), jax.ShapeDtypeStruct((programs, d), F32),
                   jax.ShapeDtypeStruct((programs, d), F32)],
        compiler_params=compiler_params(tuning.warps_bwd, interpret),
        interpret=interpret,
        name="fused_layer_norm_bwd",
    )(x2, dy2, scale, mean, rstd)
    return dx, ds.sum(0), db.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fused_layer_norm(x, scale, bias, eps: float, tuning: Tuning = DEFAULT, interpret: bool = False):
    """Layer norm over the last dim (fp32 maths, x's dtype out) as one kernel each way.
    `interpret=True` runs the kernels in Pallas' interpreter, on any backend (for tests)."""
    return _fwd(x, scale, bias, eps, tuning, interpret)[0]


def _fwd(x, scale, bias, eps, tuning, interpret):
    d = x.shape[-1]
    y, mean, rstd = _forward(x.reshape(-1, d), scale, bias, eps, tuning, interpret)
    return y.reshape(x.shape), (x, scale, bias, mean, rstd)


def _bwd(eps, tuning, interpret, res, dy):
    x, scale, bias, mean, rstd = res
    d = x.shape[-1]
    dx, ds, db = _backward(x.reshape(-1, d), dy.reshape(-1, d), scale, mean, rstd, tuning, interpret)
    return dx.reshape(x.shape), ds.astype(scale.dtype), db.astype(bias.dtype)


fused_layer_norm.defvjp(_fwd, _bwd)


register("fused_norm", Tuning, DEFAULT, supported, fused_layer_norm, reference)
