"""FP8 matrix products with per-tensor scales: dots of f8 arrays, which XLA's GPU compiler runs as FP8 GEMMs.

A GEMM `einsum(spec, x, w)` in FP8: x and w are quantized (divided by their scale, clipped to the format's
range, converted to f8), the dot takes the f8 arrays themselves (accumulating in f32, giving the compute
dtype), and its output is multiplied by the product of the two scales. On Hopper XLA runs such a dot as a
cuBLASLt FP8 GEMM (the scale multiply folded into it) or a Triton GEMM with f8 operands; on CPU the same
program runs with XLA's emulated f8 types. Dequantizing first (convert, scale, then a bf16 dot) is the older
pattern the GEMM rewriter matched; this XLA compiles it to a bf16 GEMM unless Triton GEMMs are off, and the
step had no FP8 GEMM at all (docs/performance.md, FP8). The backward pass quantizes the output gradient g the same
way (e5m2 under `hybrid`, e4m3 under `e4m3`) and runs the two transposed dots on the stored f8 operands, so
the residuals kept from forward to backward are f8, half of bf16's bytes.

Scales are powers of two (jax3d.parallel.precision.Recipe), so quantizing divides exactly and the product of two scales is
exact in bf16: scaling the bf16 output equals scaling inside the GEMM.

Scales are a parameter of the layer, one (3,) leaf per GEMM named `<gemm>_fp8`: the dequantizing multipliers of
x, w and g, computed by the train step from an amax history (jax3d.parallel.precision.Recipe). The "gradient" of that leaf is
not a gradient: it is the (3,) amaxes observed this call, |x|, |w| and |g| maxima. Summing it over micro-batches
would be wrong, so every accumulation of gradients takes their maximum instead (`accumulate`, and the pipeline
loop's `stats`).
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax3d.kernels import fp8_cast, kernel
from jax3d.kernels.fp8_cast import quantize
from jax3d.models import quantized
from jax3d.parallel.precision import FP8_FORMATS

# (forward operands, output gradient) formats of each mode; float8_e4m3fn is e4m3 with no infinities, as on Hopper.
FORMATS = FP8_FORMATS  # the precision policy's table: the GEMMs quantize to what the recipe's scales are for
SUFFIX = "_fp8"  # the name of a GEMM's scales parameter ends so: `qkv_fp8`, `down_fp8`
X, W, G = 0, 1, 2  # rows of a GEMM's scales, amaxes and amax history


def amax(a):
    return jnp.max(jnp.abs(a))


def scales_param(module: nn.Module, fmt: str, gemm: str):
    """The (3,) scales of one GEMM of `module` when FP8 is on (`fmt` a FORMATS key), else None. Declared after
    the module's weights, so they take the same initialisation keys as without FP8."""
    if not fmt:
        return None
    if fmt not in FORMATS:
        raise ValueError(f"FP8 format {fmt!r} must be one of {sorted(FORMATS)}")
    return module.param(gemm + SUFFIX, nn.with_logical_partitioning(nn.initializers.ones, (None,)), (3,),
                        jnp.float32)


