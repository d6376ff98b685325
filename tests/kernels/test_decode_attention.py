"""jax3d.kernels.decode_attention (the decode step's attention kernel, which reads only the filled slots) in Pallas'
interpreter, against a softmax over the whole cache under generation's mask. Inside generation, against
transformers' greedy tokens: tests/inference/test_generate.py."""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.kernels import decode_attention
from jax3d.inference.cached_attention import join_qkv


def reference(q_bnh, k_bksh, v_bksh, start_b, index):
    """Softmax attention of one query row over every slot, masked as generation masks it."""
    g = q_bnh.shape[1] // k_bksh.shape[1]
    k, v = jnp.repeat(k_bksh, g, axis=1), jnp.repeat(v_bksh, g, axis=1)
    s = jnp.einsum("bnh,bnsh->bns", q_bnh, k) / math.sqrt(q_bnh.shape[-1])
    slot = jnp.arange(k.shape[2])[None]
    seen = ((slot >= start_b[:, None]) & (slot <= index)) | (slot == index)
    return jnp.einsum("bns,bnsh->bnh", jax.nn.softmax(jnp.where(seen[:, None], s, -jnp.inf), -1), v)


def packed(q_bnh, k_bkh, v_bkh):
    """The decode kernel's projection (batch, group + 2, kv_heads, head_dim) of one query row."""
    return join_qkv(q_bnh[:, None], k_bkh[:, None], v_bkh[:, None])[:, 0]


def test_join_qkv_is_what_split_qkv_splits():
    from jax3d.models.layers import split_qkv

    qkv = jax.random.normal(jax.random.key(4), (2, 3, 4 + 2, 2, 8))  # 4 query heads per KV head
    np.testing.assert_array_equal(join_qkv(*split_qkv(qkv)), qkv)


@pytest.mark.parametrize("heads, kv_heads, slots, block, parts", [(4, 4, 128, 64, 1), (8, 2, 96, 16, 1),
                                                                  (4, 4, 128, 16, 4), (8, 2, 96, 16, 8)],
                         ids=["mha", "gqa", "mha-4-parts", "gqa-8-parts"])
def test_kernel_equals_a_masked_softmax_over_the_whole_cache(heads, kv_heads, slots, block, parts):
    """The kernel writes the step's key and value at the query's slot, touching no other slot, and attends as a
    softmax over the whole updated cache under generation's mask does; with its slots split into parts (some
    of which see no slot, or only pads), too."""
    kq, kk, kv, kn = jax.random.split(jax.random.key(0), 4)
    b, h = 4, 32
    q = jax.random.normal(kq, (b, heads, h))
    k = jax.random.normal(kk, (b, kv_heads, slots, h))
    v = jax.random.normal(kv, (b, kv_heads, slots, h))
    k_new, v_new = jax.random.normal(kn, (2, b, kv_heads, h))
    tuning = decode_attention.Tuning(block=block, parts=parts)
    for index in (0, 5, block - 1, block, slots - 1):
        # a row from slot 0, a left-padded row, one whose walk begins in a later block, and a row whose first
        # token is past the query (a pad query)
        start = jnp.array([0, min(index, 7), min(index, block + 3), index + 1], jnp.int32)
        got, k_got, v_got = decode_attention.decode_attention(packed(q, k_new, v_new), k, v, start, jnp.int32(index),
                                                              tuning, interpret=True)
        k_want, v_want = k.at[:, :, index].set(k_new), v.at[:, :, index].set(v_new)
        np.testing.assert_array_equal(k_got, k_want)
        np.testing.assert_array_equal(v_got, v_want)
        np.testing.assert_allclose(got, reference(q, k_want, v_want, start, index), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn], ids=["bf16", "fp8"])
