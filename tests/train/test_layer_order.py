"""An interleaved or uneven pipeline keeps its layer stack in pipeline order in the train state: its runs
equal logical-order runs, padding rows stay zero, checkpoints hold logical order and restore bit-exactly
across orders, and the compiled step moves no parameters outside the tick loop."""
import warnings

import jax
import numpy as np
import optax
import pytest

from benchmarks.pipeline_comm import count_permutes
from jax3d.pipeline import make_schedule, program
from jax3d.checkpoint.checkpointer import Checkpointer
from jax3d.train.step import abstract_batch, abstract_state, build_steps
from tests.helpers import random_text, tiny_config
from jax3d.parallel.plan import Plan
from tests.helpers import as_plan

GB = 8


def layout(data, stage, model, schedule="1f1b", virtual=1, counts=(), zero=1, layers=4):
    """The tiny GPT on one layout, micro-batch 1 of a global batch of 8."""
    return tiny_config(data=data, stage=stage, model=model, zero=zero, micro=1, global_batch=GB,
                       model_kw={"num_layers": layers}, pipeline_schedule=schedule, virtual_stages=virtual,
                       pipeline_layout=tuple(counts))


def batch(steps, i):
    text = random_text(GB, steps.cfg.model.seq_length, steps.cfg.model.vocab_size, seed=100 + i)
    return {"text": jax.device_put(text.reshape(steps.accum_steps, -1, text.shape[-1]), steps.batch_sharding())}


def run(steps, state, start, end, ck=None):
    """Steps start+1 .. end; (losses, grad norms, state)."""
    losses, norms = [], []
    for i in range(start, end):
        state, m = steps.train_step(state, batch(steps, i))
        losses.append(float(m["loss"]))
        norms.append(float(m["grad_norm"]))
        if ck is not None:
            ck.maybe_save(i + 1, state, {"consumed_samples": (i + 1) * GB})
    return np.array(losses), np.array(norms), state


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_close(a, b, rtol=1e-5, atol=1e-6):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


def assert_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def plain_and_interleaved():
    """The (2, 2, 2) ZeRO-1 steps for 1F1B and for interleaved (v = 2), built and compiled once for the
    module: checkpoint paths live in the Checkpointer's config, not in the step."""
    return build_steps(*as_plan(layout(2, 2, 2))), build_steps(*as_plan(layout(2, 2, 2, "interleaved", 2)))


def test_interleaved_run_equals_non_interleaved(plain_and_interleaved):
    """(2, 2, 2), ZeRO-1: an interleaved (v = 2) run's loss curve, grad norms, params and AdamW moments
    in logical order are the 1F1B run's."""
    ref, inter = plain_and_interleaved
    assert ref.order.logical and not inter.order.logical
    ref_l, ref_n, ref_s = run(ref, ref.init_state(0), 0, 5)
    l, n, s = run(inter, inter.init_state(0), 0, 5)
    np.testing.assert_allclose(l, ref_l, rtol=1e-5)
    np.testing.assert_allclose(n, ref_n, rtol=1e-5)
    assert_close(host(inter.logical_state(s)), host(ref_s))
    # the state really is in pipeline order: stage 0 holds layers 0 and 2
    first = host(inter.init_state(0).params["blocks"]["mlp"]["up_kernel"])
    logical = host(ref.init_state(0).params["blocks"]["mlp"]["up_kernel"])
    assert_equal(first, logical[[0, 2, 1, 3]])


def test_uneven_padding_rows_stay_zero():
    """(1, 2, 1) with 3 + 1 layers: the state's stack is 3 rows a stage, sharded on `stage`; the two
    padding rows and their AdamW moments stay exactly zero under weight decay and clipping, and the run
    equals the even 2 + 2 split."""
    ref = build_steps(*as_plan(layout(1, 2, 1, zero=0)))
    uneven = build_steps(*as_plan(layout(1, 2, 1, counts=(3, 1), zero=0)))
    assert uneven.cfg.optim.weight_decay > 0 and uneven.cfg.optim.clip_grad > 0
    assert uneven.state_shardings.params["blocks"]["mlp"]["up_kernel"].spec[0] == "stage"
    ref_l, ref_n, ref_s = run(ref, ref.init_state(0), 0, 4)
    l, n, s = run(uneven, uneven.init_state(0), 0, 4)
    np.testing.assert_allclose(l, ref_l, rtol=1e-5)
    np.testing.assert_allclose(n, ref_n, rtol=1e-5)  # the norm does not see the padding
    assert_close(host(uneven.logical_state(s)), host(ref_s))
    rows = uneven.order.layout.rows.reshape(-1)
    assert (rows < 0).sum() == 2
    mu, nu = (host(optax.tree_utils.tree_get(s.opt_state, k)) for k in ("mu", "nu"))
    for tree in (host(s.params), mu, nu):
        for leaf in jax.tree.leaves(tree["blocks"]):
            assert leaf.shape[0] == 6
            assert not leaf[rows < 0].any() and leaf[rows >= 0].any()


