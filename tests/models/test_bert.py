"""BERT under tensor, data and pipeline parallelism matches the (8, 1, 1) run step for step."""
import jax
import numpy as np
import pytest

from jax3d.train.step import build_steps
from tests.helpers import tiny_config
from jax3d.parallel.plan import Plan

SEQ, VOCAB, BATCH, STEPS = 16, 256, 8, 10


def bert_batch(seed):
    """A batch with Megatron's BERT sample layout: padding, two segments, ~15% masked positions."""
    r = np.random.RandomState(seed)
    pad = (np.arange(SEQ)[None] < r.randint(SEQ // 2, SEQ + 1, (BATCH, 1))).astype(np.int32)
    return {"text": r.randint(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
            "types": np.repeat((np.arange(SEQ)[None] > SEQ // 2).astype(np.int32), BATCH, 0),
            "labels": r.randint(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
            "loss_mask": ((r.rand(BATCH, SEQ) < 0.15) * pad).astype(np.int32),
            "padding_mask": pad, "is_random": r.randint(0, 2, (BATCH,)).astype(np.int32)}


def train_bert(data, stage, model, schedule="1f1b", zero=0, virtual=1, sequence_parallel=False, dropout=0.0,
               num_steps=STEPS):
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, zero=zero, micro=1, global_batch=BATCH,
                                      pipeline_schedule=schedule, virtual_stages=virtual,
                                      sequence_parallel=sequence_parallel,
                                      model_kw=dict(num_layers=4, model_type="bert", seq_length=SEQ, vocab_size=VOCAB,
                                                    hidden_dropout=dropout, attention_dropout=dropout))
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(1)
    out = []
    for i in range(num_steps):
        b = {k: jax.device_put(v.reshape(steps.accum_steps, -1, *v.shape[1:]), steps.batch_sharding())
             for k, v in bert_batch(i % 4).items()}
        state, m = steps.train_step(state, b)
        out.append([float(m[k]) for k in ("loss", "lm_loss", "sop_loss")])
    return np.array(out)


@pytest.fixture(scope="module")
def reference():
    return train_bert(8, 1, 1)


def test_reference_learns(reference):
    assert reference[-1, 0] < reference[0, 0] - 0.3


# BERT's own parts (segment types, the padding mask, the sentence-order head) under each kind of parallelism;
# each layout compiles its own step, so few layouts cover them all: the schedules themselves are checked on every
# mesh in tests/pipeline/test_pipeline_gpt.py (GPipe among them), pure tensor parallelism in tests/parallel/test_tensor_parallel.py.
# - (2, 2, 2) ZB-H1, ZeRO-3, sequence parallelism: data, pipeline and tensor parallelism at once, ZeRO-3's
#   sharded parameters, sequence-split activations inside the pipeline;
# - (1, 2, 1) interleaved: two virtual stages a device;
# - (2, 2, 2) 1F1B, ZeRO-1: test_bert_dropout_layouts_match below (with dropout on).
@pytest.mark.parametrize("layout", [
    (2, 2, 2, "zb-h1", 3, 1, True), (1, 2, 1, "interleaved", 0, 2),
], ids=["222-zbh1-zero3-sp", "121-interleaved"])
def test_bert_layouts_match(reference, layout):
    data, stage, model, schedule, *rest = layout
    zero, virtual, sequence_parallel = (list(rest) + [0, 1, False][len(rest):])
    losses = train_bert(data, stage, model, schedule, zero, virtual, sequence_parallel)
    np.testing.assert_allclose(losses, reference, atol=1e-3)


def test_bert_dropout_layouts_match(reference):
    """Dropout on, the pipelined tensor-parallel run, (2, 2, 2) 1F1B with ZeRO-1, draws the (8, 1, 1) run's masks
    (jax3d.dropout_keys)."""
    ref = train_bert(8, 1, 1, dropout=0.1, num_steps=3)
    assert np.abs(ref - reference[:3]).max() > 1e-3  # dropout is really on
    np.testing.assert_allclose(train_bert(2, 2, 2, "1f1b", 1, dropout=0.1, num_steps=3), ref, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's fused attention needs a GPU")
def test_cudnn_attention_takes_the_padding_mask():
    """In bf16 on a GPU, BERT's attention is cuDNN's fused kernel, which takes the padding mask as a bias
    over (query, key) pairs. On a padded batch its loss and gradients are as close to the fp32 model's
    (XLA's attention) as bf16 with XLA's attention is."""
    import dataclasses

    import jax.numpy as jnp

    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import build_model
    from jax3d.models.spec import attention_core, cudnn_where_16_bit
    from tests.helpers import rel_err

    cfg, _, _ = tiny_config(model_kw=dict(num_layers=2, model_type="bert", seq_length=SEQ, vocab_size=VOCAB,
                                          hidden_size=128, num_attention_heads=2))
    mcfg = cfg.model
    kernels = KernelPolicy.resolve(jax.default_backend(), 1)  # one GPU's: cuDNN's attention where "auto"
    assert attention_core(mcfg, kernels) is cudnn_where_16_bit
    batch = {k: jnp.asarray(v) for k, v in bert_batch(0).items()}
    assert batch["padding_mask"].min() == 0  # some keys are padding
    params = build_model(mcfg).init(jax.random.key(0))

    def loss_and_grads(impl, dtype):
        model = build_model(dataclasses.replace(mcfg, attention_impl=impl), kernels=kernels)
        p = jax.tree.map(lambda a: a.astype(dtype), params)
        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.value_and_grad(lambda p: model.loss(p, batch)[0]))(p)

    exact_loss, exact = loss_and_grads("xla", jnp.float32)
    (cudnn_loss, cudnn), (xla_loss, xla) = loss_and_grads("auto", jnp.bfloat16), loss_and_grads("xla", jnp.bfloat16)
    assert abs(float(cudnn_loss) - float(exact_loss)) <= 2 * abs(float(xla_loss) - float(exact_loss)) + 1e-2
    for c, x, e in zip(jax.tree.leaves(cudnn), jax.tree.leaves(xla), jax.tree.leaves(exact)):
        assert rel_err(c, e) <= 2 * rel_err(x, e) + 1e-2