def einsum(spec: str, x, w, scales=None, fmt: str = "", cast=None):
    """`jnp.einsum(spec, x, w)`, in FP8 when `scales` (from `scales_param`) is given. With `cast` (the fp8_cast
    kernel's Tuning, where the kernel policy runs it: jax3d.kernels.fp8_cast), the operands are quantized in both
    layouts by that kernel where their shapes fit its tiles."""
    if scales is None:
        return quantized.einsum(spec, x, w)
    layout = _layout(spec)
    if cast is not None and layout is not None and _fits(layout, x.shape, w.shape):
        t, k, n = _sizes(layout, x.shape, w.shape)
        if all(kernel("fp8_cast").supported(shape, cast) for shape in ((t, k), (k, n), (t, n))):
            return _fp8_tn(layout, fmt, cast, x, w, scales)
    return _fp8_einsum(spec, fmt, x, w, scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_einsum(spec, fmt, x, w, scales):
    return _forward(spec, fmt, x, w, scales)[0]


def scaled_dot(spec: str, a, b, scale_a, scale_b, dtype):
    """`einsum(spec, a, b)` of two f8 arrays, accumulated in f32 and given in `dtype`, times scale_a * scale_b."""
    y = jnp.einsum(spec, a, b, preferred_element_type=dtype)
    return y * (scale_a * scale_b).astype(dtype)


def _transposed(spec: str) -> tuple[str, str]:
    """The specs of a GEMM's input gradients: "x,w->y" gives ("y,w->x", "x,y->w")."""
    ins, y = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    return f"{y},{w}->{x}", f"{x},{y}->{w}"


def _forward(spec, fmt, x, w, scales):
    f8 = FORMATS[fmt][0]
    qx, qw = quantize(x, scales[X], f8), quantize(w, scales[W], f8)
    y = scaled_dot(spec, qx, qw, scales[X], scales[W], x.dtype)
    return y, (qx, qw, scales, amax(x), amax(w))


def _backward(spec, fmt, res, g_y):
    qx, qw, scales, ax, aw = res
    dt = g_y.dtype
    q_g = quantize(g_y, scales[G], FORMATS[fmt][1])
    for_x, for_w = _transposed(spec)  # both FP8 GEMMs: e5m2 x e4m3 under hybrid
    dx = scaled_dot(for_x, q_g, qw, scales[G], scales[W], dt)
    dw = scaled_dot(for_w, qx, q_g, scales[X], scales[G], dt)
    observed = jnp.stack([ax.astype(scales.dtype), aw.astype(scales.dtype), amax(g_y).astype(scales.dtype)])
    return dx, dw, observed


_fp8_einsum.defvjp(_forward, _backward)


# ---- the same GEMM with every operand quantized in both layouts (jax3d.kernels.fp8_cast) -----------------------------
def _layout(spec: str) -> tuple[int, int, int] | None:
    """(batch dims of x, contracted dims, w's output dims) of a spec "x,w->y" whose x is its batch dims then
    the contracted ones, w the contracted ones then its outputs, y x's batch dims then w's outputs (every GEMM
    of the blocks: "btd,dcnh->btcnh"), each dimension named once; None for another. Such a GEMM is
    (T, K) x (K, N) -> (T, N) on reshapes that move no data."""
    ins, y = spec.replace(" ", "").split("->")
    x, w = ins.split(",")
    if not (x + w).isalpha() or len(set(x)) < len(x) or len(set(w)) < len(w):
        return None
    contracted = "".join(c for c in x if c in w)
    nb, nc = len(x) - len(contracted), len(contracted)
    if x[nb:] != contracted or w[:nc] != contracted or y != x[:nb] + w[nc:]:
        return None
    return nb, nc, len(w) - nc


def _fits(layout, x_shape, w_shape) -> bool:
    """Whether x and w have the spec's dimensions, the contracted ones of equal sizes (else the einsum says
    what is wrong)."""
    nb, nc, no = layout
    return len(x_shape) == nb + nc and len(w_shape) == nc + no and tuple(x_shape[nb:]) == tuple(w_shape[:nc])


def _sizes(layout, x_shape, w_shape) -> tuple[int, int, int]:
    """(T, K, N) of the GEMM's 2-D view."""
    nb, nc, _ = layout
    return math.prod(x_shape[:nb]), math.prod(x_shape[nb:]), math.prod(w_shape[nc:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fp8_tn(layout, fmt, tuning, x, w, scales):
    return _tn_forward(layout, fmt, tuning, x, w, scales)[0]


def _tn_forward(layout, fmt, tuning, x, w, scales):
    # Every dot takes both operands with the contracted dimension minor, as Hopper's FP8 GEMMs do, so XLA
    # transposes nothing: x (T, K) and w transposed (N, K) here, the transposes kept for the backward.
    nb, nc, _ = layout
    t, k, n = _sizes(layout, x.shape, w.shape)
    f8 = FORMATS[fmt][0]
    qx, qx_t, ax = fp8_cast.cast_transpose(x.reshape(t, k), scales[X], f8, tuning)
    qw, qw_t, aw = fp8_cast.cast_transpose(w.reshape(k, n), scales[W], f8, tuning)
    y = scaled_dot("tk,nk->tn", qx, qw_t, scales[X], scales[W], x.dtype)
    return y.reshape(x.shape[:nb] + w.shape[nc:]), (qx_t, qw.reshape(w.shape), scales, ax, aw)


def _tn_backward(layout, fmt, tuning, res, g_y):
    qx_t, qw, scales, ax, aw = res  # x transposed (K, T); w in its own shape
    nb, nc, _ = layout
    dt = g_y.dtype
    t, n = math.prod(g_y.shape[:nb]), math.prod(g_y.shape[nb:])
    k = qx_t.shape[0]
    q_g, q_g_t, ag = fp8_cast.cast_transpose(g_y.reshape(t, n), scales[G], FORMATS[fmt][1], tuning)
    dx = scaled_dot("tn,kn->tk", q_g, qw.reshape(k, n), scales[G], scales[W], dt)
    dw = scaled_dot("kt,nt->kn", qx_t, q_g_t, scales[X], scales[G], dt)
    observed = jnp.stack([ax, aw, ag]).astype(scales.dtype)
    return dx.reshape(g_y.shape[:nb] + qw.shape[:nc]), dw.reshape(qw.shape), observed


_fp8_tn.defvjp(_tn_forward, _tn_backward)


# ---- the scales leaves in a parameter tree -----------------------------------------------------------------------
def _key(entry) -> str:
    return str(getattr(entry, "key", getattr(entry, "name", entry)))


def is_scales(path) -> bool:
    """Whether a tree path (jax.tree_util) leads to a GEMM's scales (whose gradient is an amax, max-reduced)."""
    return bool(path) and _key(path[-1]).endswith(SUFFIX)


def stat_mask(tree):
    """A tree like `tree`: True on the scales leaves, whose "gradients" are maxima, not sums."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_scales(p), tree)


def accumulate(acc, g):
    """Gradients summed leaf by leaf, except the scales' amaxes, which take their maximum."""
    return jax.tree_util.tree_map_with_path(lambda p, a, b: jnp.maximum(a, b) if is_scales(p) else a + b, acc, g)


def split(tree: dict) -> tuple[dict, dict]:
    """(the tree without its scales leaves, the scales leaves alone), both nested as `tree`; empty dicts dropped."""
    rest, scales = {}, {}
    for k, v in tree.items():
        if isinstance(v, dict):
            r, s = split(v)
            if r:
                rest[k] = r
            if s:
                scales[k] = s
        elif str(k).endswith(SUFFIX):
            scales[k] = v
        else:
            rest[k] = v
    return rest, scales


def merge(tree: dict, scales: dict) -> dict:
    """`split`'s inverse: `tree` with the `scales` leaves put back in."""
    out = dict(tree)
    for k, v in scales.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out