def test_checkpoints_restore_across_layer_orders(plain_and_interleaved, tmp_path):
    """Saved by an interleaved run, a checkpoint restores bit-exactly onto (2, 2, 2) 1F1B and onto the
    interleaved layout itself; the 1F1B run resumes like the uninterrupted interleaved one, and its own
    checkpoint restores bit-exactly into the interleaved order."""
    plain, inter = plain_and_interleaved
    d_inter, d_plain = str(tmp_path / "inter"), str(tmp_path / "plain")
    cfg_i = layout(2, 2, 2, "interleaved", 2)[0].replace(train={"save": d_inter, "save_interval": 3})
    ck = Checkpointer(cfg_i, to_logical=inter.logical_state)
    _, _, s = run(inter, inter.init_state(0), 0, 3, ck)
    at3 = host(s)
    at3_logical = host(inter.logical_state(s))
    losses, _, s = run(inter, s, 3, 6)
    ck.wait()
    final = host(inter.logical_params(s.params))

    # the interleaved layout restores its own checkpoint into pipeline order, bit for bit
    back, consumed = Checkpointer(cfg_i.replace(train={"load": d_inter, "ckpt_step": 3})).restore(inter)
    assert consumed == 3 * GB
    assert_equal(host(back), at3)

    # onto 1F1B: the logical state bit for bit, then the same curve as the uninterrupted run
    cfg_p = layout(2, 2, 2)[0].replace(train={"load": d_inter, "ckpt_step": 3, "save": d_plain, "save_interval": 6})
    ck_p = Checkpointer(cfg_p, to_logical=plain.logical_state)
    state, _ = ck_p.restore(plain)
    assert_equal(host(state), at3_logical)
    resumed, _, state = run(plain, state, 3, 6, ck_p)
    ck_p.close()
    np.testing.assert_allclose(resumed, losses, rtol=1e-5)
    assert_close(host(state.params), final)

    # and back: the 1F1B run's checkpoint restores into the interleaved order, bit for bit
    plain_at6 = host(state)
    back, _ = Checkpointer(cfg_i.replace(train={"load": d_plain, "ckpt_step": 6})).restore(inter)
    assert_equal(host(inter.logical_state(back)), plain_at6)


def _outside_loop(cfg, mesh_cfg, mesh):
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    text = steps.train_step.lower(abstract_state(steps), abstract_batch(steps, steps.model.sample_shapes())
                                  ).compile().as_text()
    par = cfg.parallel
    sched = make_schedule(par.pipeline_schedule, mesh_cfg.stage, steps.accum_steps, par.virtual_stages)
    sends = program.lower(sched).sends
    return count_permutes(text, sched.ticks, int(sends[:, 0].sum()), int(sends[:, 1].sum()))


@pytest.mark.parametrize("kind", ["interleaved", "uneven"])
def test_step_moves_no_params_outside_the_tick_loop(kind):
    """From the compiled train step's HLO: the only collective-permutes are the loop's own sends, and
    nothing outside the loop gathers or permutes the layer stack (the per-step reorder compiled to
    all-gathers on the CPU)."""
    args = ("interleaved", 2) if kind == "interleaved" else ("1f1b", 1, (3, 1))
    static, executed, outside, others = _outside_loop(*layout(1, 2, 1, *args, zero=0))
    assert static >= 2 and executed > 0  # the loop's sends are seen
    assert outside == 0
    assert set(others) <= {"all-reduce"}, others


