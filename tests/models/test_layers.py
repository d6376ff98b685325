"""The layers as a Flax user calls them: no sharding rules or mesh, dropout from Flax's 'dropout' stream."""
import jax
import jax.numpy as jnp
import numpy as np

from jax3d.models import Block, Embedding
from jax3d.parallel import ShardingRules
from tests.helpers import tiny_model


def test_dropout_follows_flax_rngs_and_an_explicit_rng_wins():
    cfg = tiny_model(hidden_dropout=0.1, attention_dropout=0.1)
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.hidden_size))
    block = Block(cfg)  # the default rules: no mesh in context, so no constraint
    v = block.init(jax.random.key(0), x)
    same_model = Block(cfg, ShardingRules.inactive())
    np.testing.assert_array_equal(block.apply(v, x), same_model.apply(v, x))

    det = block.apply(v, x, deterministic=False)  # no key at all: no dropout
    np.testing.assert_array_equal(det, block.apply(v, x))
    a = block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    assert float(jnp.abs(a - det).max()) > 1e-3
    np.testing.assert_array_equal(a, block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)}))
    assert float(jnp.abs(a - block.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(4)})).max()) > 1e-3
    np.testing.assert_array_equal(det, block.apply(v, x, deterministic=True, rngs={"dropout": jax.random.key(3)}))

    explicit = block.apply(v, x, None, jax.random.key(5), False)
    np.testing.assert_array_equal(explicit, block.apply(v, x, None, jax.random.key(5), False,
                                                        rngs={"dropout": jax.random.key(3)}))

    emb = Embedding(cfg)
    tokens = jnp.arange(32).reshape(2, 16) % cfg.vocab_size
    ev = emb.init(jax.random.key(0), tokens)
    assert float(jnp.abs(emb.apply(ev, tokens, deterministic=False, rngs={"dropout": jax.random.key(3)})
                         - emb.apply(ev, tokens)).max()) > 1e-3


def test_the_block_spec_takes_each_part_from_the_config_the_policy_and_fp8():
    """block_spec picks each part once: one GPU's kernels where the config has what they compute (GPT's biased
    QKV, tanh GELU, layer norm), the plain parts for Llama's (no biases, SwiGLU, RMSNorm) and everywhere off one
    GPU; FP8's projections and MLP under a recipe's format; the attention core from the config's override, else
    the policy's (cuDNN on GPUs, XLA's with fp16 in fp32 on CPUs)."""
    import dataclasses

    from jax3d.kernels import fp8_cast, fused_gelu, fused_norm, fused_qkv
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import spec
    from jax3d.models.presets import get_preset

    gpu, cpu = KernelPolicy.resolve("gpu", 1), KernelPolicy.resolve("cpu", 1)
    gpt, llama = tiny_model(), get_preset("llama-tiny")[0]
    s = spec.block_spec(gpt, gpu)
    assert s.norm == spec.FusedNorm(fused_norm.DEFAULT) and s.split_qkv == spec.FusedSplit(fused_qkv.DEFAULT)
    assert s.mlp == spec.FusedGeluMLP(fused_gelu.DEFAULT, spec.LeanMLP("gelu_tanh", ("mlp",)))
    assert s.project == spec.Projection() and s.positions is spec.no_positions
    assert s.attend == spec.Attend(spec.cudnn_where_16_bit, gpt.attention_dropout)
    s = spec.block_spec(llama, gpu)
    assert s.norm is spec.lean_layer_norm and s.split_qkv is spec.plain_split
    assert s.mlp == spec.LeanMLP("swiglu", (None, "mlp")) and s.positions == spec.Rotary(llama)
    s = spec.block_spec(gpt, cpu)
    assert (s.norm, s.split_qkv, s.mlp) == (spec.lean_layer_norm, spec.plain_split, spec.LeanMLP("gelu_tanh", ("mlp",)))
    assert s.attend.core == spec.F16InFP32(spec.xla_core)
    s = spec.block_spec(gpt, gpu, "hybrid")
    assert s.project == spec.FP8Projection("hybrid", fp8_cast.DEFAULT)
    assert s.mlp.fallback == spec.FP8MLP("gelu_tanh", ("mlp",))
    assert spec.block_spec(gpt, cpu, "e4m3").project == spec.FP8Projection("e4m3", None)
    assert spec.attention_core(dataclasses.replace(gpt, attention_impl="xla"), gpu) is spec.xla_core
    assert spec.attention_core(dataclasses.replace(gpt, attention_impl="cudnn"), gpu) is spec.cudnn_core


def test_a_block_with_the_cpus_parts_is_the_block_without_a_policy():
    """The parts a CPU run picks compute what the default Block computes (the parts are the same functions)."""
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import spec

    cfg = tiny_model()
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.hidden_size))
    v = Block(cfg).init(jax.random.key(0), x)
    np.testing.assert_array_equal(Block(cfg, spec=spec.block_spec(cfg, KernelPolicy.resolve("cpu", 8))).apply(v, x),
                                  Block(cfg).apply(v, x))


def test_a_training_block_refuses_a_kv_cache_and_the_decode_spec_takes_it():
    """A cache given to a block of training's spec is refused in a sentence (it would be ignored); the same
    parameters under the decode spec write the step's keys and values into it."""
    import pytest

    from jax3d.inference.cached_attention import decode_spec
    from jax3d.kernels.policy import KernelPolicy

    cfg = tiny_model()
    x = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden_size))
    params = Block(cfg).init(jax.random.key(0), x)
    k = jnp.zeros((1, cfg.kv_heads, 4, cfg.head_dim))
    cache = {"k": k, "v": k, "index": jnp.int32(0)}
    mask = jnp.ones((1, 1, 1, 4), bool)
    with pytest.raises(ValueError, match="decode_spec"):
        Block(cfg).apply(params, x, mask, None, True, cache)
    _, written = Block(cfg, spec=decode_spec(cfg, KernelPolicy.none())).apply(params, x, mask, None, True, cache)
    assert float(jnp.abs(written["k"][:, :, 0]).sum()) > 0 and float(jnp.abs(written["k"][:, :, 1:]).sum()) == 0
