"""Shared test fixtures: tiny configs and meshes, and what subprocess tests need."""
from __future__ import annotations

import os
import socket

import jax
import numpy as np

from jax3d.config import Config, ModelConfig, ParallelConfig, TrainConfig
from jax3d.parallel.plan import resolve


def tiny_model(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, vocab_size=256, seq_length=16,
                hidden_dropout=0.0, attention_dropout=0.0)
    base.update(kw)
    return ModelConfig(**base)


def tiny_config(data=1, stage=1, model=1, zero=0, micro=2, global_batch=16, model_kw=None, **parallel) -> tuple:
    """(the resolved Config, its MeshConfig, the jax Mesh on the first data x stage x model devices)."""
    cfg = Config(model=tiny_model(**(model_kw or {})),
                 parallel=ParallelConfig(tensor_parallel=model, pipeline_parallel=stage, zero_stage=zero, **parallel),
                 train=TrainConfig(micro_batch_size=micro, global_batch_size=global_batch, train_iters=10))
    plan = resolve(cfg, data * stage * model)
    return plan.cfg, plan.mesh, plan.mesh.build(jax.devices()[: plan.mesh.size])


def random_text(n, seq, vocab, seed=0):
    return np.random.RandomState(seed).randint(0, vocab, (n, seq + 1)).astype(np.int32)


def gpt_loss_and_grads(cfg: ModelConfig, params, batch, kernels=None):
    """The GPT's loss on `batch` and its gradients in `params`, jitted, under the KernelPolicy `kernels` (None:
    no kernel). fp32 GEMMs run at full precision (a GPU would use TF32), so two programs that should agree in
    fp32 do."""
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import GPT

    model = GPT(cfg, kernels=kernels or KernelPolicy.none())
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(lambda p: model.loss(p, batch)[0]))(params)


def assert_same_loss_and_grads(got, want) -> None:
    """(loss, grads) against a reference (loss, grads) in fp32: the loss within 1e-6 of it relatively (a few
    ulps: an absolute 1e-6 is two at a loss of 5.9, and one CPU's summation order missed it by 1.4e-6), each
    gradient leaf within 1e-5 (`rel_err`)."""
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * abs(float(ref_loss)), (float(loss), float(ref_loss))
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert rel_err(g, r) < 1e-5


def with_random(params, name: str):
    """`params` with random values added to the leaves whose path names `name`: biases start at zero, which
    would hide a kernel that dropped or misplaced one."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.5 * jax.random.normal(jax.random.key(1), a.shape, a.dtype)
        if name in jax.tree_util.keystr(path) else a, params)


def gpt_case(cfg: ModelConfig, bias: str):
    """`loss_and_grads(cfg)` of the tiny GPT built from `cfg`, on its parameters with the leaves naming
    `bias` given random values (`with_random`) and one random batch: for comparing a kernel's model
    against the same model with the kernel ablated."""
    from jax3d.models import GPT

    params = with_random(GPT(cfg).init(jax.random.key(0)), bias)
    text = random_text(4, cfg.seq_length, cfg.vocab_size)
    return lambda c, kernels=None: gpt_loss_and_grads(c, params, {"text": text}, kernels)


def interpreted(monkeypatch, name: str, fits: bool = False) -> list:
    """Replaces the registered kernel `name`'s implementation `run(*arrays, tuning)` with the kernel in Pallas'
    interpreter, its settings kept (and with `fits` its shape test with one that takes every shape); returns the
    list each call's Tuning is appended to."""
    import dataclasses

    from jax3d import kernels

    calls = []
    entry = kernels.kernel(name)
    run = lambda *args: calls.append(args[-1]) or entry.run(*args, interpret=True)  # noqa: E731
    monkeypatch.setitem(kernels._REGISTRY, name, dataclasses.replace(
        entry, run=run, supported=(lambda *args: True) if fits else entry.supported))
    return calls


def only(name: str, tuning) -> "KernelPolicy":  # noqa: F821
    """The KernelPolicy that runs kernel `name` alone, with `tuning`, on this CPU."""
    from jax3d.kernels.policy import KernelPolicy

    return KernelPolicy(((name, tuning),))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now (for jax.distributed's coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(drop=("XLA_FLAGS",)) -> dict:
    """This environment for a child process that finds the checkout and sets up its own devices: a dropped
    XLA_FLAGS keeps every flag but the device count (the compile-time one conftest.py sets)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    if "XLA_FLAGS" in drop:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        if flags:
            env["XLA_FLAGS"] = " ".join(flags)
    env["PYTHONPATH"] = ROOT
    return env


def as_plan(resolved: tuple) -> tuple:
    """(the Plan of a resolved (Config, MeshConfig), the jax Mesh): `tiny_config`'s triple as `build_steps` takes it."""
    from jax3d.parallel.plan import Plan

    cfg, mesh_cfg, mesh = resolved
    return Plan(cfg, mesh_cfg), mesh
