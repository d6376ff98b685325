"""The fused GELU kernels (run in Pallas' interpreter on CPU, compiled on a GPU) against XLA's gelu(h + b):
the same output and the same gradients for h and b; then the whole GPT with its MLPs through the kernels
against the GPT without them (as on a CPU)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.kernels import fused_gelu
from tests.helpers import rel_err

ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")


def _reference(h, b):
    return jax.nn.gelu(h.astype(jnp.float32) + b.astype(jnp.float32), approximate=True).astype(h.dtype)


SMALL = fused_gelu.Tuning(cols_fwd=128, rows_fwd=2, cols_bwd=256, rows_bwd=2, rows_per_program=8)
TALL = fused_gelu.Tuning(cols_fwd=256, rows_fwd=4, cols_bwd=128, rows_bwd=4, rows_per_program=64)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("tuning", [SMALL, TALL])
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=ON_GPU)])
def test_fused_gelu_matches_xla(dtype, tol, tuning, interpret):
    k = jax.random.split(jax.random.key(0), 3)
    h = (jax.random.normal(k[0], (2, 64, 512)) * 4).astype(dtype)  # out to where the tanh saturates
    b = jax.random.normal(k[1], (512,)).astype(dtype)
    dg = jax.random.normal(k[2], h.shape)

    def loss(gelu):
        return lambda h, b: jnp.sum(gelu(h, b).astype(jnp.float32) * dg)

    def kernel(h, b):
        return fused_gelu.gelu_bias(h, b, tuning, interpret)

    out = jax.jit(kernel)(h, b)
    assert out.dtype == dtype
    assert rel_err(out, _reference(h, b)) < tol
    if dtype == jnp.bfloat16:  # each element within half a bf16 step of the fp32 maths: fp32 inside
        exact = _reference(h.astype(jnp.float32), b.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(exact), rtol=2 ** -8, atol=1e-6)
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(h, b)
    want = jax.jit(jax.grad(loss(_reference), argnums=(0, 1)))(h, b)
    # Where the tanh saturates (h + b below about -5) the reference's 1 + tanh(u) and 1 - tanh(u)^2 cancel:
    # against the derivative in float64 over [-9, 3], its fp32 gradient is off by up to 3.1e-6, the
    # kernel's sigmoid form by 6.6e-7. Hence the looser bound on h's gradient in fp32.
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == dtype
        assert rel_err(g, w) < max(tol, 2e-5)
    assert rel_err(got[1], want[1]) < (1e-3 if dtype == jnp.bfloat16 else 2e-5), "bias gradient summed in fp32"


def test_fused_gelu_matches_the_derivative_in_float64():
    """Each element of the fp32 value and gradient against the tanh form evaluated in float64."""
    z = np.linspace(-9, 12, 4096).reshape(8, 512)
    b = np.linspace(-0.5, 0.5, 512)
    x = z + b
    u = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
    t = np.tanh(u)
    value = 0.5 * x * (1 + t)
    slope = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x ** 2)
    h32, b32 = jnp.asarray(z, jnp.float32), jnp.asarray(b, jnp.float32)
    out, vjp = jax.vjp(lambda h, b: fused_gelu.gelu_bias(h, b, SMALL, True), h32, b32)
    dh, db = vjp(jnp.ones_like(out))
    np.testing.assert_allclose(np.asarray(out), value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dh), slope, rtol=0, atol=2.5e-6)
    np.testing.assert_allclose(np.asarray(db), slope.sum(0), rtol=1e-6, atol=1e-5)


def test_gpt_with_fused_gelu_matches_xla_gelu(monkeypatch):
    """The whole GPT, each MLP's GELU through the kernels with a benchmark's settings (a KernelPolicy that
    runs them), against the GPT without them: the same loss and gradients in fp32. With erf GELU (imported
    BERT-style models) the kernels are not used."""
    from tests.helpers import assert_same_loss_and_grads, gpt_case, interpreted, only, tiny_model

    cfg = tiny_model(vocab_size=384, num_layers=2)
    loss_and_grads = gpt_case(cfg, "up_bias")
    ref_loss, ref_grads = loss_and_grads(cfg)
    calls = interpreted(monkeypatch, "fused_gelu", fits=True)
    tuning = fused_gelu.Tuning(cols_fwd=128, cols_bwd=128, rows_per_program=64)
    loss, grads = loss_and_grads(cfg, only("fused_gelu", tuning))
    assert calls == [tuning] * cfg.num_layers
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))

    calls.clear()
    loss_and_grads(dataclasses.replace(cfg, activation="gelu_erf"), only("fused_gelu", tuning))
    assert not calls, "the kernels compute the tanh form only"


def test_fused_gelu_is_taken_where_it_fits():
    from jax3d.kernels.policy import KernelPolicy

    assert fused_gelu.supported(jnp.zeros((2, 64, 2048)))
    assert not fused_gelu.supported(jnp.zeros((2, 64, 1000)))
    assert not fused_gelu.supported(jnp.zeros((0, 2048)))
    assert KernelPolicy.resolve("gpu", 1).takes("fused_gelu", jnp.zeros((2, 64, 2048)))
    assert not KernelPolicy.resolve("cpu", 1).takes("fused_gelu", jnp.zeros((2, 64, 2048)))
    assert not KernelPolicy.resolve("gpu", 2).takes("fused_gelu", jnp.zeros((2, 64, 2048)))


def test_fused_gelu_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="power of two"):
        fused_gelu.Tuning(cols_fwd=1000)
    with pytest.raises(ValueError, match="rows_per_program"):
        fused_gelu.Tuning(rows_bwd=8, rows_per_program=4)
    with pytest.raises(ValueError, match="does not split"):
        fused_gelu.gelu_bias(jnp.zeros((3, 256)), jnp.zeros((256,)), interpret=True)
    with pytest.raises(ValueError, match="one per column"):
        fused_gelu.gelu_bias(jnp.zeros((16, 256)), jnp.zeros((128,)), SMALL, True)
    assert fused_gelu.DEFAULT.fits(rows=128, f=2048)
    assert not fused_gelu.DEFAULT.fits(rows=128, f=1000) and not fused_gelu.DEFAULT.fits(rows=100, f=2048)
    assert not fused_gelu.DEFAULT.fits(rows=0, f=2048)
    # Each dimension is checked against both of its blocks: forward and backward differ here.
    assert not fused_gelu.Tuning(cols_fwd=64, cols_bwd=128).fits(rows=128, f=64)
    assert not fused_gelu.Tuning(cols_fwd=128, cols_bwd=64).fits(rows=128, f=64)
    assert not fused_gelu.Tuning(rows_fwd=16, rows_bwd=8, rows_per_program=8).fits(rows=8, f=1024)
    assert not fused_gelu.Tuning(rows_fwd=8, rows_bwd=8, rows_per_program=16).fits(rows=8, f=1024)
