"""Tensor parallel equals unsharded: TP 2, 4, 8 give the logits and gradients of one device."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from jax3d.parallel.mesh import MeshConfig
from jax3d.models import GPT, layers
from jax3d.parallel import ShardingRules, named_shardings, tree_specs
from tests.helpers import random_text, rel_err, tiny_model


def _loss(model, params, text):
    return model.loss(params, {"text": text})[0]


@pytest.fixture(scope="module")
def reference():
    cfg = tiny_model(vocab_size=512)
    model = GPT(cfg)  # no rules, no mesh: plain single-device code
    params = model.init(jax.random.key(0))
    text = random_text(4, cfg.seq_length, cfg.vocab_size)
    logits = jax.jit(model.logits)(params, text[:, :-1])
    grads = jax.jit(jax.grad(lambda p: _loss(model, p, text)))(params)
    return cfg, params, text, logits, grads


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_matches_one_device(reference, tp, sequence_parallel):
    _check_tensor_parallel(reference, tp, sequence_parallel)


def test_fused_loss_in_chunks_under_tensor_parallel(reference, monkeypatch):
    """The fused head and loss in 4 sequence chunks, vocab-parallel over 2 and batch-parallel over 4."""
    monkeypatch.setattr(layers, "LOSS_CHUNK_TOKENS", 16)
    assert layers.loss_chunks(*reference[2][:, 1:].shape) == 4
    _check_tensor_parallel(reference, 2, True)


def _check_tensor_parallel(reference, tp, sequence_parallel):
    cfg, params, text, ref_logits, ref_grads = reference
    mesh = MeshConfig(8 // tp, 1, tp).build()
    rules = ShardingRules.create(sequence_parallel)
    model = GPT(cfg, rules)
    specs = tree_specs(rules, model.logical_axes())
    shardings = named_shardings(mesh, specs)
    with jax.set_mesh(mesh):
        sharded = jax.device_put(params, shardings)
        assert sharded["blocks"]["mlp"]["up_kernel"].sharding.spec[-1] == "model"
        tokens = jax.device_put(text, NamedSharding(mesh, rules.spec(("batch", None))))
        logits = jax.jit(model.logits)(sharded, tokens[:, :-1])
        grads = jax.jit(jax.grad(lambda p: _loss(model, p, tokens)), out_shardings=shardings)(sharded)
    assert logits.sharding.spec[-1] == "model"  # vocab-parallel logits stay sharded
    assert rel_err(logits, ref_logits) < 1e-5
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        ref = ref_grads
        for k in path:
            ref = ref[k.key]
        assert rel_err(g, ref) < 1e-5, (path, rel_err(g, ref))


def test_cross_entropy_does_not_gather_vocab():
    """The compiled TP-8 loss and its gradient hold no full-vocabulary array on a device."""
    cfg = tiny_model(vocab_size=4096)
    mesh = MeshConfig(1, 1, 8).build()
    rules = ShardingRules.create()
    model = GPT(cfg, rules)
    specs = tree_specs(rules, model.logical_axes())
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    shardings = named_shardings(mesh, specs)
    text = jax.ShapeDtypeStruct((2, cfg.seq_length + 1), jnp.int32, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec()))
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.value_and_grad(lambda p, t: _loss(model, p, t))).lower(params, text).compile().as_text()
    # Per-device logits are (2, 16, 512); a gathered (.., 4096) f32 tensor would show up in the HLO.
    assert "f32[2,16,512]" in hlo
    assert "f32[2,16,4096]" not in hlo
