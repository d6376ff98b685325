"""Decode's attention and out-projection for a single row (generation at batch 1) as one Pallas (Triton) kernel.

At batch 1 a decode step reads its weights at about the copy rate but for the attention's out-projection:
XLA's GEMM of one row by gpt-1.3b's 2048 x 2048 weight took 9.8-10.3 us on an H100 where its 8 MB need
about 3.5, whatever its operand's form or split (docs/decode.md, benchmarks/gemv_probe.py), and a Pallas
GEMV read it in 6.2. That GEMV lost in decode because its operand, the attention's context, then had to be
an array of its own: the softmax and the context sum, which XLA had fused into its GEMM, became kernels.
So here the kernel computes the context itself. One program per (query head, strip of `cols` output
columns) walks the head's filled cache slots with an online softmax, as jax3d.models.decode_attention does,
and multiplies the head's context (head_dim) by the head's rows of the out-projection weight in its strip;
XLA adds the heads' partial sums (fused with the bias and the residual add that follow). A head's filled
keys and values are read by each of its strips' programs, the first from memory and the rest from L2: at
gpt-1.3b with 256-column strips, 8 reads of up to 3 MB a layer from L2 beside the weight's 8 MB from memory.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.models.decode_attention import visible
from jax3d.models.pallas_gpu import check_powers_of_two, compiler_params, on_one_gpu
from jax3d.parallel.rules import ShardingRules


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Cache slots per step of the walk (a power of two that divides the cache's slots), output columns per
    program (a power of two that divides the model's width), warps per program."""

    block: int = 64
    cols: int = 256
    warps: int = 4

    def __post_init__(self):
        check_powers_of_two(self, "block", "cols", "warps")


DEFAULT = Tuning()


def supported(q_btnh, k_bksh, w_nhd, rules: ShardingRules, tuning: Tuning | None) -> bool:
    """Whether `attend_and_project` takes this step: one query row of one batch row, on one GPU, the slots in
    whole blocks, the width in whole strips, a power-of-two head size (never with `tuning` None: off)."""
    b, t = q_btnh.shape[:2]
    slots, h = k_bksh.shape[2], k_bksh.shape[3]
    return (tuning is not None and b * t == 1 and on_one_gpu(rules) and slots % tuning.block == 0
            and w_nhd.shape[-1] % tuning.cols == 0 and h & (h - 1) == 0)


def _kernel(start_ref, index_ref, q_ref, k_ref, v_ref, w_ref, o_ref, *, block: int, cols: int, group: int,
            scale: float):
    head, strip = pl.program_id(0), pl.program_id(1)
    kv = head // group
    start, index = start_ref[0], index_ref[0]
    q = q_ref[head, :].astype(jnp.float32) * scale  # (head_dim,)

    def step(j, carry):
        m, l, acc = carry
        at = pl.ds(pl.multiple_of(j * block, block), block)
        k = k_ref[kv, at, :].astype(jnp.float32)  # (block, head_dim)
        v = v_ref[kv, at, :].astype(jnp.float32)
        s = jnp.sum(k * q[None, :], axis=1)  # (block,)
        seen = visible(j * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0), start, index)
        s = jnp.where(seen, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s))
        p = jnp.where(seen, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(p), acc * alpha + jnp.sum(p[:, None] * v, axis=0)

    h = q.shape[0]
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((h,), jnp.float32))
    # The first block holds a seen slot (the row's first token, or the query's own), so m is finite after it.
    _, l, acc = jax.lax.fori_loop(jnp.minimum(start, index) // block, index // block + 1, step, init)
    # The context in the cache's dtype, as XLA's attention hands it to the out-projection.
    ctx = (acc / l).astype(v_ref.dtype).astype(jnp.float32)
    w = w_ref[head, :, pl.ds(pl.multiple_of(strip * cols, cols), cols)].astype(jnp.float32)  # (head_dim, cols)
    o_ref[head, pl.ds(pl.multiple_of(strip * cols, cols), cols)] = jnp.sum(ctx[:, None] * w, axis=0)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def attend_and_project(q_nh, k_ksh, v_ksh, start, index, w_nhd, tuning: Tuning = Tuning(),
                       interpret: bool = False):
    """(embed,) in `w_nhd`'s dtype: the out-projection `w_nhd` (heads, head_dim, embed) of one query row's
    context (`q_nh`: heads, head_dim) over the cache `k_ksh`, `v_ksh` (kv_heads, slots, head_dim), softmax in
    fp32 over the slots from `start` to `index` (the query's own slot) and always slot `index` (both int32
    scalars). `interpret=True` runs it in Pallas' interpreter, on any backend (for tests)."""
    n, h = q_nh.shape
    kv, slots = k_ksh.shape[:2]
    d = w_nhd.shape[-1]
    if slots % tuning.block or d % tuning.cols:
        raise ValueError(f"{tuning} does not divide a cache of {slots} slots and a width of {d}")
    kernel = functools.partial(_kernel, block=tuning.block, cols=tuning.cols, group=n // kv,
                               scale=1.0 / math.sqrt(h))
    partial = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, d), jnp.float32),
        grid=(n, d // tuning.cols),
        compiler_params=compiler_params(tuning.warps, interpret),
        interpret=interpret,
    )(jnp.reshape(start, (1,)).astype(jnp.int32), jnp.reshape(index, (1,)).astype(jnp.int32), q_nh, k_ksh, v_ksh,
      w_nhd)
    return jnp.sum(partial, axis=0).astype(w_nhd.dtype)
