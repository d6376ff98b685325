"""Pipelined equals sequential for the real GPT: every schedule, on (1, 4, 1), (2, 2, 2), (1, 2, 4) and
(4, 2, 1), with ZeRO 0-3 and every --recompute, gives the loss and gradients of the non-pipelined model
(fp32, 1e-5 relative).

Compile time dominates and grows with the layers a stage runs, so the model has 4 layers, or 8 where
4 stages x 2 virtual stages need them."""
import jax
import pytest

from jax3d.train.step import build_steps
from tests.helpers import random_text, rel_err, tiny_config
from jax3d.parallel.plan import Plan

GB = 8


def _layers(stage=1, virtual=1):
    return max(4, stage * virtual)


def _loss_and_grads(data, stage, model, schedule="1f1b", zero=0, virtual=1, dropout=0.0, recompute="none",
                    with_steps=False, layers=None, sequence_parallel=False):
    layers = layers or _layers(stage, virtual)
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, zero=zero, micro=1, global_batch=GB,
                                      pipeline_schedule=schedule, virtual_stages=virtual,
                                      sequence_parallel=sequence_parallel,
                                      model_kw=dict(num_layers=layers, hidden_dropout=dropout,
                                                    attention_dropout=dropout, recompute=recompute))
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(3)
    text = random_text(GB, cfg.model.seq_length, cfg.model.vocab_size, seed=5)
    batch = {"text": jax.device_put(text.reshape(steps.accum_steps, -1, text.shape[-1]), steps.batch_sharding())}
    loss, grads = steps.loss_and_grads(state.params, batch)
    if with_steps:
        return float(loss), jax.device_get(grads), steps, grads
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def sequential():
    """The (8, 1, 1) model's loss and gradients, by layer count, each computed once for the module."""
    refs = {}

    def get(layers):
        if layers not in refs:
            refs[layers] = _loss_and_grads(8, 1, 1, layers=layers)
        return refs[layers]
    return get


# Each case compiles its own program, so the cases are the distinct ones. ZeRO-1 shards only the optimizer
# state, which loss_and_grads never touches (and with one data shard every stage is ZeRO-0): one stage per
# mesh. GPipe runs 1F1B's passes in another order, which tests/pipeline/test_pipeline_loop.py checks on every mesh
# with the toy model: one mesh here. ZeRO-3 (the stack gathered per chunk inside the loop, gradients
# sharded) runs every schedule; ZeRO-2 (gradients sharded, the stack gathered before the loop) one. Each
# schedule runs once without ZeRO's sharding beside a mesh axis of its own: GPipe and ZB-H1 on (1, 4, 1), 1F1B with
# data and tensor parallelism on (2, 2, 2), interleaved with tensor parallelism on (1, 2, 4) (ZB-H1 with tensor
# parallelism: tests/train/test_llama_layouts.py's (1, 2, 4) and tests/models/test_bert.py's (2, 2, 2) train steps).
CASES = [((1, 4, 1), "gpipe", 0), ((1, 4, 1), "zb-h1", 0), ((2, 2, 2), "1f1b", 1), ((1, 2, 4), "interleaved", 0)]
CASES += [((4, 2, 1), "zb-h1", 2)] + [((4, 2, 1), sched, 3) for sched in ["1f1b", "interleaved", "zb-h1"]]
FAST = {((2, 2, 2), "1f1b", 1), ((1, 4, 1), "zb-h1", 0), ((1, 2, 4), "interleaved", 0), ((1, 4, 1), "gpipe", 0),
        ((4, 2, 1), "zb-h1", 2), ((4, 2, 1), "1f1b", 3)}


