"""jax3d.kernels.fp8_cast (an FP8 GEMM operand quantized in both layouts, with its amax, in one pass) in Pallas'
interpreter against plain JAX, and jax3d.models.fp8's GEMMs built on it against its einsum of the f8 arrays."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.kernels import fp8_cast
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import fp8
from jax3d.parallel.plan import Plan

F8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)


@pytest.mark.parametrize("f8", F8)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_equals_quantizing_then_transposing(f8, dtype):
    # a 2 x 3 grid of 16 x 32 tiles, values past the format's range at a scale of 2**-3 (clipped), and the
    # largest |a| in the last tile
    a = jax.random.normal(jax.random.key(0), (32, 96), jnp.float32) * 300
    a = a.at[31, 95].set(-1e5).astype(dtype)
    scale = jnp.float32(2.0 ** -3)
    q, q_t, amax = fp8_cast.cast_transpose(a, scale, f8, fp8_cast.Tuning(rows=16, cols=32), interpret=True)
    want_q, want_t, want_amax = fp8_cast.reference(a, scale, f8)
    assert q.dtype == f8 and q_t.shape == (96, 32)
    np.testing.assert_array_equal(q.astype(jnp.float32), want_q.astype(jnp.float32))
    np.testing.assert_array_equal(q_t.astype(jnp.float32), want_t.astype(jnp.float32))
    assert float(amax) == float(want_amax) == float(jnp.asarray(1e5, dtype))


def test_tiles_that_do_not_divide_the_operand_are_refused(monkeypatch):
    tuning = fp8_cast.Tuning(rows=16, cols=32)
    assert fp8_cast.supported((32, 96), tuning)
    assert not fp8_cast.supported((24, 96), tuning)
    assert not KernelPolicy.resolve("gpu", 1, off=["fp8_cast"]).takes("fp8_cast", (32, 96))  # left out
    assert fp8_cast.DEFAULT == fp8_cast.Tuning()
    with pytest.raises(ValueError, match="whole number"):
        fp8_cast.cast_transpose(jnp.zeros((24, 96)), jnp.float32(1), F8[0], tuning, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        fp8_cast.Tuning(rows=48)


# The blocks' GEMMs (jax3d.models.layers): QKV, attention out, MLP up (plain and SwiGLU), MLP down.
SPECS = {"btd,dcnh->btcnh": ((2, 16, 64), (64, 3, 4, 8)), "btnh,nhd->btd": ((2, 16, 4, 8), (4, 8, 64)),
         "btd,dcf->btcf": ((2, 16, 64), (64, 2, 32)), "btd,df->btf": ((2, 16, 64), (64, 32)),
         "btf,fd->btd": ((2, 16, 32), (32, 64))}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("spec", SPECS)
def test_the_gemm_on_the_kernel_equals_the_einsum_of_f8_arrays(spec, dtype, monkeypatch):
    """Forward, both input gradients and the observed amaxes, with both paths' operands quantized alike: they
    differ only in the order the dot sums its f8 products (to about 1e-6 in fp32; in bf16, the sums' rounding
    to bf16 may differ by an ulp)."""
    monkeypatch.setattr(fp8_cast, "cast_transpose", functools.partial(fp8_cast.cast_transpose, interpret=True))
    x_shape, w_shape = SPECS[spec]
    kx, kw, kg = jax.random.split(jax.random.key(1), 3)
    x, w = (jax.random.normal(kx, x_shape) * 3).astype(dtype), (jax.random.normal(kw, w_shape) * 0.05).astype(dtype)
    scales = jnp.array([2.0 ** -4, 2.0 ** -8, 2.0 ** -6], jnp.float32)
    assert fp8._layout(spec) is not None

    def run(tuning, x, w, scales):  # tuning None: the kernel left out
        return fp8.einsum(spec, x, w, scales, "hybrid", tuning)

    outs = {}
    for name, tuning in (("einsum", None), ("kernel", fp8_cast.Tuning(rows=16, cols=8))):
        y, pull = jax.vjp(functools.partial(run, tuning), x, w, scales)
        g = jax.random.normal(kg, y.shape, dtype)
        outs[name] = (y, *pull(g))
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    for got, want in zip(outs["kernel"], outs["einsum"]):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert outs["kernel"][1].dtype == dtype and outs["kernel"][2].dtype == dtype  # the cotangents of x and w
    # the kernel path really ran: its forward is a dot of f8 arrays with both contracted dims minor
    text = str(jax.make_jaxpr(lambda x, w: fp8.einsum(spec, x, w, scales, "hybrid", fp8_cast.Tuning(rows=16, cols=8)))(
        x, w))
    assert "fp8_cast_transpose" in text and "dimension_numbers=(([1], [1]), ([], []))" in text


def test_a_gemm_of_another_layout_keeps_the_einsum(monkeypatch):
    """Only "x = batch + contracted, w = contracted + outputs" GEMMs, each dimension named once and the
    contracted sizes equal, take the kernel; the rest run the einsum, which rejects what is malformed."""
    assert fp8._layout("btd,df->btf") == (2, 1, 1) and fp8._layout("btnh,nhd->btd") == (2, 2, 1)
    for spec in ("btd,fd->btf", "dbt,df->btf", "td,dd->td", "...d,df->...f", "btd,df->bft"):
        assert fp8._layout(spec) is None, spec
    calls = []
    monkeypatch.setattr(fp8_cast, "cast_transpose", lambda *a, **k: calls.append(1))
    scales, cast = jnp.ones((3,)), fp8_cast.Tuning(rows=16, cols=16)
    y = fp8.einsum("btd,fd->btf", jnp.ones((2, 16, 32)), jnp.ones((16, 32)), scales, "hybrid", cast)
    assert y.shape == (2, 16, 16) and not calls
    with pytest.raises(ValueError):  # heads swapped with the head size: the einsum refuses it
        fp8.einsum("btnh,nhd->btd", jnp.ones((2, 16, 4, 8)), jnp.ones((8, 4, 32)), scales, "hybrid", cast)
    assert not calls


def test_the_gemm_lowers_for_cuda_to_three_casts_and_three_tn_dots_of_f8(monkeypatch):
    """What a GPU would compile, lowered on this CPU: a GEMM's forward and backward at gpt-1.3b's MLP-up shape
    (2 x 2048 tokens) casts x, w and g with one Triton call each, and dots f8 arrays with the contracted
    dimension minor on both sides (the layout Hopper's FP8 GEMMs take), nothing for XLA to transpose."""
    bf = jnp.bfloat16
    x, w = jax.ShapeDtypeStruct((2, 2048, 2048), bf), jax.ShapeDtypeStruct((2048, 8192), bf)
    scales = jax.ShapeDtypeStruct((3,), jnp.float32)
    def loss(x, w, scales):
        y = fp8.einsum("btd,df->btf", x, w, scales, "hybrid", fp8_cast.Tuning()).astype(jnp.float32)
        return jnp.sum(y * y)  # its gradient needs y: the forward dot is kept

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, w, scales).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3
    dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
    assert len(dots) == 3 and all("f8E" in d and "contracting_dims = [1] x [1]" in d for d in dots), dots