def test_a_narrower_cache_is_attended_as_it_keeps_the_new_key_and_value(dtype):
    """An fp32 key and value written into a bf16 or fp8 cache: the step attends over them as the cache keeps
    them (rounded; for fp8 clipped to 448 first), as every later step reads them back."""
    kq, kk, kn = jax.random.split(jax.random.key(1), 3)
    b, n, slots, h, index = 2, 4, 64, 32, 37
    q = jax.random.normal(kq, (b, n, h))
    k, v = jax.random.normal(kk, (2, b, n, slots, h)).astype(dtype)
    k_new, v_new = jax.random.normal(kn, (2, b, n, h))
    k_new = k_new.at[0, 1, 2].set(1000.0)  # past fp8's 448: stored as 448, not nan
    start = jnp.array([0, 9], jnp.int32)
    got, k_got, v_got = decode_attention.decode_attention(packed(q, k_new, v_new), k, v, start, jnp.int32(index),
                                                          decode_attention.Tuning(block=16), interpret=True)
    k_want = k.at[:, :, index].set(jnp.clip(k_new, -448, 448).astype(dtype) if dtype == jnp.float8_e4m3fn
                                   else k_new.astype(dtype))
    v_want = v.at[:, :, index].set(v_new.astype(dtype))
    np.testing.assert_array_equal(k_got, k_want)
    np.testing.assert_array_equal(v_got, v_want)
    want = reference(q, k_want.astype(jnp.float32), v_want.astype(jnp.float32), start, index)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_block_that_does_not_divide_the_cache_is_refused():
    from jax3d.kernels.policy import KernelPolicy

    cache = jnp.zeros((1, 1, 96, 8))
    every = decode_attention.Tuning(block=32)
    assert decode_attention.supported(cache, every)
    assert not decode_attention.supported(cache, decode_attention.Tuning(block=64))
    assert not KernelPolicy.resolve("gpu", 1, tunings=[every], off=["decode_attention"]).takes(
        "decode_attention", cache)  # left out
    # Triton's arrays are powers of two: a head of 80 (gpt-2.7b) runs XLA's attention
    assert not decode_attention.supported(jnp.zeros((1, 1, 96, 80)), every)


def test_a_small_batch_splits_each_rows_slots_to_keep_128_programs():
    """The default splits each row's slots into parts (a power of two) until there are 128 programs: gpt-1.3b's 16
    heads in 8 parts at batch 1, 4 at 2, 2 at 4 and whole from batch 8 (where each setting measured fastest);
    grouped-query attention counts query heads; `parts` sets them."""
    default = decode_attention.DEFAULT
    assert [default.parts_for(b * 16) for b in (1, 2, 3, 4, 8, 32)] == [8, 4, 4, 2, 1, 1]
    assert default.parts_for(1 * 32) == 4  # Llama-3.2-1B: 32 query heads over 8 KV heads
    assert decode_attention.Tuning(parts=2).parts_for(16) == 2
    with pytest.raises(ValueError, match="power of two"):
        decode_attention.Tuning(block=48)
    with pytest.raises(ValueError, match="power of two"):
        decode_attention.Tuning(parts=3)


@pytest.mark.parametrize("cache_dtype, parts", [(jnp.bfloat16, 1), (jnp.float8_e4m3fn, 1), (jnp.bfloat16, 8)],
                         ids=["bf16", "fp8", "bf16-8-parts"])
def test_the_kernel_lowers_to_one_named_triton_call_for_cuda(cache_dtype, parts):
    """What a GPU would compile, lowered on this CPU: the kernel's Pallas-to-Triton lowering at gpt-1.3b's decode
    shape (batch 32, 16 heads of 128, 384 slots, bf16; the cache bf16 or fp8; the slots in one part or 8) is
    one Triton custom call, named for the profiler."""
    b, n, h, slots = 32, 16, 128, 384
    qkv, cache = jax.ShapeDtypeStruct((b, 3, n, h), jnp.bfloat16), jax.ShapeDtypeStruct((b, n, slots, h), cache_dtype)
    args = (qkv, cache, cache, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
            decode_attention.Tuning(parts=parts))
    text = decode_attention.decode_attention.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    # the cache it writes is its last two outputs in the caches' own buffers (arguments 1 and 2), so a donated
    # cache is updated in place rather than copied for every layer and token
    operands = re.search(r"custom_call @__gpu\$xla\.gpu\.triton\(([^)]*)\)", text).group(1).split(", ")
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\], operand_index = (\d)", text)
    last = 1 if parts == 1 else 3
    assert {(int(out), operands[int(i)]) for out, i in aliases} == {(last, "%arg1"), (last + 1, "%arg2")}
    # the kernel's name in a device trace, which profile_decode classes as attention (unnamed, it was "_kernel")
    assert 'name = "decode_attention"' in text
    from benchmarks.profile_step import classify

    assert classify("decode_attention", "custom-call.3") == "attention"


