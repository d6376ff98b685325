"""A decode step's attention over the KV cache as one Pallas (Triton) kernel that reads only the filled slots.

XLA's attention for one query row (jax3d.inference.cached_attention) reads every slot of the cache, filled or
not, in a few kernels (scores, softmax, context). At batch 32 of 128 + 256 tokens the cache is 2.4 GB of
bf16 against 2.6 GB of weights, and the filled part averages two thirds of it. Here one program per (row,
query head) walks the row's slots in blocks from its first token's block to the block of the slot being
decoded, with an online softmax (running max and sum) in fp32, so the bytes read are the filled blocks' and
the three steps are one kernel. It also writes the step's key and value into the cache (aliased, so in
place): as XLA's own updates they were two more kernels a layer. A KV head's slots are read once per query
head of its group (grouped-query attention): the other heads' programs find them in L2.

At a small batch each row's slots are split into parts, each walked by a program of its own (`Tuning`), so
that there are enough programs to keep the GPU's memory busy.

The slots a row's query sees are `visible`'s: from the row's first token (`start`) up to the
query's own slot, and always its own slot. Pallas' Triton lowering takes arrays whose sizes are powers of two,
so the head size must be one (64 and 128 are; gpt-2.7b's 80 is not, and runs XLA's attention).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.kernels import register
from jax3d.kernels.pallas_gpu import block_width, check_powers_of_two, compiler_params


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Slots per step of the walk (a power of two that divides the cache's slots), warps per program, the fewest
    programs to aim for, the parts each row's slots are split into (0: the fewest, a power of two, that
    make up `programs`), and the walk's software-pipeline stages (0: Triton's default)."""

    block: int = 64
    warps: int = 4
    # One program per (row, query head) walks its row's slots, so a small batch left most of the GPU idle (at
    # gpt-1.3b's 16 heads, batch 1 is 16 programs) and ran slower than XLA's attention. With fewer (row, query
    # head) pairs than `programs`, each row's slots are split into parts (a power of two), one program each, and
    # the parts' sums combined after the kernel (docs/performance.md, "Kernel notes").
    programs: int = 128
    parts: int = 0
    stages: int = 0

    def __post_init__(self):
        check_powers_of_two(self, "block", "warps", "programs")
        if self.parts:
            check_powers_of_two(self, "parts")

    def parts_for(self, pairs: int) -> int:
        """The parts each row's slots are split into, for `pairs` (row, query head) pairs."""
        return self.parts or block_width(-(-self.programs // pairs))


DEFAULT = Tuning()


def supported(k_bksh, tuning: Tuning = DEFAULT) -> bool:
    """Whether `decode_attention` takes this cache: the slots in whole blocks, a power-of-two head size."""
    slots, h = k_bksh.shape[2], k_bksh.shape[3]
    return slots % tuning.block == 0 and h & (h - 1) == 0


def visible(slot, start, query):
    """Whether the query at cache slot `query` sees the key at `slot`, in a row whose first token is at slot
    `start`: from `start` up to the query, and always the query's own slot (a pad query, before `start`, would
    otherwise softmax over nothing). Arrays broadcast; generation's mask (cached_attention.visible) and this
    kernel both use it."""
    return ((slot >= start) & (slot <= query)) | (slot == query)


def stored(x, dtype):
    """`x` as the cache keeps it in `dtype`: rounded, and for float8 first clipped to its largest value (a
    plain cast would give nan past it). XLA's attention and this kernel both store through it."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8:
        big = float(jnp.finfo(dtype).max)
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def _kernel(start_ref, index_ref, qkv_ref, k_ref, v_ref, *out_refs, block: int, group: int, scale: float,
            parts: int):
    row, head = pl.program_id(0), pl.program_id(1)
    part = pl.program_id(2) if parts > 1 else 0
    kv = head // group
    start, index = start_ref[row], index_ref[0]
    q = qkv_ref[row, head % group, kv, :].astype(jnp.float32) * scale  # (head_dim,)
    k_out_ref, v_out_ref = out_refs[-2:]
    # As the cache keeps them, so this step sees what later steps will read back.
    k_new = stored(qkv_ref[row, group, kv, :], k_out_ref.dtype)
    v_new = stored(qkv_ref[row, group + 1, kv, :], v_out_ref.dtype)

    @pl.when((head % group == 0) & (part == 0))  # one program of the KV head's group writes its key and value
    def _():
        k_out_ref[row, kv, index, :] = k_new
        v_out_ref[row, kv, index, :] = v_new

    def step(j, carry):
        m, l, acc = carry
        at = pl.ds(pl.multiple_of(j * block, block), block)
        k = k_ref[row, kv, at, :].astype(jnp.float32)  # (block, head_dim)
        v = v_ref[row, kv, at, :].astype(jnp.float32)
        s = jnp.sum(k * q[None, :], axis=1)  # (block,)
        slot = j * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
        seen = visible(slot, start, index) & (slot < index)  # the query's own slot is the walk's start
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(p), acc * alpha + jnp.sum(p[:, None] * v, axis=0)

    # The walk starts from the query's own slot, which it always sees, with the key and value in hand (the
    # slot in the cache may not be written yet), so m is finite throughout; then the slots before it, from the
    # row's first token's block, in `parts` runs of whole blocks, one a part. Parts after the first start
    # from m far below any score, so their own slot weighs nothing: it is 0 after the first block they see,
    # and their sums are 0 in the combination if they see none (_combined).
    own = jnp.sum(k_new.astype(jnp.float32) * q)
    init = (own if parts == 1 else jnp.where(part == 0, own, _NOTHING), jnp.float32(1.0), v_new.astype(jnp.float32))
    first = jnp.minimum(start, index) // block
    end = (index + block - 1) // block
    per = (end - first + parts - 1) // parts
    lo = first + part * per
    m, l, acc = jax.lax.fori_loop(lo, jnp.minimum(lo + per, end), step, init)
    if parts == 1:
        o_ref = out_refs[0]
        o_ref[row, head, :] = (acc / l).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs[:3]
        acc_ref[row, head, part, :] = acc
        m_ref[row, head, pl.ds(part, 1)] = jnp.full((1,), m)
        l_ref[row, head, pl.ds(part, 1)] = jnp.full((1,), l)


_NOTHING = -1e30  # a split's running max before it sees a slot: exp(score - it) is 0 for any real score


def _combined(acc_bnsh, m_bns, l_bns, dtype):
    """The context from the parts' running sums: each rescaled to the largest running max of its row's head."""
    w = jnp.exp(m_bns - jnp.max(m_bns, axis=-1, keepdims=True))
    return (jnp.sum(w[..., None] * acc_bnsh, axis=2) / jnp.sum(w * l_bns, axis=-1)[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def decode_attention(qkv_bckh, k_bksh, v_bksh, start_b, index, tuning: Tuning = Tuning(), interpret: bool = False):
    """(context (batch, heads, head_dim), k cache, v cache) of a decode step's projection `qkv_bckh` (batch,
    group + 2, kv_heads, head_dim): query head kv_head * group + j at [:, j, kv_head], the key at [:, group]
    and the value at [:, group + 1], as layers.split_qkv reads the projection (so GPT's projection is passed
    as it lies: sliced, XLA's q, k and v were three more kernels a layer at batch 1). The key and value are
    written (`stored`) at slot `index` of the cache `k_bksh`, `v_bksh` (batch, kv_heads, slots, head_dim), in
    place where the caller donates it; and each query row attends, softmax(q k / sqrt(head_dim)) v, over the
    slots from `start_b` (batch,) to `index` (the query's own slot, a scalar), and always slot `index`. The
    write is the kernel's: as XLA's own update it was two more kernels a layer, each reading the projection.
    The slots must be a multiple of `tuning.block`. `interpret=True` runs it in Pallas' interpreter, on any
    backend (for tests)."""
    b, c, kv, h = qkv_bckh.shape
    slots, group = k_bksh.shape[2], c - 2
    n = kv * group
    if slots % tuning.block:
        raise ValueError(f"a cache of {slots} slots is not a multiple of {tuning}'s block")
    parts = tuning.parts_for(b * n)
    kernel = functools.partial(_kernel, block=tuning.block, group=group, scale=1.0 / math.sqrt(h), parts=parts)
    f32 = jnp.float32
    outs = ((jax.ShapeDtypeStruct((b, n, h), qkv_bckh.dtype),) if parts == 1 else
            (jax.ShapeDtypeStruct((b, n, parts, h), f32), jax.ShapeDtypeStruct((b, n, parts), f32),
             jax.ShapeDtypeStruct((b, n, parts), f32)))
    cache = (jax.ShapeDtypeStruct(k_bksh.shape, k_bksh.dtype), jax.ShapeDtypeStruct(v_bksh.shape, v_bksh.dtype))
    *sums, k_bksh, v_bksh = pl.pallas_call(
        kernel,
        out_shape=(*outs, *cache),
        grid=(b, n) if parts == 1 else (b, n, parts),
        input_output_aliases={3: len(outs), 4: len(outs) + 1},  # the cache, updated where it lies
        compiler_params=compiler_params(tuning.warps, interpret, tuning.stages),
        interpret=interpret,
        name="decode_attention",  # the kernel's name in a device trace (profile_decode classes it as attention)
    )(start_b.astype(jnp.int32), jnp.reshape(index, (1,)).astype(jnp.int32), qkv_bckh, k_bksh, v_bksh)
    ctx = sums[0] if parts == 1 else _combined(*sums, qkv_bckh.dtype)
    return ctx, k_bksh, v_bksh


def reference(qkv_bckh, k_bksh, v_bksh, start_b, index):
    """What `decode_attention` computes, in plain JAX: (context (batch, heads, head_dim), k cache, v cache)."""
    c = qkv_bckh.shape[1]
    group = c - 2
    b, _, kv, h = qkv_bckh.shape
    q_bnh = jnp.swapaxes(qkv_bckh[:, :group], 1, 2).reshape(b, kv * group, h)
    put = lambda cache, new_bkh: jax.lax.dynamic_update_slice_in_dim(
        cache, stored(new_bkh, cache.dtype)[:, :, None], index, axis=2)
    k_bksh, v_bksh = put(k_bksh, qkv_bckh[:, group]), put(v_bksh, qkv_bckh[:, group + 1])
    k, v = (jnp.repeat(a, group, axis=1).astype(jnp.float32) for a in (k_bksh, v_bksh))
    s = jnp.einsum("bnh,bnsh->bns", q_bnh.astype(jnp.float32), k) / math.sqrt(h)
    slot = jnp.arange(k.shape[2])[None, None]
    s = jnp.where(visible(slot, start_b[:, None, None], index), s, -jnp.inf)
    ctx = jnp.einsum("bns,bnsh->bnh", jax.nn.softmax(s, -1), v).astype(qkv_bckh.dtype)
    return ctx, k_bksh, v_bksh


register("decode_attention", Tuning, DEFAULT, supported, decode_attention, reference)
