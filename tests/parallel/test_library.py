"""Library use as a JAX engineer would try it: a mesh from `jax.make_mesh` (Explicit axes by default) trains
to the losses of the mesh jax3d builds; a mesh with other axis names, or a batch of the wrong shape, is refused
in one sentence instead of an XLA error or a silent run."""
import jax
import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.train.step import build_steps
from tests.helpers import random_text, tiny_config
from jax3d.parallel.plan import Plan


def _losses(steps, cfg, n=3, seq=None):
    state = steps.init_state(1)
    out = []
    for i in range(n):
        text = random_text(16, seq or cfg.model.seq_length, cfg.model.vocab_size, seed=i)
        batch = {"text": jax.device_put(text.reshape(steps.accum_steps, -1, text.shape[-1]), steps.batch_sharding())}
        state, m = steps.train_step(state, batch)
        out.append(float(m["loss"]))
    return np.array(out)


def test_a_make_mesh_mesh_trains_like_the_built_one():
    cfg, mesh_cfg, mesh = tiny_config(data=2, stage=2, model=2, micro=1, global_batch=16)
    explicit = jax.make_mesh((2, 2, 2), ("data", "stage", "model"))  # it failed a sharding assertion
    np.testing.assert_allclose(_losses(build_steps(Plan(cfg, mesh_cfg), explicit), cfg),
                               _losses(build_steps(Plan(cfg, mesh_cfg), mesh), cfg), rtol=1e-6)


def test_other_axis_names_and_a_misshapen_batch_are_refused():
    cfg, mesh_cfg, mesh = tiny_config(data=8, micro=1, global_batch=16)
    with pytest.raises(ConfigError, match=r"the mesh's axes are \('dp', 'pp', 'tp'\); training needs jax3d's"):
        build_steps(Plan(cfg, mesh_cfg), jax.make_mesh((8, 1, 1), ("dp", "pp", "tp")))
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    seq = cfg.model.seq_length
    with pytest.raises(ConfigError, match=rf"batch\['text'\] has shape \(2, 8, {seq}\); this gpt step takes "
                                          rf"\(micro-batches, rows, {seq + 1}\)"):
        _losses(steps, cfg, n=1, seq=seq - 1)  # one token short: it trained, silently


def test_model_shapes_are_checked_where_the_config_is_made():
    """The command line refused --num-layers 0; a library caller's ModelConfig(num_layers=0) reached a
    ZeroDivisionError in build_steps, and hidden_size=-128 passed resolve."""
    from jax3d.config import ModelConfig

    for field, value, words in [("num_layers", 0, "--num-layers 0 must be at least 1"),
                                ("hidden_size", -128, "--hidden-size -128 must be at least 1"),
                                ("seq_length", 64.0, "--seq-length 64.0 must be a whole number")]:
        with pytest.raises(ConfigError, match=words):
            ModelConfig(**{field: value})
    assert ModelConfig(hidden_size=np.int64(256), num_attention_heads=4).ffn_hidden_size == 1024  # a sweep's value
