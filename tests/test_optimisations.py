"""The step's speed optimisations change no maths: each one off gives the same loss and gradients in fp32,
and in bf16 the loss stays within bf16 round-off of the fp32 reference."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from jax3d.config import OPTIMISATIONS, ConfigError
from jax3d.models import GPT, layers
from tests.helpers import assert_same_loss_and_grads, gpt_loss_and_grads, random_text, rel_err, tiny_model


def _loss_and_grads(cfg, params, text, dtype=jnp.float32):
    model = GPT(cfg)

    def loss(p):
        p = jax.tree.map(lambda a: a.astype(dtype), p)
        return model.loss(p, {"text": text})[0]
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_model(vocab_size=384, num_layers=3, num_attention_heads=4)
    params = GPT(cfg).init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, cfg.vocab_size)
    loss, grads = _loss_and_grads(cfg, params, text)
    return cfg, params, text, loss, grads


@pytest.mark.parametrize("name", sorted(OPTIMISATIONS))
def test_each_optimisation_off_gives_the_same_loss_and_grads(reference, name):
    cfg, params, text, ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(dataclasses.replace(cfg, ablate=(name,)), params, text)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))[path]
        assert rel_err(g, ref) < 1e-5, (name, jax.tree_util.keystr(path))


def test_fused_loss_in_chunks_matches_the_unfused_loss(monkeypatch):
    """4 sequence chunks, a loss mask with holes and a vocabulary padded past the tokenizer's."""
    cfg = tiny_model(vocab_size=384, num_layers=2, unpadded_vocab_size=300)
    params = GPT(cfg).init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, 300)
    mask = (jax.random.uniform(jax.random.key(1), (4, cfg.seq_length)) > 0.3).astype(jnp.float32)

    def loss_and_grads(cfg):
        return gpt_loss_and_grads(cfg, params, {"text": text, "loss_mask": mask})

    ref_loss, ref_grads = loss_and_grads(dataclasses.replace(cfg, ablate=("fused_loss",)))
    monkeypatch.setattr(layers, "LOSS_CHUNK_TOKENS", cfg.seq_length)
    assert layers.loss_chunks(4, cfg.seq_length) == 4
    loss, grads = loss_and_grads(cfg)
    assert_same_loss_and_grads((loss, grads), (ref_loss, ref_grads))


def test_bf16_step_stays_near_the_fp32_loss(reference):
    cfg, params, text, ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(cfg, params, text, jnp.bfloat16)
    assert abs(float(loss) - float(ref_loss)) < 2e-2 * float(ref_loss)
    assert rel_err(grads["embed"]["word"].astype(jnp.float32), ref_grads["embed"]["word"]) < 5e-2


def test_unknown_ablation_is_one_clear_error():
    with pytest.raises(ConfigError, match="unknown optimisation"):
        tiny_model(ablate=("fast_mode",))


def test_forward_mode_with_the_fused_loss_off_gives_the_gradient_along_a_direction(reference):
    """GPT's docstring: the fused loss takes reverse mode only, and with it ablated `jax.jvp` works; its
    tangent along a random direction equals the fused model's gradient dotted with that direction."""
    cfg, params, text, loss, grads = reference
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    direction = jax.tree.unflatten(tree, [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])
    fused = GPT(cfg)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda p: fused.loss(p, {"text": text})[0], (params,), (direction,))
    plain = GPT(dataclasses.replace(cfg, ablate=("fused_loss",)))
    value, tangent = jax.jit(lambda p, t: jax.jvp(lambda q: plain.loss(q, {"text": text})[0], (p,), (t,)))(
        params, direction)
    want = sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    assert rel_err(value, loss) < 1e-6
    assert rel_err(tangent, want) < 1e-4
