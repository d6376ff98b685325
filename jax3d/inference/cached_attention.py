"""Attention of generation's queries over a KV cache (jax3d.inference.generate): the parts of a block's decode
spec (`decode_spec`), which layers.Block runs with a cache.

The cache is laid out (batch, kv_heads, max_len, head_dim): (batch, KV head) major, each head's slots and
dims contiguous. With the slots before the heads (the projection's order, as before), XLA transposed the
whole cache for every layer and token to feed its batched dots: a copy of all of it per step. Grouped-query
heads are a dimension of the query, so a KV head is read once for its g query heads. A decode step (one
query row) is products and sums rather than dots, so the compiler has no layout of its own to ask for.

Where the run's kernel policy has it (one GPU), a decode step runs jax3d.kernels.decode_attention, one Pallas kernel
that reads only the filled slots, when the cache carries the rows' first slots (`cache['start']`, as generation's
does). cuDNN (`jax.nn.dot_product_attention(implementation='cudnn')`) takes decode's one query row only with its
mask as a bias over every (query, key) pair, and wants the slots before the heads; Pallas' own GPU decode kernel
(`jax.experimental.pallas.ops.gpu.decode_attention`) swaps the cache's axes on every call. Elsewhere the sums here
read every slot of the cache, filled or not: a small share of a step's bytes at batch 1 and about half at large
batches (docs/performance.md). The mask is two iotas and compares, which XLA fuses into the softmax.

The cache may be kept in float8_e4m3fn where the model computes in bf16 or fp32 (Generator's `cache_dtype`):
half the bytes a decode step reads of it, and twice the rows in the same memory. Keys and values are stored
as they come, clipped to e4m3's largest value (448) rather than scaled, and read back in the compute dtype.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from jax3d.config import ModelConfig
from jax3d.inference import one_row
from jax3d.kernels import decode_attention, kernel
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import quantized
from jax3d.models.spec import BlockSpec, Projection, block_spec

CACHE_AXES = ("batch", "heads", "seq", "kv")

visible = decode_attention.visible  # which cached slots a query sees; generation's mask is built from it
stored = decode_attention.stored  # a key or value as the cache keeps it


def join_qkv(q_btnh, k_btkh, v_btkh):
    """The projection (batch, seq, group + 2, kv_heads, head_dim) that layers.split_qkv splits into these."""
    b, t, n, h = q_btnh.shape
    kv = k_btkh.shape[2]
    q_btgkh = jnp.swapaxes(q_btnh.reshape(b, t, kv, n // kv, h), 2, 3)
    return jnp.concatenate([q_btgkh, k_btkh[:, :, None], v_btkh[:, :, None]], axis=2)


def cached_attention(q_btnh, k_btkh, v_btkh, mask_b1tT, cache: dict, rules, qkv_btckh=None, tuning=None):
    """(context (batch, seq, kv_heads, group, head_dim), updated cache): the keys and values written at slot
    `cache['index']` of `cache['k']`, `cache['v']` (batch, kv_heads, max_len, head_dim), in place when the cache is
    donated; the queries' softmax, in fp32, over the slots `mask_b1tT` (batch, 1, seq, max_len) allows (`CachedOut`
    projects the context). With `cache['start']` (batch,), the rows' first slots, a decode step's mask must be
    `visible`'s of them: where the decode kernel runs (`tuning`, its Tuning where the kernel policy runs it), it
    builds the mask from them rather than reading `mask_b1tT`. `qkv_btckh` is the projection (batch, seq, group + 2,
    kv_heads, head_dim) when q, k and v are its plain slices (layers.split_qkv; not so after a rotary embedding):
    the decode kernel reads it as it lies."""
    idx = cache["index"]
    b, t, n, h = q_btnh.shape
    kv = k_btkh.shape[2]
    g = n // kv
    # Query head n is KV head n // g's (layers.split_qkv's order).
    if tuning is not None and t == 1 and "start" in cache and kernel("decode_attention").supported(cache["k"], tuning):
        # The projection itself where q, k and v are slices of it: joined again, XLA kept them as a copy
        # (three at batch 1). Rotated q and k are joined in one kernel.
        qkv_bckh = (qkv_btckh if qkv_btckh is not None else join_qkv(q_btnh, k_btkh, v_btkh))[:, 0]
        ctx_bnh, k_bksh, v_bksh = kernel("decode_attention").run(qkv_bckh, cache["k"], cache["v"], cache["start"],
                                                                 idx, tuning)
        return ctx_bnh.reshape(b, 1, kv, g, h), _kept(k_bksh, v_bksh, cache)
    k_btkh, v_btkh = stored(k_btkh, cache["k"].dtype), stored(v_btkh, cache["v"].dtype)

    def write(c, new_btkh):
        c = jax.lax.dynamic_update_slice_in_dim(c, jnp.swapaxes(new_btkh, 1, 2), idx, axis=2)
        return rules.constrain(c, CACHE_AXES)

    k_bksh, v_bksh = write(cache["k"], k_btkh), write(cache["v"], v_btkh)
    q_bkgth = jnp.transpose(q_btnh.reshape(b, t, kv, g, h), (0, 2, 3, 1, 4))
    if t == 1:
        # Decode: products and sums, not dots. A dot of one query row lets the compiler pick the cache's layout
        # for it, and XLA on the CPU copied the cache transposed for every token at batch 1; a reduction reads
        # it where it lies, in one pass.
        scores = jnp.sum(q_bkgth.astype(jnp.float32) * k_bksh[:, :, None].astype(jnp.float32), axis=-1)[:, :, :, None]
    else:
        scores = jnp.einsum("bkgth,bksh->bkgts", q_bkgth, k_bksh.astype(q_bkgth.dtype),
                            preferred_element_type=jnp.float32)
    scores = jnp.where(mask_b1tT[:, :, None], scores / math.sqrt(h), -jnp.inf)  # each query sees itself at least
    probs = jax.nn.softmax(scores, axis=-1)
    if t == 1:
        ctx_bkgth = jnp.sum(probs[:, :, :, 0, :, None] * v_bksh[:, :, None].astype(jnp.float32), axis=-2,
                            keepdims=True).astype(q_btnh.dtype)
    else:
        ctx_bkgth = jnp.einsum("bkgts,bksh->bkgth", probs.astype(q_btnh.dtype), v_bksh.astype(q_btnh.dtype))
    ctx_btkgh = jnp.transpose(ctx_bkgth, (0, 3, 1, 2, 4))  # t = 1: a bitcast
    return ctx_btkgh, _kept(k_bksh, v_bksh, cache)


@dataclasses.dataclass(frozen=True)
class CachedOut:
    """The decode spec's `out_project`: the out-projection of the context (batch, seq, kv_heads, group,
    head_dim); a one-row call on the row twice where `row_twice` (a GPU's: jax3d.inference.one_row)."""

    row_twice: bool = False

    def __call__(self, ctx_btkgh, w_out_nhd, scales, project, rules):
        kv, g, h = ctx_btkgh.shape[2:]
        ctx_btkgh = rules.constrain(ctx_btkgh, ("batch", "seq", "heads", None, "kv"))

        # dot_general with the contracting dims in memory order: jnp.einsum lists them reversed, and XLA on the
        # CPU then copied the (heads, head_dim, embed) weight transposed on every token.
        def dot(c_btkgh, w_nhd):
            return jax.lax.dot_general(c_btkgh, w_nhd.reshape(kv, g, h, -1), (((2, 3, 4), (0, 1, 2)), ((), ())))
        product = functools.partial(quantized.dot, dot)
        return one_row.gemm(product, ctx_btkgh, w_out_nhd) if self.row_twice else product(ctx_btkgh, w_out_nhd)


def _kept(k_bksh, v_bksh, cache):
    return {"k": k_bksh, "v": v_bksh, **{key: cache[key] for key in ("index", "start") if key in cache}}


@dataclasses.dataclass(frozen=True)
class CachedAttend:
    """The decode spec's `attend`: `cached_attention`, with the decode kernel's Tuning where the policy runs it."""

    tuning: object = None

    def __call__(self, q, k, v, packed, mask, rng, deterministic, causal, cache, rules):
        # The mask carries causality and the row's padding.
        return cached_attention(q, k, v, mask, cache, rules, packed, self.tuning)


@dataclasses.dataclass(frozen=True)
class OneRowProjection(Projection):
    """The plain GEMM, a one-row call on the row repeated twice (jax3d.inference.one_row: a GPU's rewrite)."""

    def __call__(self, spec: str, x, w, scales=None):
        return one_row.gemm(functools.partial(quantized.einsum, spec), x, w)  # the block's x: (batch, seq, ...)


def decode_spec(cfg: ModelConfig, kernels: KernelPolicy) -> BlockSpec:
    """The parts of generation's blocks: training's without FP8 (`block_spec`), attending over a KV cache; a
    one-row GEMM on the row twice on a GPU."""
    spec, on_gpu = block_spec(cfg, kernels), kernels.platform == "gpu"
    return dataclasses.replace(spec, project=OneRowProjection() if on_gpu else spec.project,
                               attend=CachedAttend(kernels.tuning("decode_attention")), out_project=CachedOut(on_gpu))