def test_the_walks_pipeline_stages_reach_triton():
    """Tuning.stages is what the lowered Triton call is given; 0 leaves Triton's own (3)."""
    b, n, h, slots = 2, 4, 64, 128
    qkv, cache = jax.ShapeDtypeStruct((b, 3, n, h), jnp.bfloat16), jax.ShapeDtypeStruct((b, n, slots, h), jnp.bfloat16)
    args = (qkv, cache, cache, jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32))

    def stages(tuning):
        text = decode_attention.decode_attention.trace(*args, tuning).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"num_stages = (\d+)", text)

    assert stages(decode_attention.Tuning()) == ["3"]
    assert stages(decode_attention.Tuning(stages=1)) == ["1"]
    assert stages(decode_attention.Tuning(stages=4)) == ["4"]


@pytest.mark.parametrize("t", [1, 5], ids=["decode", "prefill"])
def test_an_fp8_cache_attends_as_an_fp32_cache_of_the_values_it_keeps(t):
    """XLA's attention (cached_attention) over a float8_e4m3fn cache: what an fp32 cache holding the same keys and
    values gives, with the new ones rounded to fp8 after clipping to e4m3's 448 (a key of 1000 is kept as 448;
    a plain cast would keep nan)."""
    from jax3d.inference.cached_attention import CachedOut, cached_attention
    from jax3d.parallel import ShardingRules

    b, n, kv_heads, h, slots, index, e = 2, 4, 2, 8, 32, 6, 16
    keys = jax.random.split(jax.random.key(2), 5)
    q = jax.random.normal(keys[0], (b, t, n, h))
    k_new, v_new = 3 * jax.random.normal(keys[1], (2, b, t, kv_heads, h))
    k_new = k_new.at[0, 0, 0, 0].set(1000.0)
    k8, v8 = jax.random.normal(keys[2], (2, b, kv_heads, slots, h)).astype(jnp.float8_e4m3fn)
    w_out = jax.random.normal(keys[3], (n, h, e))
    start = jnp.array([0, 2], jnp.int32)
    query = index + jnp.arange(t)
    mask = decode_attention.visible(jnp.arange(slots)[None, None], start[:, None, None], query[None, :, None])[:, None]
    rules = ShardingRules.create(False)

    def attend(k, v, k_new, v_new):
        cache = {"k": k, "v": v, "index": jnp.int32(index), "start": start}
        ctx, cache = cached_attention(q, k_new, v_new, mask, cache, rules)
        return CachedOut()(ctx, w_out, None, None, rules), cache

    out8, cache8 = attend(k8, v8, k_new, v_new)
    rounded = [jnp.clip(x, -448, 448).astype(jnp.float8_e4m3fn).astype(jnp.float32) for x in (k_new, v_new)]
    out32, cache32 = attend(k8.astype(jnp.float32), v8.astype(jnp.float32), *rounded)
    assert cache8["k"].dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(cache8["k"].astype(jnp.float32), cache32["k"])
    np.testing.assert_array_equal(cache8["v"].astype(jnp.float32), cache32["v"])
    assert float(cache8["k"][0, 0, index, 0].astype(jnp.float32)) == 448.0
    np.testing.assert_allclose(out8, out32, rtol=1e-6, atol=1e-6)
    assert np.isfinite(np.asarray(out8)).all()
