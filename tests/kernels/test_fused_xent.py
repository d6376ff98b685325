"""The fused cross-entropy kernel (run in Pallas' interpreter on CPU) against the model's XLA loss: the same
per-token loss and the same weighted gradient of the logits, then the same GPT loss and gradients."""
import jax
import jax.numpy as jnp
import pytest

from jax3d.kernels import fused_xent
from jax3d.models.layers import token_nll
from tests.helpers import rel_err


ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows, block", [(1, 64), (2, 128)])
# 300: a masked tail; 290 or 100 real columns (100: whole blocks of padding columns past them)
@pytest.mark.parametrize("width, valid", [(300, 290), (300, 100), (256, 0)])
# The interpreter pads blocks, so it cannot see a load or store past a row's end; the GPU can.
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=ON_GPU)])
def test_fused_xent_matches_xla(dtype, tol, rows, block, width, valid, interpret):
    tuning = fused_xent.Tuning(rows=rows, block=block)
    k = jax.random.split(jax.random.key(0), 3)
    logits = (jax.random.normal(k[0], (2, 8, width)) * 4).astype(dtype)
    targets = jax.random.randint(k[1], (2, 8), 0, valid or width).at[0, 0].set(width + 3)  # one past the row
    weights = (jax.random.uniform(k[2], (2, 8)) > 0.3).astype(jnp.float32)

    nll, grad = jax.jit(lambda l, t, w: fused_xent.token_nll(l, t, w, valid, dtype, tuning, interpret))(
        logits, targets, weights)
    ref_nll, ref_dnll = token_nll(logits, targets, valid)
    assert nll.dtype == jnp.float32 and grad.dtype == dtype
    assert rel_err(nll, ref_nll) < 1e-6
    assert rel_err(grad, (ref_dnll * weights[..., None]).astype(dtype)) < tol
    if valid:
        assert not jnp.any(grad[..., valid:]), "padding columns must get no gradient"
    loss_only, none = fused_xent.token_nll(logits, targets, weights, valid, None, tuning, interpret)
    assert none is None
    assert rel_err(loss_only, ref_nll) < 1e-6


def test_gpt_with_fused_xent_matches_xla_loss(monkeypatch):
    """The whole GPT, its chunked LM loss through the kernel, against the GPT without it (as on a CPU): the
    same loss and gradients in fp32, with a padded vocabulary and a partial loss mask."""
    from jax3d.models import GPT
    from tests.helpers import (assert_same_loss_and_grads, gpt_loss_and_grads, interpreted, only, random_text,
                               tiny_model)

    cfg = tiny_model(vocab_size=384, unpadded_vocab_size=377)
    params = GPT(cfg).init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, 377)
    mask = jnp.ones((4, cfg.seq_length)).at[1, 3:].set(0.0)

    def loss_and_grads(cfg, kernels=None):
        return gpt_loss_and_grads(cfg, params, {"text": text, "loss_mask": mask}, kernels)

    ref_loss, ref_grads = loss_and_grads(cfg)
    calls = interpreted(monkeypatch, "fused_xent", fits=True)  # the kernel in Pallas' interpreter, counted
    loss, grads = loss_and_grads(cfg, only("fused_xent", fused_xent.DEFAULT))
    assert calls, "the loss did not go through the kernel"
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def test_fused_xent_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="power of two"):
        fused_xent.Tuning(block=3000)
    with pytest.raises(ValueError, match="blocks of 2 rows"):
        fused_xent.token_nll(jnp.zeros((1, 3, 256)), jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3)),
                             tuning=fused_xent.Tuning(rows=2), interpret=True)
