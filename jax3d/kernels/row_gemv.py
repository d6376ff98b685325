"""A product of one row with a weight stored as rows (jax3d.models.quantized.Quantized), with the layer norm
before it and the bias, activation and residual add after it, as one Pallas (Triton) kernel: generation's
decode at batch 1 on one GPU (jax3d.inference.decode_rows).

At batch 1 a decode step is a chain of small dependent kernels. Compiled for an H100 without one, XLA ran each
GPT block as 11: the layer norm, the QKV reduction, its bias, the attention, the parts' combination, the
out-projection's reduction, its bias with the residual add, the second layer norm, the up reduction, its bias
with GELU, the down reduction and its bias with the residual add. In that compile XLA fused no consumer into a
reduction and no layer norm into one; each kernel waits for the one before, and the weights are read in four.
Here each GEMM is one kernel with what comes before and after it, and a GPT block is six: the layer norm and
QKV with its bias; the attention; the combination of its parts; the out-projection with its bias and the
residual add; the layer norm and up with its bias and GELU; down with its bias and the residual add: about half
the kernels of a decode step, and faster than XLA's blocks, so it is on by default in one GPU's kernel policy
(DEFAULT; docs/decode.md, docs/performance.md "Kernel notes"). `benchmarks.profile_decode --batch 1 --off row_gemv`
runs XLA's blocks to compare.

Each program computes `rows` outputs: it walks the contracted dim in blocks, each a (rows, block) tile of the
weight (each output's weights are contiguous, so the tile's rows are too) times the same block of the input
row, normalised as it is read when there is a layer norm (its statistics taken first, in two passes over the
row, as layers.layer_norm does). The rounding follows the unfused path: the normalised row rounded to the
input's dtype, the product to it, then the bias add, the activation and the residual add each rounded to it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.models import quantized
from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import check_powers_of_two, compiler_params
from jax3d.models.quantized import Quantized

F32 = jnp.float32
ACTIVATIONS = ("gelu_tanh", "swiglu")  # swiglu: the weight's outputs are (gate, up), each half of them


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Outputs per program (at most), the contracted dim's block, warps per program, the fewest programs to aim
    for (a weight with fewer than `rows * programs` outputs gets fewer rows a program, a power of two), and the
    software-pipeline stages of a program's walk over the contracted dim (0: Triton's default). `rows` and
    `programs` are for 2-byte weights (bf16); 1-byte ones (fp8) get twice the rows on half the programs, the
    same bytes a program (4-byte ones, never timed on a GPU, get the 2-byte settings)."""

    # The fastest of the settings timed at gpt-1.3b batch 1 on an H100 (docs/decode.md, docs/performance.md
    # "Kernel notes"); fp8 weights keep 8 rows on 512 programs, 16 KB a program either way.
    # benchmarks.profile_decode --tune row_gemv:FIELD=V tries others.
    rows: int = 4
    block: int = 2048
    warps: int = 8
    programs: int = 1024
    stages: int = 0  # Triton's default; 1, 2 and 4 timed the same (at 16 rows)

    def __post_init__(self):
        check_powers_of_two(self, "rows", "block", "warps", "programs")
        if self.rows < 2 or self.block < 16 or self.stages < 0:
            raise ValueError(f"row_gemv.{self}: rows must be at least 2, block at least 16 and stages at least 0")

    def rows_for(self, n: int, itemsize: int = 2) -> int:
        """The outputs a program computes of `n`, for weights of `itemsize` bytes: a power of two dividing n, at
        most `rows` (twice that for 1-byte weights), and small enough that there are `programs` programs (half
        that for 1-byte weights) where n allows; 0 if no power of two from 2 up divides n."""
        per = 2 if itemsize == 1 else 1
        most, programs = self.rows * per, max(1, self.programs // per)
        r = 1
        while r < most and n % (2 * r) == 0 and n // (2 * r) >= min(programs, n // 2):
            r *= 2
        return r if r > 1 else 0

    def block_for(self, k: int) -> int:
        """The contracted dim's block: the largest power of two up to `block` that divides k; 0 below 16."""
        b = self.block
        while b >= 16 and k % b:
            b //= 2
        return b if b >= 16 else 0


# On in one GPU's kernel policy (module docstring); `--off row_gemv` in benchmarks.profile_decode,
# benchmarks.generate_speed and benchmarks.gpu_compile, or a KernelPolicy resolved with off=["row_gemv"], runs
# XLA's blocks instead.
DEFAULT = Tuning()


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Norm:
    """A layer norm to apply to the row first: its scale, its bias (None: RMSNorm) and epsilon."""

    scale: jax.Array
    bias: jax.Array | None
    eps: float = dataclasses.field(metadata=dict(static=True))


def supported(size: int, w, tuning: Tuning = DEFAULT, activation=None) -> bool:
    """Whether `row_gemv` takes this product: one row of `size` elements of a Quantized `w`, a contracted dim
    and an output count its blocks divide."""
    if not isinstance(w, Quantized) or activation not in (None, *ACTIVATIONS):
        return False
    k, n, _ = _sizes(w, activation)
    return size == k and tuning.block_for(k) > 0 and tuning.rows_for(n, w.values.dtype.itemsize) > 0


def _sizes(w: Quantized, activation) -> tuple[int, int, int]:
    """(contracted size, outputs, halves) of a product with `w`: SwiGLU's outputs are half the weight's columns."""
    k = math.prod(w.values.shape[w.values.ndim - len(w.contracted):])
    halves = 2 if activation == "swiglu" else 1
    return k, w.values.size // k // halves, halves


def _round(y, dtype):
    return y.astype(dtype).astype(F32)


def _activate(y_c, activation, dtype):
    """The activation of the (halves, rows) products, in fp32 (SwiGLU's gate rounded before its product, as the
    unfused path rounds it); the caller rounds the result."""
    if activation == "gelu_tanh":
        y = y_c[0]
        return 0.5 * y * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y * y * y)))
    if activation == "swiglu":
        gate = y_c[0]
        return _round(gate * jax.nn.sigmoid(gate), dtype) * y_c[1]
    return y_c[0]