# ---- in the train step ---------------------------------------------------------------------------------------------



@pytest.mark.parametrize("llama, recompute", [(False, "none"), (False, "selective"), (True, "full")],
                         ids=["gpt", "gpt-selective", "llama-full"])
def test_a_train_step_on_the_kernel_gives_the_einsum_paths_losses(llama, recompute, monkeypatch):
    """Four FP8 steps of a tiny model (fp32, one device, 4 micro-batches of 2) with every block GEMM on the cast kernel
    (Pallas' interpreter standing in for the GPU) give the losses of the einsum path: the same f8 codes, the
    dots summed in another order."""
    from jax3d.train.step import build_steps
    from tests.checkpoint import test_checkpoint
    from tests.helpers import tiny_config
    from tests.train.test_fp8 import FP8, GB
    from tests.train.test_llama_layouts import LLAMA, counting_batch

    monkeypatch.setattr(test_checkpoint, "host_batch", counting_batch)
    calls, cast = [], fp8_cast.cast_transpose

    def interpreted(*args, **kw):
        calls.append(1)
        return cast(*args, interpret=True, **kw)

    monkeypatch.setattr(fp8_cast, "cast_transpose", interpreted)
    model_kw = {**(LLAMA if llama else {}), "num_layers": 2, "recompute": recompute}
    cfg, mesh_cfg, mesh = tiny_config(micro=2, global_batch=GB // 2, model_kw=model_kw)
    cfg = cfg.replace(precision=FP8, optim={"lr": 3e-3})
    losses = {}
    for name, tunings in (("einsum", ()), ("kernel", (("fp8_cast", fp8_cast.Tuning(rows=16, cols=16)),))):
        s = build_steps(Plan(cfg, mesh_cfg, kernels=KernelPolicy(tunings)), mesh)
        losses[name] = test_checkpoint.train(s, s.init_state(0), 0, 4)[0]
        assert bool(calls) == (name == "kernel"), name
    np.testing.assert_allclose(losses["kernel"], losses["einsum"], rtol=1e-5)
