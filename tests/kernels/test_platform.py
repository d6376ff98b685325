"""Layers take their GPU paths (Pallas kernels, cuDNN attention) from the kernel policy of the devices their
mesh holds, not from the machine's default backend: a mesh of CPU devices on a GPU machine runs the CPU paths."""
import jax
import numpy as np
import pytest

from jax3d.kernels.policy import KernelPolicy
from jax3d.train.step import build_steps
from tests.helpers import random_text, tiny_config
from jax3d.parallel.plan import Plan


def _platforms():
    found = ["cpu"]
    try:
        if jax.devices("gpu"):
            found.append("gpu")
    except RuntimeError:
        pass
    return found


@pytest.mark.skipif("gpu" not in _platforms(), reason="needs a GPU machine: a CPU mesh beside a GPU")
def test_cpu_mesh_on_a_gpu_machine_takes_the_cpu_paths():
    """The tiny GPT's bf16 train step on one CPU device of a GPU machine: XLA's attention and no Pallas
    kernel, and it runs (a GPU kernel in a CPU program would not compile)."""
    cfg, mesh_cfg, _ = tiny_config(micro=2, global_batch=2)
    cfg = cfg.replace(precision={"dtype": "bfloat16"})
    mesh = mesh_cfg.build(jax.devices("cpu")[:1])
    kernels = KernelPolicy.resolve(mesh.devices.flat[0].platform, mesh.size)
    assert kernels == KernelPolicy.none("cpu")  # XLA's
    steps = build_steps(Plan(cfg, mesh_cfg, kernels=kernels), mesh)
    state = steps.init_state(0)
    batch = {"text": np.asarray(random_text(2, cfg.model.seq_length, cfg.model.vocab_size))[None]}
    hlo = steps.train_step.lower(state, batch).compile().as_text()
    assert "triton" not in hlo and "cudnn" not in hlo
    _, metrics = steps.train_step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
