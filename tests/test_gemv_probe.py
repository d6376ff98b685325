"""benchmarks.gemv_probe on a CPU: its Pallas one-row GEMM (in Pallas' interpreter) against a plain dot, for
each tiling the GPU run times, every variant with bf16 and fp8 weights, and its refusal of a tiling that does not
divide the matrix."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import gemv_probe


@pytest.mark.parametrize("cols, splits, warps", gemv_probe.TILINGS)
def test_gemv_equals_a_dot(cols, splits, warps):
    x = jax.random.normal(jax.random.key(0), (1, 2048))
    w = jax.random.normal(jax.random.key(1), (2048, 256))
    got = gemv_probe.gemv(x, w, cols=cols, splits=splits, warps=warps, interpret=True)
    np.testing.assert_allclose(got, x @ w, rtol=1e-5, atol=1e-3)


def test_a_tiling_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="do not divide"):
        gemv_probe.gemv(jnp.ones((1, 512)), jnp.ones((512, 256)), splits=4)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_small_run_checks_every_variant(capsys, quantization):
    """Each variant against a dot, with fp8 weights against the dot of their dequantized values."""
    assert gemv_probe.main(["--small", "--quantization", quantization]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = (gemv_probe.fp8_variants if quantization == "fp8" else gemv_probe.variants)(interpret=True)
    assert {r["variant"] for r in rows} == set(want)
    assert all(r["max_abs_err"] < 1e-2 for r in rows)
