"""The MLP's gelu(h + b), tanh form, as Pallas (Triton) kernels forward and backward, for one GPU.

XLA fuses gelu(h + b) into one kernel each way, but computes it op by op in the input's dtype (bf16), and those
fusions moved fewer bytes a second than these kernels (docs/performance.md, "Kernel notes").
The forward kernel reads h once and writes gelu(h + b); the backward kernel reads h and the incoming
gradient once, writes h's gradient, and leaves per-program partial sums of the bias gradient, which
XLA adds up (a few MB). The maths is fp32 inside, in the exact identity 0.5 * (1 + tanh(u)) =
sigmoid(2u): one exponential per element, and no cancellation in the negative tail, where the tanh
form's 1 + tanh(u) loses every digit.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import check_powers_of_two, compiler_params, fields

F32 = jnp.float32
_C = math.sqrt(2 / math.pi)  # the tanh form: u = C * (z + A z^3)
_A = 0.044715


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Block shapes and warps (powers of two). Forward programs take a (rows_fwd, cols_fwd) tile; backward
    programs walk rows_per_program rows of a cols_bwd-wide strip, rows_bwd at a time, summing the bias
    gradient as they go. In the 1.3B step these defaults tied with the best of a sweep
    (docs/performance.md); `benchmarks.throughput --tune fused_gelu:FIELD=V` times others in the step."""

    cols_fwd: int = 1024
    rows_fwd: int = 4
    warps_fwd: int = 4
    cols_bwd: int = 1024
    rows_bwd: int = 4
    rows_per_program: int = 128
    warps_bwd: int = 4

    def __post_init__(self):
        check_powers_of_two(self, *fields(self))
        if self.rows_per_program < self.rows_bwd:
            raise ValueError(f"fused_gelu.{self}: rows_per_program must be at least rows_bwd")

    def fits(self, rows: int, f: int) -> bool:
        """Whether a non-empty [rows, f] input splits into whole blocks."""
        return rows > 0 and f > 0 and not (f % self.cols_fwd or f % self.cols_bwd or rows % self.rows_fwd
                                           or rows % self.rows_per_program)


DEFAULT = Tuning()


def supported(h, tuning: Tuning = DEFAULT) -> bool:
    """Whether `gelu_bias` takes this input: in whole blocks of rows and columns."""
    f = h.shape[-1]
    return f > 0 and tuning.fits(h.size // f, f)


def reference(h, b):
    """What `gelu_bias` computes, in plain JAX."""
    return jax.nn.gelu(h + b.astype(h.dtype), approximate=True)


def _sigmoid_2u(z, z2):
    """sigmoid(2u) = 0.5 * (1 + tanh(u)), u = C (z + A z^3); z2 is z * z."""
    return 1.0 / (1.0 + jnp.exp(-2.0 * _C * z * (1.0 + _A * z2)))


def _fwd_kernel(h_ref, b_ref, g_ref):
    z = h_ref[...].astype(F32) + b_ref[...].astype(F32)[None, :]
    g_ref[...] = (z * _sigmoid_2u(z, z * z)).astype(g_ref.dtype)


def _bwd_kernel(h_ref, b_ref, dg_ref, dh_ref, db_ref, *, steps: int, rows_per_step: int):
    b = b_ref[...].astype(F32)[None, :]

    def step(i, db):
        rows = pl.ds(i * rows_per_step, rows_per_step)
        z = h_ref[rows, :].astype(F32) + b
        z2 = z * z
        s = _sigmoid_2u(z, z2)
        du = _C * (1.0 + 3.0 * _A * z2)  # du/dz
        # d/dz [z * sigmoid(2u)] = s + z * 2 s (1 - s) du
        dh = dg_ref[rows, :].astype(F32) * (s + 2.0 * z * s * (1.0 - s) * du)
        dh_ref[rows, :] = dh.astype(dh_ref.dtype)
        return db + jnp.sum(dh, axis=0)

    db = jax.lax.fori_loop(0, steps, step, jnp.zeros((db_ref.shape[1],), F32))
    db_ref[...] = db[None, :]


def _forward(h2, b, tuning: Tuning, interpret: bool):
    rows, f = h2.shape
    if b.shape != (f,):
        raise ValueError(f"gelu_bias: the bias has shape {b.shape}; it must be ({f},), one per column of h")
    if not tuning.fits(rows, f):
        raise ValueError(f"gelu_bias: a [{rows}, {f}] input does not split into the blocks of {tuning}; "
                         "see fused_gelu.supported")
    tile = pl.BlockSpec((tuning.rows_fwd, tuning.cols_fwd), lambda i, j: (i, j))
    return pl.pallas_call(
        _fwd_kernel,
        grid=(rows // tuning.rows_fwd, f // tuning.cols_fwd),
        in_specs=[tile, pl.BlockSpec((tuning.cols_fwd,), lambda i, j: (j,))],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((rows, f), h2.dtype),
        compiler_params=compiler_params(tuning.warps_fwd, interpret),
        interpret=interpret,
        name="fused_gelu_fwd",
    )(h2, b)


def _backward(h2, b, dg2, tuning: Tuning, interpret: bool):
    rows, f = h2.shape
    strip_rows, cols = tuning.rows_per_program, tuning.cols_bwd
    strip = pl.BlockSpec((strip_rows, cols), lambda i, j: (i, j))
    dh, db = pl.pallas_call(
        functools.partial(_bwd_kernel, steps=strip_rows // tuning.rows_bwd, rows_per_step=tuning.rows_bwd),
        grid=(rows // strip_rows, f // cols),
        in_specs=[strip, pl.BlockSpec((cols,), lambda i, j: (j,)), strip],
        out_specs=[strip, pl.BlockSpec((1, cols), lambda i, j: (i, j))],
        out_shape=[jax.ShapeDtypeStruct((rows, f), h2.dtype), jax.ShapeDtypeStruct((rows // strip_rows, f), F32)],
        compiler_params=compiler_params(tuning.warps_bwd, interpret),
        interpret=interpret,
        name="fused_gelu_bwd",
    )(h2, b, dg2)
    return dh, db.sum(0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gelu_bias(h, b, tuning: Tuning = DEFAULT, interpret: bool = False):
    """gelu(h + b), tanh form, b one value per column of h (fp32 maths, h's dtype out, no promotion to
    b's), as one kernel each way. Reverse-mode only (a custom vjp). Keeps only h and b for the backward
    pass. `interpret=True` runs the kernels in Pallas' interpreter, on any backend (for tests)."""
    return _fwd(h, b, tuning, interpret)[0]


def _fwd(h, b, tuning, interpret):
    f = h.shape[-1]
    return _forward(h.reshape(-1, f), b, tuning, interpret).reshape(h.shape), (h, b)


def _bwd(tuning, interpret, res, dg):
    h, b = res
    f = h.shape[-1]
    dh, db = _backward(h.reshape(-1, f), b, dg.reshape(-1, f), tuning, interpret)
    return dh.reshape(h.shape), db.astype(b.dtype)


gelu_bias.defvjp(_fwd, _bwd)


register("fused_gelu", Tuning, DEFAULT, supported, gelu_bias, reference)