@pytest.mark.parametrize("mesh, schedule, zero", [
    pytest.param(*c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_pipeline_matches_sequential(sequential, mesh, schedule, zero):
    virtual = 2 if schedule == "interleaved" else 1
    ref_loss, ref_grads = sequential(_layers(mesh[1], virtual))
    loss, grads = _loss_and_grads(*mesh, schedule, zero, virtual)
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, flat_ref[path]) < 1e-5, (jax.tree_util.keystr(path), rel_err(g, flat_ref[path]))


@pytest.fixture(scope="module")
def sequential_dropout():
    """The (1, 1, 8) model's loss and gradients with dropout 0.1: one data shard, like the pipelines below."""
    return _loss_and_grads(1, 1, 8, dropout=0.1)


@pytest.mark.parametrize("mesh, schedule", [((1, 4, 1), "1f1b"), ((1, 2, 4), "zb-h1")])
def test_pipeline_dropout_matches_sequential(sequential, sequential_dropout, mesh, schedule):
    """With one data shard the pipeline draws the sequential model's dropout masks, embedding included."""
    ref_loss, ref_grads = sequential_dropout
    loss, grads = _loss_and_grads(*mesh, schedule, dropout=0.1)
    no_dropout, _ = sequential(_layers())  # what the pipeline gives without dropout (the test above)
    assert abs(loss - no_dropout) > 1e-3  # dropout is really on
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, flat_ref[path]) < 1e-5, (jax.tree_util.keystr(path), rel_err(g, flat_ref[path]))


@pytest.mark.parametrize("mesh, schedule, zero", [
    ((2, 2, 2), "1f1b", 1), ((1, 2, 4), "zb-h1", 0),
    pytest.param((1, 2, 2), "interleaved", 0, marks=pytest.mark.slow)])
def test_sequence_parallel_pipeline_matches_sequential(sequential, mesh, schedule, zero):
    """Sequence parallelism inside the pipeline: each stage's input split over the sequence on `model`,
    the embedding and head inside branches only the end stages take (it once deadlocked there). With ZeRO-3:
    tests/models/test_bert.py's (2, 2, 2) ZB-H1 train step."""
    virtual = 2 if schedule == "interleaved" else 1
    _assert_close(*_loss_and_grads(*mesh, schedule, zero, virtual, sequence_parallel=True),
                  *sequential(_layers(mesh[1], virtual)))


def test_sequence_parallel_pipeline_dropout_matches_sequential(sequential_dropout):
    """Dropout masks drawn on sequence-split activations are the sequential model's."""
    _assert_close(*_loss_and_grads(1, 2, 4, "1f1b", dropout=0.1, sequence_parallel=True), *sequential_dropout)


def _assert_close(loss, grads, ref_loss, ref_grads):
    assert abs(loss - ref_loss) / abs(ref_loss) < 1e-5
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_grads))
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
        assert rel_err(g, flat_ref[path]) < 1e-5, (jax.tree_util.keystr(path), rel_err(g, flat_ref[path]))


@pytest.mark.parametrize("recompute, schedule", [("selective", "1f1b"), ("full", "zb-h1")])
def test_pipeline_recompute_matches_sequential(sequential, recompute, schedule):
    """--recompute decides what the pipeline's F stores, and the gradients stay the sequential model's
    (--recompute none is what every case of test_pipeline_matches_sequential runs)."""
    virtual = 2 if schedule == "interleaved" else 1
    _assert_close(*_loss_and_grads(1, 2, 1, schedule, virtual=virtual, recompute=recompute),
                  *sequential(_layers(2, virtual)))


def test_zero2_pipeline_grads_sharded_over_data():
    """ZeRO-2 under pipelining: the step's gradients leave the loop already sharded over `data`."""
    _, _, steps, grads = _loss_and_grads(4, 2, 1, "zb-h1", zero=2, with_steps=True)  # a case above's program
    up = grads["blocks"]["mlp"]["up_kernel"]
    assert "data" in up.sharding.spec and "stage" in up.sharding.spec
    shard = up.addressable_shards[0].data.shape
    assert shard[0] * 2 == up.shape[0] and any(s * 4 == n for s, n in zip(shard, up.shape))
