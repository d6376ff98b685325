"""jax3d.models.decode_row (decode's attention and out-projection for one row, one kernel) in Pallas'
interpreter, against a masked softmax over the whole cache and the out-projection of its context. Inside
generation, against transformers' greedy tokens: tests/test_generate.py."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.models import decode_row


def reference(q_nh, k_ksh, v_ksh, start, index, w_nhd):
    """The out-projection of one query row's softmax attention over every slot, masked as generation masks it."""
    g = q_nh.shape[0] // k_ksh.shape[0]
    k, v = jnp.repeat(k_ksh, g, axis=0), jnp.repeat(v_ksh, g, axis=0)
    s = jnp.einsum("nh,nsh->ns", q_nh, k) / math.sqrt(q_nh.shape[-1])
    slot = jnp.arange(k.shape[1])
    seen = ((slot >= start) & (slot <= index)) | (slot == index)
    ctx = jnp.einsum("ns,nsh->nh", jax.nn.softmax(jnp.where(seen[None], s, -jnp.inf), -1), v)
    return jnp.einsum("nh,nhd->d", ctx, w_nhd)


@pytest.mark.parametrize("heads, kv_heads, slots, block, cols", [(4, 4, 128, 64, 32), (8, 2, 96, 16, 16)],
                         ids=["mha", "gqa"])
def test_kernel_equals_the_projected_masked_softmax(heads, kv_heads, slots, block, cols):
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    h, d = 32, 64
    q = jax.random.normal(kq, (heads, h))
    k = jax.random.normal(kk, (kv_heads, slots, h))
    v = jax.random.normal(kv, (kv_heads, slots, h))
    w = jax.random.normal(kw, (heads, h, d)) / math.sqrt(heads * h)
    tuning = decode_row.Tuning(block=block, cols=cols)
    # a row from slot 0, a left-padded row, one whose walk begins in a later block, a pad query (its first
    # token past the query)
    for index, start in ((0, 0), (5, 0), (block - 1, 7), (block, block - 3), (slots - 1, block + 3), (9, 10)):
        got = decode_row.attend_and_project(q, k, v, jnp.int32(start), jnp.int32(index), w, tuning, interpret=True)
        np.testing.assert_allclose(got, reference(q, k, v, start, index, w), rtol=1e-5, atol=1e-5)


def test_what_it_takes(monkeypatch):
    monkeypatch.setattr(decode_row, "on_one_gpu", lambda rules: True)
    q1, q2 = jnp.zeros((1, 1, 4, 8)), jnp.zeros((2, 1, 4, 8))
    cache, w = jnp.zeros((1, 4, 96, 8)), jnp.zeros((4, 8, 64))
    t = decode_row.Tuning(block=32, cols=32)
    assert decode_row.supported(q1, cache, w, None, t)
    assert not decode_row.supported(q2, cache[:1].repeat(2, 0), w, None, t)  # more than one row
    assert not decode_row.supported(jnp.zeros((1, 2, 4, 8)), cache, w, None, t)  # prefill
    assert not decode_row.supported(q1, cache, w, None, decode_row.Tuning(block=64, cols=32))  # 96 slots
    assert not decode_row.supported(q1, cache, jnp.zeros((4, 8, 48)), None, t)  # width 48
    assert not decode_row.supported(q1, jnp.zeros((1, 4, 96, 80)), w, None, t)  # head of 80
    assert not decode_row.supported(q1, cache, w, None, None)  # off
    monkeypatch.setattr(decode_row, "on_one_gpu", lambda rules: False)
    assert not decode_row.supported(q1, cache, w, None, t)
    with pytest.raises(ValueError, match="power of two"):
        decode_row.Tuning(cols=48)


def test_the_kernel_lowers_to_one_triton_call_for_cuda():
    """Lowered on this CPU for a GPU at gpt-1.3b's decode shape (16 heads of 128, 384 slots, width 2048, bf16):
    one Triton custom call, then XLA's sum of the heads."""
    n, h, slots, d = 16, 128, 384, 2048
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((n, h), bf), jax.ShapeDtypeStruct((n, slots, h), bf),
            jax.ShapeDtypeStruct((n, slots, h), bf), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((n, h, d), bf))
    text = decode_row.attend_and_project.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