def _kernel(*refs, rows: int, block: int, k: int, halves: int, norm: str, eps: float, scaled: bool,
            biased: bool, residual: bool, activation, dtype):
    refs = list(refs)
    x_ref = refs.pop(0)
    g_ref = refs.pop(0) if norm else None
    nb_ref = refs.pop(0) if norm == "layer" else None
    w_ref = refs.pop(0)
    s_ref = refs.pop(0) if scaled else None
    b_ref = refs.pop(0) if biased else None
    r_ref = refs.pop(0) if residual else None
    (o_ref,) = refs
    steps = k // block
    out = pl.ds(pl.multiple_of(pl.program_id(0) * rows, rows), rows)

    def at(j):
        return pl.ds(pl.multiple_of(j * block, block), block)

    mean, rstd = jnp.float32(0.0), jnp.float32(1.0)
    if norm == "layer":
        mean = jax.lax.fori_loop(0, steps, lambda j, s: s + jnp.sum(x_ref[at(j)].astype(F32)), jnp.float32(0.0)) / k
        var = jax.lax.fori_loop(0, steps, lambda j, s: s + jnp.sum(jnp.square(x_ref[at(j)].astype(F32) - mean)),
                                jnp.float32(0.0)) / k
        rstd = jax.lax.rsqrt(var + eps)
    elif norm == "rms":
        ms = jax.lax.fori_loop(0, steps, lambda j, s: s + jnp.sum(jnp.square(x_ref[at(j)].astype(F32))),
                               jnp.float32(0.0)) / k
        rstd = jax.lax.rsqrt(ms + eps)

    def step(j, acc):
        x = x_ref[at(j)].astype(F32)
        if norm:
            x = (x - mean) * rstd * g_ref[at(j)].astype(F32)
            if nb_ref is not None:
                x = x + nb_ref[at(j)].astype(F32)
            x = _round(x, dtype)
        return tuple(a + jnp.sum(w_ref[c, out, at(j)].astype(F32) * x[None, :], axis=1) for c, a in enumerate(acc))

    acc = jax.lax.fori_loop(0, steps, step, tuple(jnp.zeros((rows,), F32) for _ in range(halves)))
    y_c = []
    for c, y in enumerate(acc):
        if scaled:
            y = y * s_ref[c, out].astype(F32)
        y = _round(y, dtype)
        if biased:
            y = _round(y + b_ref[c, out].astype(F32), dtype)
        y_c.append(y)
    y = _round(_activate(y_c, activation, dtype), dtype)
    if residual:
        y = r_ref[out].astype(F32) + y
    o_ref[out] = y.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("activation", "tuning", "interpret"))
