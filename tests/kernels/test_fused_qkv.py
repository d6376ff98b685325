"""The QKV bias-and-split kernel (its backward pass run in Pallas' interpreter on CPU, compiled on a GPU)
against XLA's (y + b) sliced into q, k and v: the same outputs and gradients; then the whole GPT with its
attention through the kernel against the GPT without it (as on a CPU)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.kernels import fused_qkv
from jax3d.kernels.policy import KernelPolicy
from tests.helpers import rel_err

ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the compiled kernel needs a GPU")

SMALL = fused_qkv.Tuning(cols=32, rows=2, rows_per_program=8, warps=1)
WIDE = fused_qkv.Tuning(cols=1024, rows=4, rows_per_program=32)  # the strip is all of heads * head_dim


def _reference(y, b):
    z = y + b.astype(y.dtype)
    return z[:, :, 0], z[:, :, 1], z[:, :, 2]


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("tuning", [SMALL, WIDE])
@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=ON_GPU)])
def test_split_bias_matches_xla(dtype, tol, tuning, interpret):
    k = jax.random.split(jax.random.key(0), 5)
    y = jax.random.normal(k[0], (2, 32, 3, 4, 32)).astype(dtype)
    b = jax.random.normal(k[1], (3, 4, 32)).astype(dtype)
    cts = tuple(jax.random.normal(k[2 + i], (2, 32, 4, 32)).astype(dtype) for i in range(3))

    def run(f):
        return jax.jit(lambda y, b, cts: (lambda out, vjp: (out, vjp(cts)))(*jax.vjp(f, y, b)))(y, b, cts)

    (out, (dy, db)) = run(lambda y, b: fused_qkv.split_bias(y, b, tuning, interpret))
    (ref_out, (ref_dy, ref_db)) = run(_reference)
    for o, r in zip(out, ref_out):
        assert o.dtype == dtype and o.shape == (2, 32, 4, 32)
        np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(r, np.float32))
    assert dy.dtype == dtype and db.dtype == dtype
    np.testing.assert_array_equal(np.asarray(dy, np.float32), np.asarray(ref_dy, np.float32))  # a copy
    # The bias gradient is summed in fp32 from the incoming values (XLA's bf16 sum on a CPU is not: it
    # is the reference in fp32 only).
    exact = np.stack([np.asarray(c, np.float64).sum((0, 1)) for c in cts])
    assert rel_err(db, exact) < (4e-3 if dtype == jnp.bfloat16 else 1e-6)
    if dtype == jnp.float32:
        assert rel_err(db, ref_db) < tol


def test_gpt_with_fused_qkv_matches_xla(monkeypatch):
    """The whole GPT, each attention's bias and split through the kernel with a benchmark's settings
    (a KernelPolicy of one GPU's), against the GPT without it: the same loss and gradients in fp32; and
    with the kernel left out there, the GPT without it again."""
    import dataclasses

    from tests.helpers import assert_same_loss_and_grads, gpt_case, interpreted, tiny_model

    cfg = tiny_model(vocab_size=384, num_layers=2)
    loss_and_grads = gpt_case(cfg, "qkv_bias")
    ref_loss, ref_grads = loss_and_grads(cfg)
    calls = interpreted(monkeypatch, "fused_qkv")
    tuning = fused_qkv.Tuning(cols=32, rows_per_program=16)
    # One GPU's kernels (traced on this CPU), the others left out: the norm and GELU kernels have no interpreter
    # here.
    others = ("fused_gelu", "fused_norm", "fused_xent", "fp8_cast")
    on_one_gpu = dataclasses.replace(KernelPolicy.resolve("gpu", 1, tunings=[tuning], off=others), platform="cpu",
                                     attention="xla")
    loss, grads = loss_and_grads(cfg, on_one_gpu)
    assert calls == [tuning] * cfg.num_layers
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))

    calls.clear()
    left_out = dataclasses.replace(KernelPolicy.resolve("gpu", 1, tunings=[tuning], off=others + ("fused_qkv",)),
                                   platform="cpu", attention="xla")
    loss_and_grads(cfg, left_out)
    assert not calls, "left out, the kernel does not run even where it fits"


def test_fused_qkv_is_taken_where_it_fits():
    assert fused_qkv.supported(jnp.zeros((2, 64, 3, 16, 128)))
    assert fused_qkv.supported(jnp.zeros((2, 64, 3, 12, 64)))  # width 768: strips of 256
    assert not fused_qkv.supported(jnp.zeros((2, 60, 3, 16, 128)))  # 120 tokens: not whole programs
    assert not fused_qkv.supported(jnp.zeros((2, 64, 16, 128)))
    assert not fused_qkv.supported(jnp.zeros((2, 64, 3, 1, 4)))  # a width-4 strip is too narrow
    assert KernelPolicy.resolve("gpu", 1).takes("fused_qkv", jnp.zeros((2, 64, 3, 16, 128)))
    assert not KernelPolicy.resolve("cpu", 1).takes("fused_qkv", jnp.zeros((2, 64, 3, 16, 128)))


def test_fused_qkv_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="power of two"):
        fused_qkv.Tuning(cols=1000)
    with pytest.raises(ValueError, match="rows_per_program"):
        fused_qkv.Tuning(rows=8, rows_per_program=4)
    with pytest.raises(ValueError, match="one per"):
        fused_qkv.split_bias(jnp.zeros((1, 16, 3, 2, 32)), jnp.zeros((2, 32)), SMALL, True)
    y, b = jnp.zeros((1, 12, 3, 2, 32)), jnp.zeros((3, 2, 32))
    with pytest.raises(ValueError, match="do not split"):
        jax.vjp(lambda y, b: fused_qkv.split_bias(y, b, SMALL, True), y, b)[1]((y[:, :, 0],) * 3)
    assert fused_qkv.DEFAULT.strip(768) == 256 and fused_qkv.DEFAULT.strip(2048) == 1024
