"""The fused layer-norm kernels (run in Pallas' interpreter on CPU) against the model's XLA layer norm:
the same output and the same gradients for x, scale and bias."""
import jax
import jax.numpy as jnp
import pytest

from jax3d.kernels import fused_norm
from jax3d.models.layers import layer_norm
from tests.helpers import rel_err


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows_bwd, programs", [(1, 1024), (2, 4)])
@pytest.mark.parametrize("width", [256, 192])  # 192: a masked block of 256
def test_fused_layer_norm_matches_xla(dtype, tol, rows_bwd, programs, width):
    tuning = fused_norm.Tuning(rows_bwd=rows_bwd, bwd_programs=programs)
    k = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(k[0], (2, 32, width)) * 3 + 1).astype(dtype)
    scale = (1 + 0.1 * jax.random.normal(k[1], (width,))).astype(dtype)
    bias = (0.1 * jax.random.normal(k[2], (width,))).astype(dtype)
    dy = jax.random.normal(k[3], x.shape)

    def loss(norm):
        return lambda x, s, b: jnp.sum(norm(x, s, b).astype(jnp.float32) * dy)

    def fused_fn(x, s, b):
        return fused_norm.fused_layer_norm(x, s, b, 1e-5, tuning, True)

    fused = jax.jit(jax.value_and_grad(loss(fused_fn), argnums=(0, 1, 2)))(x, scale, bias)
    ref = jax.jit(jax.value_and_grad(loss(lambda x, s, b: layer_norm(x, s, b, 1e-5)),
                                     argnums=(0, 1, 2)))(x, scale, bias)
    y_fused = fused_fn(x, scale, bias)
    assert y_fused.dtype == dtype
    assert rel_err(y_fused, layer_norm(x, scale, bias, 1e-5)) < tol
    for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(ref)):
        assert a.dtype == b.dtype
        assert rel_err(a, b) < tol


def test_gpt_with_fused_norms_matches_xla_norms(monkeypatch):
    """The whole model, its layer norms through the kernels, against the same model without them (as on a
    CPU): the same loss and gradients in fp32."""
    from jax3d.models import GPT
    from tests.helpers import (assert_same_loss_and_grads, gpt_loss_and_grads, interpreted, only, random_text,
                               tiny_model)

    cfg = tiny_model(vocab_size=384, num_layers=2, num_attention_heads=4)
    params = GPT(cfg).init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, cfg.vocab_size)

    def loss_and_grads(cfg, kernels=None):
        return gpt_loss_and_grads(cfg, params, {"text": text}, kernels)

    ref_loss, ref_grads = loss_and_grads(cfg)
    calls = interpreted(monkeypatch, "fused_norm", fits=True)  # the kernels in Pallas' interpreter, counted
    loss, grads = loss_and_grads(cfg, only("fused_norm", fused_norm.DEFAULT))
    assert len(calls) == 2 * cfg.num_layers + 1, "not every layer norm went through the kernels"
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_the_forward_takes_rows_that_its_row_block_does_not_divide(rows):
    """One row (a decode step at batch 1) and odd rows run in programs of fewer rows (the largest power of two
    dividing them), with the same output as XLA's layer norm; `supported` no longer refuses them."""
    tuning = fused_norm.Tuning(rows_fwd=4)
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (rows, 1, 256)) * 3 + 1
    scale, bias = 1 + 0.1 * jax.random.normal(k[1], (256,)), 0.1 * jax.random.normal(k[2], (256,))
    assert fused_norm._rows_per_program(rows, tuning) == {1: 1, 3: 1, 6: 2}[rows]
    y = fused_norm.fused_layer_norm(x, scale, bias, 1e-5, tuning, True)
    assert rel_err(y, layer_norm(x, scale, bias, 1e-5)) < 1e-6