def row_gemv(x, w: Quantized, norm: Norm | None = None, bias=None, activation=None, residual=None,
             tuning: Tuning = Tuning(), interpret: bool = False):
    """activation(layer_norm(x) @ w + bias) + residual, flat (the weight's output columns, or for "swiglu" those of
    one half), in x's dtype: `x` one row (any shape of the weight's contracted size), `w` Quantized (with or
    without a scale), `norm` a Norm or None, `bias` the output columns' shape or None, `residual` the output's
    size or None. `row_gemv_reference` is the same in plain JAX. `interpret=True` runs Pallas' interpreter, on
    any backend (for tests)."""
    k, n, halves = _sizes(w, activation)
    rows, block = tuning.rows_for(n, w.values.dtype.itemsize), tuning.block_for(k)
    if not rows or not block:
        raise ValueError(f"row_gemv: {n} outputs or a contracted dim of {k} does not fit {tuning}")
    dtype = x.dtype
    args = [x.reshape(k)]
    kind = ""
    if norm is not None:
        kind = "rms" if norm.bias is None else "layer"
        args += [norm.scale.reshape(k)] + ([] if norm.bias is None else [norm.bias.reshape(k)])
    args.append(w.values.reshape(halves, n, k))
    if w.scale is not None:
        args.append(w.scale.reshape(halves, n))
    if bias is not None:
        args.append(bias.reshape(halves, n))
    if residual is not None:
        args.append(residual.reshape(n))
    kernel = functools.partial(_kernel, rows=rows, block=block, k=k, halves=halves, norm=kind,
                               eps=float(norm.eps) if norm is not None else 0.0, scaled=w.scale is not None,
                               biased=bias is not None, residual=residual is not None, activation=activation,
                               dtype=dtype)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n,), dtype),
        grid=(n // rows,),
        compiler_params=compiler_params(tuning.warps, interpret, tuning.stages),
        interpret=interpret,
        name="row_gemv",
    )(*args)


def row_gemv_reference(x, w: Quantized, norm: Norm | None = None, bias=None, activation=None, residual=None):
    """`row_gemv` as the unfused path computes it, from its own functions (spec.layer_norm, quantized.dot, the
    spec's activations): what the kernel is tested against."""
    from jax3d.models import spec as layers  # the model's parts: for the reference only, not the kernel's import

    contracted = len(w.contracted)
    if norm is not None:
        x = layers.layer_norm(x, norm.scale, norm.bias, norm.eps)
    x = x.reshape(w.values.shape[w.values.ndim - contracted:])
    y = quantized.dot(lambda a, b: jnp.tensordot(a, b, (tuple(range(contracted)), w.contracted)), x, w)
    if bias is not None:
        y = y + bias
    if activation == "swiglu":
        y = layers._ACTIVATIONS["swiglu"](y.reshape(1, 1, 2, -1))
    elif activation is not None:
        y = layers._ACTIVATIONS[activation](y)
    y = y.reshape(-1)
    return y if residual is None else residual.reshape(-1) + y


register("row_gemv", Tuning, DEFAULT, supported, row_gemv, row_gemv_reference)
