"""jax3d.models.gemm: the 2-D view of the blocks' GEMM specs, and the one-row product that stands in for the
dots XLA's GPU compiler would rewrite, against jnp.einsum; generation with it forced gives transformers' tokens
(tests/test_generate.py)."""
import jax
import jax.numpy as jnp
import pytest

from jax3d.models import gemm
from tests.helpers import rel_err

SPECS = [("btd,dcnh->btcnh", (1, 1, 64), (64, 3, 4, 16)), ("btkgh,kghd->btd", (1, 1, 2, 2, 16), (2, 2, 16, 48)),
         ("btf,fd->btd", (1, 1, 96), (96, 32)), ("btd,dcf->btcf", (1, 1, 32), (32, 2, 80))]


@pytest.mark.parametrize("spec, xs, ws", SPECS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_the_row_product_equals_the_einsum(spec, xs, ws, dtype, tol):
    kx, kw = jax.random.split(jax.random.key(0))
    x, w = jax.random.normal(kx, xs, dtype), jax.random.normal(kw, ws, dtype)
    want = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(dtype)
    got = jax.jit(lambda x, w: gemm.row_product(gemm.layout(spec), x, w))(x, w)
    assert got.shape == want.shape and got.dtype == dtype
    assert rel_err(got, want) < tol


def test_einsum_takes_the_row_product_only_for_one_row_on_a_gpu_below_xlas_bound(monkeypatch):
    calls = []
    monkeypatch.setattr(gemm, "row_product", lambda *a: calls.append(a[0]) or jnp.zeros(()))
    x1, x2, w = jnp.ones((1, 1, 64)), jnp.ones((1, 2, 64)), jnp.ones((64, 32))
    gemm.einsum("btd,df->btf", x1, w)
    assert not calls  # a CPU: XLA's dot
    monkeypatch.setattr(gemm, "_on_gpu", lambda: True)
    gemm.einsum("btd,df->btf", x2, w)  # two rows: a GEMM
    assert not calls
    gemm.einsum("btd,df->btf", x1, w)
    assert calls == [(2, 1, 1)]
    monkeypatch.setattr(gemm, "REWRITTEN_BELOW", 64 * 32)  # XLA keeps a dot of this size: so does einsum
    gemm.einsum("btd,df->btf", x1, w)
    assert len(calls) == 1

