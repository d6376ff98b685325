"""benchmarks/scaling.py runs on 8 emulated CPU devices, and two layouts of one global batch give one loss."""
import json
import os
import subprocess
import sys

from tests.helpers import ROOT, subprocess_env


def test_scaling_benchmark_layouts_agree():
    # 8 data-parallel ranks x 1 micro-batch and (2, 2, 2) x 4 micro-batches: both 32 samples a step.
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "scaling.py"), "--cpu-devices", "8", "--steps", "1",
           "--layouts", "8,1,1,1,1f1b,1", "2,2,2,1,1f1b,4"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(drop=("XLA_FLAGS", "JAX_PLATFORMS")),
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    a, b = (json.loads(line) for line in out.stdout.strip().splitlines())
    assert a["layout"] == {"data": 8, "stage": 1, "model": 1} and b["layout"] == {"data": 2, "stage": 2, "model": 2}
    assert a["tokens_per_s"] > 0 and b["peak_mem_gb_per_device"] > 0
    assert abs(a["loss"] - b["loss"]) < 1e-4, (a["loss"], b["loss"])


def test_hlo_transposes_counts_the_transposes_a_step_compiles_to():
    # The same elementwise function with and without a transpose in front: the count is their difference.
    import jax
    import jax.numpy as jnp

    from benchmarks.harness import hlo_transposes

    x = jnp.ones((64, 128))
    with_t = jax.jit(lambda a: jnp.transpose(a) * 2).lower(x).compile().as_text()
    without = jax.jit(lambda a: a * 2).lower(x).compile().as_text()
    assert hlo_transposes(with_t) - hlo_transposes(without) == 1