def test_logical_specs_change_only_the_layer_stack():
    """An uneven split's logical stack moves `stage` to the first other dim it divides, beside `model`
    (or stays replicated over it where none does); the embedding keeps its `model` split."""
    from types import SimpleNamespace

    from jax.sharding import PartitionSpec as P

    from jax3d.pipeline.layout import make_layout
    from jax3d.train.layer_order import LayerOrder

    order = LayerOrder(make_layout(5, 2, 1, [3, 2]), optimizer=None)
    mesh = SimpleNamespace(shape={"data": 1, "stage": 2, "model": 2})
    specs = {"blocks": {"w": P("stage", None, "model"), "b": P("stage", None)}, "embed": {"word": P("model", None)}}
    params = {"blocks": {"w": np.zeros((6, 3, 8)), "b": np.zeros((6, 3))}, "embed": {"word": np.zeros((8, 4))}}
    out = order.moved_logical_specs(specs, params, mesh)
    assert out["blocks"]["w"] == P(None, None, ("model", "stage"))  # dim 1 (3) can't take it; dim 2 can
    assert out["blocks"]["b"] == P(None, None)  # nowhere to go: replicated over `stage`
    assert out["embed"]["word"] == P("model", None)


@pytest.mark.parametrize("mesh, zero", [((1, 2, 1), 0), ((2, 2, 2), 1)])
def test_uneven_logical_copy_takes_no_more_memory_than_the_state(tmp_path, mesh, zero):
    """3 + 2 layers, which `stage` can't split in logical order: the logical copy that saves and restores
    make keeps `stage` on another dim of the stack (beside `model` or ZeRO's `data` where they are), so a
    device holds no more of it than of the state; its checkpoint restores onto the 2 + 3 split bit for
    bit."""
    cfg = layout(*mesh, counts=(3, 2), zero=zero, layers=5)
    uneven = build_steps(*as_plan(cfg))
    state = uneven.init_state(0)
    logical = uneven.logical_state(state)

    def per_device_bytes(tree, device):
        return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)

    for device in uneven.mesh.devices.flat:
        assert per_device_bytes(logical, device) <= per_device_bytes(state, device)
    assert "stage" in str(logical.params["blocks"]["mlp"]["up_kernel"].sharding.spec)

    with pytest.raises(ValueError, match="pipeline order"):  # saved without the caller's conversion: refused
        Checkpointer(cfg[0].replace(train={"save": str(tmp_path / "refused")})).save(1, state, {"consumed_samples": GB})
    ck = Checkpointer(cfg[0].replace(train={"save": str(tmp_path), "save_interval": 1}), to_logical=uneven.logical_state)
    ck.maybe_save(1, state, {"consumed_samples": GB}, force=True)
    ck.close()
    other_cfg = layout(*mesh, counts=(2, 3), zero=zero, layers=5)
    other = build_steps(*as_plan(other_cfg))
    with warnings.catch_warnings(record=True) as caught:  # XLA's "donated buffers were not usable"
        warnings.simplefilter("always")
        back, _ = Checkpointer(other_cfg[0].replace(train={"load": str(tmp_path), "ckpt_step": 1})).restore(other)
    assert not [w for w in caught if "donated" in str(w.message)]
    assert_equal(host(other.logical_state(back)), host(logical))


def test_uneven_eval_holds_a_share_of_the_stack_and_matches_one_stage():
    """3 + 2 layers: the eval step's compute copy keeps `stage` on another dim of the logical stack, so no
    device materialises the whole stack (it did: an f32[5, 64, 256] up-projection per device); its loss
    equals the same parameters' on one stage."""
    import re

    uneven = build_steps(*as_plan(layout(1, 2, 1, counts=(3, 2), zero=0, layers=5)))
    one = build_steps(*as_plan(layout(1, 1, 1, zero=0, layers=5)))
    state = uneven.init_state(0)
    b = batch(uneven, 0)
    hlo = uneven.eval_step.lower(state.params, b).compile().as_text()
    d, f = uneven.cfg.model.hidden_size, uneven.cfg.model.ffn_hidden_size
    assert not re.search(rf"\w+\[5,{d},{f}\]", hlo)
    got = float(uneven.eval_step(state.params, b)["loss"])
    want = float(one.eval_step(one.init_state(0).params, batch(one, 0))["loss"])
    np.testing.assert_allclose(got, want, rtol=1e-6)
