"""A transformer block's parts, chosen once from the model's config, the run's kernel policy and the FP8 recipe,
as Megatron Core's ModuleSpec assembles a layer: `block_spec` picks them, and layers.Attention, MLP, Block and
LayerNorm call them in order, with no kernel, platform or precision test of their own.

The parts (each a plain function, or a small frozen dataclass holding its settings):

- `norm(x, scale, bias, eps)`: the layer norm (or RMSNorm, `bias` None), `lean_layer_norm` or fused_norm's kernel;
- `project(spec, x, w, scales)` with `project.scales(module, gemm)`: every GEMM of the block, plain or FP8;
- `split_qkv(qkv, bias, rules) -> (q, k, v, packed)`: the QKV projection's bias and split, plain or fused_qkv's
  kernel (`packed`: the projection q, k and v are plain slices of, None where they are not);
- `positions(q, k, packed, x, positions_bt) -> (q, k, packed)`: rotary embeddings, or none;
- `attend(q, k, v, packed, mask, rng, deterministic, causal, cache, rules) -> (ctx, cache)`: the attention core
  (cuDNN's or XLA's fused attention, softmax spelled out for attention dropout; generation's cached attention,
  jax3d.inference.cached_attention, in its decode spec);
- `out_project(ctx, w_out, scales, project, rules)`: the attention's output projection of the context;
- `mlp(h, b_up, w_down, s_down, project, rules)`: the MLP after its up-projection: the activation and the
  down-projection (without its bias), lean, FP8 or fused_gelu's kernel.

A kernel's part keeps its `supported` shape test (its registered one): where a call's shapes do not fit the
kernel's blocks it runs the plain part instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax3d import dropout_keys
from jax3d.config import ModelConfig
from jax3d.kernels import kernel
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import fp8, quantized, rope

QKV_AXES = ("batch", "seq", "qkv", "heads", "kv")


# ---- norm -------------------------------------------------------------------------------------------------------
def layer_norm(x, scale, bias, eps: float):
    """Layer norm over the last dim, computed in fp32 and returned in x's dtype; with `bias` None, RMSNorm
    (scaled by the root mean square, neither centred nor shifted)."""
    x32 = x.astype(jnp.float32)
    if bias is None:
        rstd = checkpoint_name(jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps), "ln_stats")
        return (x32 * rstd * scale.astype(jnp.float32)).astype(x.dtype)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    mean, rstd = checkpoint_name((mean, jax.lax.rsqrt(var + eps)), "ln_stats")
    y = (x32 - mean) * rstd
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


# For the backward pass, keeps the input and each token's mean and inverse deviation, and recomputes the
# elementwise normalisation: autodiff of the plain function keeps two fp32 intermediates of the whole
# activation alive from forward to backward (docs/performance.md).
lean_layer_norm = jax.checkpoint(layer_norm, static_argnums=(3,),
                                 policy=jax.checkpoint_policies.save_only_these_names("ln_stats"))


@dataclass(frozen=True)
class FusedNorm:
    """Layer norm as fused_norm's kernel each way, where the input's shape fits its blocks."""

    tuning: object

    def __call__(self, x, scale, bias, eps: float):
        if kernel("fused_norm").supported(x, self.tuning):
            return kernel("fused_norm").run(x, scale, bias, eps, self.tuning)
        return lean_layer_norm(x, scale, bias, eps)


# ---- projections ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Projection:
    """A block's GEMM `einsum(spec, x, w)` (a Quantized `w` too: generation's fp8 or row-stored weights)."""

    def scales(self, module, gemm: str):
        return None

    def __call__(self, spec: str, x, w, scales=None):
        return quantized.einsum(spec, x, w)


@dataclass(frozen=True)
class FP8Projection(Projection):
    """The GEMM in FP8 (`fmt` a jax3d.models.fp8.FORMATS key), each with its scales parameter; its operands
    quantized by fp8_cast's kernel where `cast` (its Tuning) is given."""

    fmt: str = "hybrid"
    cast: object = None

    def scales(self, module, gemm: str):
        return fp8.scales_param(module, self.fmt, gemm)

    def __call__(self, spec: str, x, w, scales=None):
        return fp8.einsum(spec, x, w, scales, self.fmt, self.cast)


