"""jax3d.inference.one_row: a one-row GEMM below XLA's rewrite bound runs on the row twice and gives the same result
as the plain dot; other shapes are left as they are, and generation's decode spec takes it on a GPU only."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.inference import one_row


def _dot(spec):
    return functools.partial(jnp.einsum, spec)


def test_one_row_equals_the_plain_dot_and_runs_on_two_rows():
    x = jax.random.normal(jax.random.key(0), (1, 1, 64))
    w = jax.random.normal(jax.random.key(1), (64, 3, 32))
    got = one_row.gemm(_dot("btd,dcf->btcf"), x, w)
    np.testing.assert_allclose(got, jnp.einsum("btd,dcf->btcf", x, w), rtol=1e-5, atol=1e-5)  # another kernel
    dots = [e for e in jax.make_jaxpr(lambda x, w: one_row.gemm(_dot("btd,dcf->btcf"), x, w))(x, w).eqns
            if e.primitive.name == "dot_general"]
    assert [d.invars[0].aval.shape for d in dots] == [(1, 2, 64)]


def test_more_rows_a_large_weight_or_the_cpu_are_left_alone():
    from jax3d.inference.cached_attention import OneRowProjection, decode_spec
    from jax3d.kernels.policy import KernelPolicy
    from tests.helpers import tiny_model

    x, w = jnp.ones((1, 1, 64)), jnp.ones((64, 32))
    cpu = decode_spec(tiny_model(), KernelPolicy.none("cpu")).project  # the rewrite it avoids is the GPU's
    assert not isinstance(cpu, OneRowProjection)
    assert [e.primitive.name for e in jax.make_jaxpr(lambda x, w: cpu("btd,df->btf", x, w))(x, w).eqns] == [
        "dot_general"]
    gpu = decode_spec(tiny_model(), KernelPolicy.none("gpu")).project
    assert [d.invars[0].aval.shape for d in jax.make_jaxpr(lambda x, w: gpu("btd,df->btf", x, w))(x, w).eqns
            if d.primitive.name == "dot_general"] == [(1, 2, 64)]
    for x_shape, w_shape in (((1, 3, 64), (64, 32)), ((2, 1, 64), (64, 32)),
                             ((1, 1, 2048), (2048, one_row.REWRITTEN_BELOW // 2048))):
        x, w = jax.ShapeDtypeStruct(x_shape, jnp.bfloat16), jax.ShapeDtypeStruct(w_shape, jnp.bfloat16)
        dots = [e for e in jax.make_jaxpr(lambda x, w: one_row.gemm(_dot("btd,df->btf"), x, w))(x, w).eqns
                if e.primitive.name == "dot_general"]
        assert [d.invars[0].aval.shape for d in dots] == [x_shape]
