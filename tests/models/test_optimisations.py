"""The step's speed techniques change no maths: the chunked LM loss (gradients computed in its forward pass)
equals the loss over the whole logits in value and gradient, and in bf16 the loss stays within bf16
round-off of the fp32 reference. The benchmark switches the model once carried are gone, and checkpoints
that recorded them still read."""
import jax
import jax.numpy as jnp
import pytest

from jax3d.config import Config, ModelConfig, config_from_dict
from jax3d.models import GPT, layers
from tests.helpers import assert_same_loss_and_grads, random_text, rel_err, tiny_model


def _loss_and_grads(cfg, params, text, dtype=jnp.float32):
    model = GPT(cfg)

    def loss(p):
        p = jax.tree.map(lambda a: a.astype(dtype), p)
        return model.loss(p, {"text": text})[0]
    return jax.jit(jax.value_and_grad(loss))(params)


def _whole_logits_loss(model, text, mask=None):
    """The GPT's mean token loss through `logits` and `cross_entropy_sum`: no chunks, no custom VJP."""
    mask = jnp.ones(text[:, 1:].shape) if mask is None else mask

    def loss(p):
        total, count = layers.cross_entropy_sum(model.logits(p, text[:, :-1]), text[:, 1:], mask,
                                                model.cfg.unpadded_vocab_size)
        return total / jnp.maximum(count, 1.0)
    return loss


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_model(vocab_size=384, num_layers=3, num_attention_heads=4)
    params = GPT(cfg).init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, cfg.vocab_size)
    loss, grads = _loss_and_grads(cfg, params, text)
    return cfg, params, text, loss, grads


def test_fused_loss_in_chunks_matches_the_whole_logits_loss(monkeypatch):
    """4 sequence chunks, a loss mask with holes and a vocabulary padded past the tokenizer's."""
    cfg = tiny_model(vocab_size=384, num_layers=2, unpadded_vocab_size=300)
    model = GPT(cfg)
    params = model.init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, 300)
    mask = (jax.random.uniform(jax.random.key(1), (4, cfg.seq_length)) > 0.3).astype(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = jax.jit(jax.value_and_grad(_whole_logits_loss(model, text, mask)))(params)
        monkeypatch.setattr(layers, "LOSS_CHUNK_TOKENS", cfg.seq_length)
        assert layers.loss_chunks(4, cfg.seq_length) == 4
        got = jax.jit(jax.value_and_grad(lambda p: model.loss(p, {"text": text, "loss_mask": mask})[0]))(params)
    assert_same_loss_and_grads(got, ref)


def test_bf16_step_stays_near_the_fp32_loss(reference):
    cfg, params, text, ref_loss, ref_grads = reference
    loss, grads = _loss_and_grads(cfg, params, text, jnp.bfloat16)
    assert abs(float(loss) - float(ref_loss)) < 2e-2 * float(ref_loss)
    assert rel_err(grads["embed"]["word"].astype(jnp.float32), ref_grads["embed"]["word"]) < 5e-2


def test_forward_mode_through_the_whole_logits_gives_the_gradient_along_a_direction(reference):
    """GPT's docstring: its loss takes reverse mode only, and `cross_entropy_sum` of `logits` takes `jax.jvp`;
    that tangent along a random direction equals the loss's gradient dotted with the direction."""
    cfg, params, text, loss, grads = reference
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    direction = jax.tree.unflatten(tree, [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, leaves)])
    model = GPT(cfg)
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda p: model.loss(p, {"text": text})[0], (params,), (direction,))
    plain = _whole_logits_loss(model, text)
    value, tangent = jax.jit(lambda p, t: jax.jvp(plain, (p,), (t,)))(params, direction)
    want = sum(jnp.vdot(g, t) for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    assert rel_err(value, loss) < 1e-6
    assert rel_err(tangent, want) < 1e-4


def test_a_checkpoint_that_recorded_the_removed_switches_still_reads():
    """Checkpoints saved before the switches were removed hold `ablate` and `kernel_tunings` in their model
    config; the config rebuilt from them is the one without."""
    saved = Config(model=tiny_model()).to_dict()
    assert "ablate" not in saved["model"] and "kernel_tunings" not in saved["model"]
    saved["model"].update(ablate=["fused_loss"], kernel_tunings=[["fused_gelu", "cols_fwd=2048"]])
    assert config_from_dict(saved).model == tiny_model()
    with pytest.raises(TypeError):  # a library caller's old keyword is an error, not silently ignored
        ModelConfig(ablate=("fused_loss",))
