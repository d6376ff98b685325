"""FP8 matrix products with per-tensor scales, written in the form XLA's GPU rewriter turns into cuBLASLt FP8 GEMMs.

A GEMM `einsum(spec, x, w)` in FP8: x and w are quantized (divided by their scale, clipped to the format's
range, converted to f8), then dequantized (converted back to the compute dtype, multiplied by the scalar scale)
right before the dot. XLA's GEMM rewriter on Hopper folds `convert(f8) * broadcast(scale) -> dot` into one
FP8 cuBLASLt call; on CPU the same program runs with XLA's emulated f8 types. The backward pass quantizes the
output gradient g the same way (e5m2 under `hybrid`, e4m3 under `e4m3`) and runs the two transposed dots on
the stored f8 operands, so the residuals kept from forward to backward are f8, half of bf16's bytes.

Scales are a parameter of the layer, one (3,) leaf per GEMM named `<gemm>_fp8`: the dequantizing multipliers of
x, w and g, computed by the train step from an amax history (jax3d.train.fp8). The "gradient" of that leaf is
not a gradient: it is the (3,) amaxes observed this call, |x|, |w| and |g| maxima. Summing it over micro-batches
would be wrong, so every accumulation of gradients takes their maximum instead (`accumulate`, and the pipeline
loop's `stats`).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

# (forward operands, output gradient) formats of each mode; float8_e4m3fn is e4m3 with no infinities, as on Hopper.
FORMATS = {"hybrid": (jnp.float8_e4m3fn, jnp.float8_e5m2), "e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn)}
SUFFIX = "_fp8"  # the name of a GEMM's scales parameter ends so: `qkv_fp8`, `down_fp8`
X, W, G = 0, 1, 2  # rows of a GEMM's scales, amaxes and amax history


def largest(f8) -> float:
    """The largest finite value of an f8 format (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(f8).max)


def quantize(a, scale, f8):
    """a / scale, clipped to the format's range, in f8 (computed in a's dtype)."""
    top = largest(f8)
    return jnp.clip(a / scale.astype(a.dtype), -top, top).astype(f8)


def dequantize(q, scale, dtype):
    """The pattern the GPU rewriter folds into an FP8 GEMM: convert, then multiply by a broadcast scalar."""
    return q.astype(dtype) * scale.astype(dtype)


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


def einsum(spec: str, x, w, scales=None, fmt: str = ""):
    """`jnp.einsum(spec, x, w)`, in FP8 when `scales` (from `scales_param`) is given."""
    if scales is None:
        return jnp.einsum(spec, x, w)
    return _fp8_einsum(spec, fmt, x, w, scales)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fp8_einsum(spec, fmt, x, w, scales):
    return _forward(spec, fmt, x, w, scales)[0]


def _forward(spec, fmt, x, w, scales):
    f8 = FORMATS[fmt][0]
    qx, qw = quantize(x, scales[X], f8), quantize(w, scales[W], f8)
    y = jnp.einsum(spec, dequantize(qx, scales[X], x.dtype), dequantize(qw, scales[W], w.dtype))
    return y, (qx, qw, scales, amax(x), amax(w))


def _backward(spec, fmt, res, g_y):
    qx, qw, scales, ax, aw = res
    dt = g_y.dtype
    q_g = quantize(g_y, scales[G], FORMATS[fmt][1])
    # The transposed dots, as autodiff writes them, of the dequantized f8 operands: both are FP8 GEMMs.
    _, pullback = jax.vjp(functools.partial(jnp.einsum, spec), dequantize(qx, scales[X], dt),
                          dequantize(qw, scales[W], dt))
    dx, dw = pullback(dequantize(q_g, scales[G], dt))
    observed = jnp.stack([ax.astype(scales.dtype), aw.astype(scales.dtype), amax(g_y).astype(scales.dtype)])
    return dx, dw, observed


_fp8_einsum.defvjp(_forward, _backward)


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
