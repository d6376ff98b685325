"""Dropout on, every layout trains alike: each sample draws its masks from its own key (jax3d.dropout_keys),
so the loss curve of the (8, 1, 1) run is the curve of pipelined, tensor-parallel, sequence-parallel and
accumulating runs of the same global batch (fp32, 1e-5 relative)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d import dropout_keys
from jax3d.train.step import build_steps
from tests.helpers import random_text, tiny_config
from jax3d.parallel.plan import Plan

GB, STEPS = 8, 3


def _losses(data, stage, model, micro=1, dropout=0.1, **parallel):
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, micro=micro, global_batch=GB,
                                      model_kw=dict(num_layers=4, hidden_dropout=dropout, attention_dropout=dropout),
                                      **parallel)
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(3)
    text = random_text(GB * STEPS, cfg.model.seq_length, cfg.model.vocab_size, seed=5)
    losses = []
    for s in range(STEPS):
        t = text[s * GB:(s + 1) * GB]
        batch = {"text": jax.device_put(t.reshape(steps.accum_steps, -1, t.shape[-1]), steps.batch_sharding())}
        state, metrics = steps.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses)


@pytest.fixture(scope="module")
def reference():
    return _losses(8, 1, 1)


# (data, stage, model, micro-batch): data shards and pipeline stages (2, 2, 2), accumulation over 4 micro-batches
# with 8-way tensor parallelism, ZB-H1 with sequence-split activations, and interleaved stages (the layers out of
# order on the devices, each drawing its own key). ZeRO shards parameters, not samples: no case of its own.
@pytest.mark.parametrize("layout, parallel", [
    ((2, 2, 2, 1), {}),
    ((1, 1, 8, 4), {}),
    pytest.param((1, 2, 4, 2), dict(pipeline_schedule="zb-h1", sequence_parallel=True), marks=pytest.mark.slow),
    pytest.param((1, 2, 2, 1), dict(pipeline_schedule="interleaved", virtual_stages=2), marks=pytest.mark.slow)])
def test_dropout_loss_curve_is_the_same_on_every_layout(reference, layout, parallel):
    *mesh, micro = layout
    losses = _losses(*mesh, micro=micro, **parallel)
    np.testing.assert_allclose(losses, reference, rtol=1e-5)


def test_dropout_is_on_in_the_reference(reference):
    assert np.abs(reference - _losses(8, 1, 1, dropout=0.0)).max() > 1e-3


def test_per_sample_masks_are_each_samples_own():
    """A batch of keys draws, row by row, what each key draws alone: so splitting the batch anywhere
    (micro-batches, data shards) leaves every sample's mask as it was."""
    keys = dropout_keys.sample_keys(jax.random.key(7), jnp.arange(6).reshape(2, 3))
    assert keys.shape == (2, 3)
    rows = keys.reshape(-1)
    whole = dropout_keys.bernoulli(rows, 0.5, (6, 4, 5))
    for s in range(6):
        np.testing.assert_array_equal(whole[s], jax.random.bernoulli(jax.random.fold_in(jax.random.key(7), s),
                                                                    0.5, (4, 5)))
    np.testing.assert_array_equal(dropout_keys.bernoulli(rows[2:5], 0.5, (3, 4, 5)), whole[2:5])
    layer = dropout_keys.fold_in(rows, 3)
    parts = dropout_keys.split(layer, 3)
    assert parts.shape == (3, 6)
    np.testing.assert_array_equal(jax.random.key_data(parts[1][4]),
                                  jax.random.key_data(jax.random.split(jax.random.fold_in(rows[4], 3), 3)[1]))