# ---- the QKV projection's bias and split ------------------------------------------------------------------------
def _plus(x, b):
    return x if b is None else x + b


def split_qkv(qkv):
    """(q (batch, seq, heads, head_dim), k, v (batch, seq, kv_heads, head_dim)) of the projection (batch, seq,
    g + 2, kv_heads, head_dim), query heads in KV-head-major order (n = kv_head * g + j)."""
    b, t, c, kv, h = qkv.shape
    g = c - 2
    # (With g = 1 the plain slice, so that GPT's step is the program it was.)
    q = qkv[:, :, 0] if g == 1 else jnp.swapaxes(qkv[:, :, :g], 2, 3).reshape(b, t, kv * g, h)
    return q, qkv[:, :, g], qkv[:, :, g + 1]


def plain_split(qkv, bias, rules):
    # The bias is added before the constraint: after it, the one-GPU step compiled slower (docs/performance.md).
    packed = rules.constrain(_plus(qkv, bias), QKV_AXES)
    return (*split_qkv(packed), packed)


@dataclass(frozen=True)
class FusedSplit:
    """The bias and split as fused_qkv's kernel (its backward), where the projection's shape fits its blocks."""

    tuning: object

    def __call__(self, qkv, bias, rules):
        if not kernel("fused_qkv").supported(qkv, self.tuning):
            return plain_split(qkv, bias, rules)
        q, k, v = kernel("fused_qkv").run(rules.constrain(qkv, QKV_AXES), bias, self.tuning)
        return q, k, v, None


# ---- positions --------------------------------------------------------------------------------------------------
def no_positions(q, k, packed, x, positions_bt):
    return q, k, packed


@dataclass(frozen=True)
class Rotary:
    """Rotary embeddings of q and k at `positions_bt` (batch, seq; default 0, 1, ...)."""

    cfg: ModelConfig

    def __call__(self, q, k, packed, x, positions_bt):
        positions_bt = rope.positions_for(x) if positions_bt is None else positions_bt
        inv_freq = rope.inverse_frequencies(self.cfg)
        return rope.apply_rope(q, positions_bt, inv_freq), rope.apply_rope(k, positions_bt, inv_freq), None


# ---- the attention core -----------------------------------------------------------------------------------------
def xla_core(q, k, v, mask, causal):
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")


def cudnn_core(q, k, v, mask, causal):
    if mask is not None and mask.shape[-2] == 1:
        # cuDNN takes a mask as a bias over every (query, key) pair: a key-only (padding) mask is
        # broadcast over the queries, or the call is refused.
        mask = jnp.broadcast_to(mask, (*mask.shape[:-2], q.shape[1], mask.shape[-1]))
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")


_CORES = {"xla": xla_core, "cudnn": cudnn_core}


def cudnn_where_16_bit(q, k, v, mask, causal):
    """cuDNN's fused attention, which takes 16-bit inputs; XLA's for others (the compute dtype arrives with the
    parameters)."""
    return (cudnn_core if q.dtype in (jnp.bfloat16, jnp.float16) else xla_core)(q, k, v, mask, causal)


@dataclass(frozen=True)
class F16InFP32:
    """A core run in fp32 for fp16 inputs: XLA's attention asks for an f16 x f16 -> f32 dot, which the CPU has
    not."""

    core: Callable

    def __call__(self, q, k, v, mask, causal):
        if q.dtype != jnp.float16:
            return self.core(q, k, v, mask, causal)
        q32, k32, v32 = (a.astype(jnp.float32) for a in (q, k, v))
        return self.core(q32, k32, v32, mask, causal).astype(q.dtype)


