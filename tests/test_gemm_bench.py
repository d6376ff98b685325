"""benchmarks/gemm_shapes.py: each layout's dot_general is the product it is named for, the same GEMM the
step runs, so its timings are of the step's GEMMs."""
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gemm_shapes


def test_layouts_are_the_linear_layers_products():
    gemm_shapes.check_layouts()
    # ...and they are what differentiating x @ W gives: the gradients of x and W are the other two.
    k = jax.random.split(jax.random.key(0), 3)
    x, w, dy = (jax.random.normal(k[i], s) for i, s in enumerate([(6, 4), (4, 5), (6, 5)]))
    y, vjp = jax.vjp(lambda x, w: x @ w, x, w)
    dx, dw = vjp(dy)
    run = {name: gemm_shapes.jax_gemm(name) for name in gemm_shapes.LAYOUTS}
    for got, want in [(run["forward"](x, w), y), (run["input_grad"](dy, w), dx), (run["weight_grad"](x, dy), dw)]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert run["forward"](x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_every_gemm_and_layout_is_timed(capsys):
    assert gemm_shapes.main(["--d", "16", "--tokens", "32", "--vocab", "64", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(gemm_shapes.gemms(16, 64, 64)) * len(gemm_shapes.LAYOUTS)