def _dropout(x, rate: float, rng, deterministic: bool):
    if deterministic or rate == 0.0 or rng is None:
        return x
    keep = dropout_keys.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def softmax_with_dropout(q, k, v, mask, causal, rate: float, rng):
    """Attention with dropout on its probabilities: fused attention kernels take no dropout, so softmax is
    spelled out."""
    if k.shape[2] != q.shape[2]:  # grouped-query: each KV head serves its g query heads
        k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    logits = jnp.einsum("btnh,bsnh->bnts", q, k).astype(jnp.float32) * scale
    t = q.shape[1]
    if causal:
        logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -1e30)
    if mask is not None:
        logits = jnp.where(mask, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = _dropout(probs, rate, rng, False).astype(q.dtype)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


@dataclass(frozen=True)
class Attend:
    """Training's attention: `core` over q, k and v, or the spelled-out softmax where attention dropout is on
    (`rate`) and drawn this call; the context constrained to the heads' split. It keeps no cache: a block given
    one needs the decode spec (jax3d.inference.cached_attention.decode_spec)."""

    core: Callable
    rate: float = 0.0

    def __call__(self, q, k, v, packed, mask, rng, deterministic, causal, cache, rules):
        if cache is not None:
            raise ValueError("a KV cache was passed to a block built with training's spec; build it with "
                             "jax3d.inference.cached_attention.decode_spec to decode")
        if self.rate > 0 and not deterministic and rng is not None:
            ctx = softmax_with_dropout(q, k, v, mask, causal, self.rate, rng)
        else:
            ctx = self.core(q, k, v, mask, causal)
        return rules.constrain(ctx, ("batch", "seq", "heads", "kv")), cache


def out_project(ctx, w_out, scales, project, rules):
    return project("btnh,nhd->btd", ctx, w_out, scales)


# ---- the MLP after its up-projection ---------------------------------------------------------------------------
_ACTIVATIONS = {
    "gelu_tanh": lambda h: jax.nn.gelu(h, approximate=True),
    "gelu_erf": lambda h: jax.nn.gelu(h, approximate=False),
    "squared_relu": lambda h: jnp.square(jax.nn.relu(h)),
    "swiglu": lambda h_btcf: jax.nn.silu(h_btcf[:, :, 0]) * h_btcf[:, :, 1],  # (gate, up) on dim 2
}


def activation_of(cfg: ModelConfig) -> str:
    """The MLP's activation, a key of _ACTIVATIONS: SwiGLU where `cfg.swiglu`, else `cfg.activation`."""
    return "swiglu" if cfg.swiglu else cfg.activation


def _activate_then_dense(h, b, w_fd, activation: str):
    """act(h + b) @ w; `b` may be None. SwiGLU's h is (batch, seq, 2, ffn): the gate and the up projection."""
    g_btf = checkpoint_name(_ACTIVATIONS[activation](_plus(h, b)), "gelu_out")
    return quantized.einsum("btf,fd->btd", g_btf, w_fd)


# Keeps the GEMM's output h (the bias is re-added in the backward fusion, so h + b is never written) and
# GELU's output (what the two backward GEMMs read), none of the derivative's intermediates: the backward
# recomputes only GELU's derivative, inside the fusion that applies it. Keeping every intermediate, or
# recomputing GELU's output as well, traded memory and speed worse (docs/performance.md). SwiGLU keeps its gate
# and up projections and their product the same way.
_activate_then_dense_lean = jax.checkpoint(_activate_then_dense, static_argnums=(3,),
                                           policy=jax.checkpoint_policies.save_only_these_names("gelu_out"))


_activate_lean = jax.checkpoint(lambda h, b, activation: _ACTIVATIONS[activation](_plus(h, b)), static_argnums=(2,))


@dataclass(frozen=True)
class LeanMLP:
    """The activation and down-projection, keeping the activation's output (`_activate_then_dense_lean`)."""

    activation: str
    up_axes: tuple

    def __call__(self, h, b_up, w_down, s_down, project, rules):
        h = rules.constrain(h, ("batch", "seq", *self.up_axes))
        return _activate_then_dense_lean(h, b_up, w_down, self.activation)


@dataclass(frozen=True)
class FP8MLP(LeanMLP):
    """FP8: the down-projection keeps its input's f8 copy for its backward, and the activation only its own
    input h, its output recomputed there: no bf16 copy of that output is kept, nor re-quantized."""

    def __call__(self, h, b_up, w_down, s_down, project, rules):
        h = rules.constrain(h, ("batch", "seq", *self.up_axes))
        return project("btf,fd->btd", _activate_lean(h, b_up, self.activation), w_down, s_down)


@dataclass(frozen=True)
class FusedGeluMLP:
    """GELU (tanh form) of h + b as fused_gelu's kernel each way, then the down-projection, where h's shape fits
    the kernel's blocks (else `fallback`). Keeps h (inside the kernel's vjp) and GELU's output (the
    down-projection's input), as the lean part does."""

    tuning: object
    fallback: Callable

    def __call__(self, h, b_up, w_down, s_down, project, rules):
        if not kernel("fused_gelu").supported(h, self.tuning):
            return self.fallback(h, b_up, w_down, s_down, project, rules)
        return project("btf,fd->btd", kernel("fused_gelu").run(h, b_up, self.tuning), w_down, s_down)


# ---- the spec ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockSpec:
    """The parts a block calls (see the module's docstring)."""

    norm: Callable
    project: Projection
    split_qkv: Callable
    positions: Callable
    attend: Callable
    out_project: Callable
    mlp: Callable


def attention_core(cfg: ModelConfig, kernels: KernelPolicy) -> Callable:
    """The fused attention: `cfg.attention_impl` where the config names one, else the policy's; on a CPU with
    fp16 inputs computed in fp32."""
    if cfg.attention_impl not in ("auto", *_CORES):
        raise ValueError(f"attention_impl {cfg.attention_impl!r} must be auto, xla or cudnn")
    if cfg.attention_impl != "auto":
        core = _CORES[cfg.attention_impl]
    else:
        core = cudnn_where_16_bit if kernels.attention == "cudnn" else xla_core
    return F16InFP32(core) if kernels.platform == "cpu" else core


def block_spec(cfg: ModelConfig, kernels: KernelPolicy | None = None, fp8_format: str = "") -> BlockSpec:
    """The parts of `cfg`'s blocks under the run's `kernels` (None: no kernel, the default backend's attention)
    and FP8 format (`fp8_format`, "" for none)."""
    kernels = kernels if kernels is not None else KernelPolicy.none()
    biased = cfg.add_bias_linear
    rms = cfg.normalization == "rmsnorm"
    up_axes = (None, "mlp") if cfg.swiglu else ("mlp",)
    activation = activation_of(cfg)
    if fp8_format and fp8_format not in fp8.FORMATS:
        raise ValueError(f"FP8 format {fp8_format!r} must be one of {sorted(fp8.FORMATS)}")
    mlp = (FP8MLP if fp8_format else LeanMLP)(activation, up_axes)
    if activation == "gelu_tanh" and biased and kernels.uses("fused_gelu"):
        mlp = FusedGeluMLP(kernels.tuning("fused_gelu"), mlp)
    return BlockSpec(
        norm=FusedNorm(kernels.tuning("fused_norm")) if kernels.uses("fused_norm") and not rms else lean_layer_norm,
        project=FP8Projection(fp8_format, kernels.tuning("fp8_cast")) if fp8_format else Projection(),
        split_qkv=FusedSplit(kernels.tuning("fused_qkv")) if biased and kernels.uses("fused_qkv") else plain_split,
        positions=Rotary(cfg) if cfg.use_rotary_position_embeddings else no_positions,
        attend=Attend(attention_core(cfg, kernels), cfg.attention_dropout),
        out_project=out_project,
        mlp=mlp,
    )
