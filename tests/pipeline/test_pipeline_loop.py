"""Pipelined value-and-grad against jax.value_and_grad of the sequential model."""

import re
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d import dropout_keys
from jax3d.pipeline import (PipelineError, from_pipeline_order, make_layout, make_schedule,
                            pipeline_value_and_grad, to_pipeline_order)
from tests import pipeline_toy as toy

RTOL = 1e-5


def _mesh(shape):
    return jax.make_mesh(shape, ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def _check(shape, name, v=1, layers=None, layout=None, rng=None, m=None):
    mesh = _mesh(shape)
    p = shape[1]
    m = m or 2 * p
    layers = layers or max(4, p * v)  # few layers: compile time dominates these tests
    stacked, shared = toy.init(jax.random.key(1), layers=layers)
    mbs = toy.microbatches(jax.random.key(2), m=m, batch=4, seq=8)
    sched = make_schedule(name, p, m, v)
    with jax.set_mesh(mesh):
        kw = {} if layout is None else {"layers_per_virtual_stage": layout}
        loss, aux, g_st, g_sh = toy.pipelined(mesh, sched, **kw)(stacked, shared, mbs, rng)
        ref = jax.jit(jax.value_and_grad(lambda a, b: toy.sequential_loss(a, b, mbs, rng),
                                         argnums=(0, 1), has_aux=True))
        (r_loss, r_aux), (r_st, r_sh) = ref(stacked, shared)
    assert _rel(loss, r_loss) < RTOL
    for key in r_aux:
        assert _rel(aux[key], r_aux[key]) < RTOL
    for got, want in ((g_st, r_st), (g_sh, r_sh)):
        for key in want:
            assert got[key].shape == want[key].shape
            assert _rel(got[key], want[key]) < RTOL, (key, _rel(got[key], want[key]))


# Every schedule on (2, 2, 2), GPipe on every mesh. 1F1B, ZB-H1 and interleaved on (1, 4, 1) and (1, 2, 4) are
# cases of tests/pipeline/test_pipeline_gpt.py, the real GPT through this loop against its sequential model.
@pytest.mark.parametrize("shape,name,v", [
    ((1, 4, 1), "gpipe", 1), ((2, 2, 2), "gpipe", 1), ((1, 2, 4), "gpipe", 1),
    ((2, 2, 2), "1f1b", 1), ((2, 2, 2), "zb-h1", 1), ((2, 2, 2), "interleaved", 2),
])
def test_pipelined_equals_sequential(shape, name, v):
    _check(shape, name, v)


@pytest.mark.parametrize("shape,name,v,layout", [
    ((1, 4, 1), "1f1b", 1, [1, 3, 2, 1]),
    ((2, 2, 2), "zb-h1", 1, [5, 2]),
    ((1, 2, 4), "interleaved", 2, [2, 1, 3, 1]),
])
def test_uneven_layers_with_layout(shape, name, v, layout):
    _check(shape, name, v, layers=7, layout=layout)


@pytest.mark.parametrize("shape,name,v", [
    ((1, 4, 1), "zb-h1", 1),
    pytest.param((1, 2, 4), "interleaved", 2, marks=pytest.mark.slow),
])
def test_dropout_keys_match_sequential(shape, name, v):
    _check(shape, name, v, rng=jax.random.key(7))


def test_per_sample_keys_match_sequential_at_data_2():
    """One key per sample ((m, batch), jax3d.dropout_keys): with two data shards the pipeline draws the
    sequential model's masks (one key is folded with the data shard there, so it does not)."""
    keys = dropout_keys.sample_keys(jax.random.key(7), jnp.arange(16).reshape(4, 4))
    _check((2, 2, 2), "1f1b", rng=keys, m=4)


def test_keys_of_the_wrong_shape_are_named():
    mesh = _mesh((2, 2, 2))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=4, batch=4, seq=8)
    keys = dropout_keys.sample_keys(jax.random.key(7), jnp.arange(16).reshape(4, 4))
    with jax.set_mesh(mesh):
        for bad in (keys.reshape(-1), keys[:, :3], jax.random.key_data(keys)):
            with pytest.raises(PipelineError, match=re.escape("dims (4, 4)")):
                toy.pipelined(mesh, make_schedule("1f1b", 2, 4))(stacked, shared, mbs, bad)


@pytest.mark.slow
def test_odd_microbatch_count_and_single_stage():
    _check((2, 2, 2), "1f1b", m=5)
    _check((2, 1, 4), "zb-h1", m=2)


def test_tensor_parallel_composes():
    """`model` stays automatic inside the loop: the MLP hidden dim (48) runs as 4 shards of 12 and
    the stacked grads come back sharded like the params."""
    mesh = _mesh((1, 2, 4))
    stacked, shared = toy.init(jax.random.key(1), layers=8, hidden=48)
    mbs = toy.microbatches(jax.random.key(2), m=2, batch=4, seq=8)
    with jax.set_mesh(mesh):
        compiled = toy.pipelined(mesh, make_schedule("1f1b", 2, 2)).lower(
            stacked, shared, mbs, None).compile()
    text = compiled.as_text()
    assert "f32[4,8,12]" in text and "f32[4,8,48]" not in text
    grads_stacked = compiled.output_shardings[2]
    assert grads_stacked["w1"].spec == jax.sharding.PartitionSpec("stage", None, "model")


def test_pipeline_order_round_trip():
    for p, v, counts in ((4, 2, None), (2, 2, [2, 1, 3, 1]), (4, 1, [1, 3, 2, 1])):
        n = 8 if counts is None else sum(counts)
        layout = make_layout(n, p, v, counts)
        x = {"w": jnp.arange(n * 3.0).reshape(n, 3)}
        piped = to_pipeline_order(x, layout)
        assert piped["w"].shape[0] == p * v * layout.layers_per_chunk
        np.testing.assert_array_equal(from_pipeline_order(piped, layout)["w"], x["w"])
    # chunk c of stage s runs virtual stage c*p+s: with p=4, v=2, one layer each, stage 0 holds 0 and 4
    assert make_layout(8, 4, 2).rows[0].reshape(-1).tolist() == [0, 4]


def test_params_stored_in_pipeline_order():
    mesh = _mesh((1, 4, 1))
    stacked, shared = toy.init(jax.random.key(1), layers=8)
    mbs = toy.microbatches(jax.random.key(2), m=8, batch=2, seq=4)
    sched = make_schedule("interleaved", 4, 8, 2)
    layout = make_layout(8, 4, 2)
    with jax.set_mesh(mesh):
        logical = toy.pipelined(mesh, sched)(stacked, shared, mbs, None)
        piped = toy.pipelined(mesh, sched, params_in_pipeline_order=True)(
            jax.tree.map(np.asarray, to_pipeline_order(stacked, layout)), shared, mbs, None)
    np.testing.assert_allclose(piped[0], logical[0], rtol=1e-6)
    for key in stacked:
        np.testing.assert_allclose(from_pipeline_order(piped[2], layout)[key], logical[2][key],
                                   rtol=1e-5, atol=1e-7)


def test_refusals_are_clear():
    mesh = _mesh((1, 4, 1))
    stacked, shared = toy.init(jax.random.key(1), layers=6)
    fns = (toy.first_fn, toy.stage_fn, toy.last_fn)
    with jax.set_mesh(mesh):
        mbs = toy.microbatches(jax.random.key(2), m=4, batch=2, seq=4)
        with pytest.raises(PipelineError, match="pass shard_grads=True with it"):
            pipeline_value_and_grad(*fns, stacked, shared, mbs, mesh=mesh,
                                    schedule=make_schedule("1f1b", 4, 4), gather_stacked=True)
        with pytest.raises(PipelineError, match="do not split evenly"):
            pipeline_value_and_grad(*fns, stacked, shared, mbs, mesh=mesh,
                                    schedule=make_schedule("1f1b", 4, 4))
        with pytest.raises(PipelineError, match="must have 4 non-negative counts"):
            pipeline_value_and_grad(*fns, stacked, shared, mbs, mesh=mesh,
                                    schedule=make_schedule("1f1b", 4, 4),
                                    layers_per_virtual_stage=[3, 3])
        with pytest.raises(PipelineError, match="schedule is for 2 stages"):
            pipeline_value_and_grad(*fns, stacked, shared, mbs, mesh=mesh,
                                    schedule=make_schedule("1f1b", 2, 4))


def test_a_table_of_fewer_micro_batches_than_stages_runs():
    """One micro-batch per stage at least is the plan's rule (jax3d.parallel), not the loop's: the loop runs
    any valid table it is given, here 2 micro-batches over 4 stages, and matches the sequential model."""
    from jax3d.pipeline import schedules as S
    mesh = _mesh((1, 4, 1))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=2, batch=2, seq=4)
    sched = S.Schedule("1f1b", 4, 2, 1, False, *S._place(S._1f1b_orders(4, 2), 4, 1))
    with jax.set_mesh(mesh):
        loss, _, g_st, _ = toy.pipelined(mesh, sched)(stacked, shared, mbs, None)
        (r_loss, _), (r_st, _) = jax.jit(jax.value_and_grad(lambda a, b: toy.sequential_loss(a, b, mbs),
                                                            argnums=(0, 1), has_aux=True))(stacked, shared)
    assert _rel(loss, r_loss) < RTOL and _rel(g_st["w1"], r_st["w1"]) < RTOL


def test_batch_must_divide_over_data():
    mesh = _mesh((2, 2, 2))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=2, batch=3, seq=4)
    with jax.set_mesh(mesh):
        with pytest.raises(PipelineError, match="divisible by the 2 data shards"):
            pipeline_value_and_grad(toy.first_fn, toy.stage_fn, toy.last_fn, stacked, shared, mbs,
                                    mesh=mesh, schedule=make_schedule("1f1b", 2, 2))


def test_invalid_table_refused():
    from jax3d.pipeline.schedules import IDLE, Schedule
    mesh = _mesh((1, 2, 1))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=2, batch=2, seq=4)
    good = make_schedule("1f1b", 2, 2)
    kind = good.kind.copy()
    kind[-1, 0] = IDLE  # drop stage 0's last backward
    broken = Schedule("1f1b", 2, 2, 1, False, kind, good.microbatch, good.chunk)
    with jax.set_mesh(mesh), pytest.raises(PipelineError, match="table is invalid"):
        pipeline_value_and_grad(toy.first_fn, toy.stage_fn, toy.last_fn, stacked, shared, mbs,
                                mesh=mesh, schedule=broken)


def test_zero2_accumulators_sharded_over_data_and_zero3_gathers_per_chunk():
    """With data dims the grads come back sharded over `data` (reduce-scattered per micro-batch, not
    all-reduced at the end) and equal the sequential model's; ZeRO-3 params go in sharded."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = _mesh((2, 2, 2))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=4, batch=4, seq=8)
    dims = ({"w1": 1, "w2": 2}, {"embed": 1, "scale": 0})
    ref = jax.jit(jax.value_and_grad(lambda a, b: toy.sequential_loss(a, b, mbs)[0], argnums=(0, 1)))
    st_sh, sh_sh = toy.param_shardings(mesh)
    for gather in (False, True):
        if gather:
            st_sh = {"w1": NamedSharding(mesh, P("stage", "data", "model")),
                     "w2": NamedSharding(mesh, P("stage", "model", "data"))}
        fn = jax.jit(lambda a, b, c: pipeline_value_and_grad(
            toy.first_fn, toy.stage_fn, toy.last_fn, a, b, c, mesh=mesh,
            schedule=make_schedule("zb-h1", 2, 4), data_dims=dims, shard_grads=True,
            gather_stacked=gather), in_shardings=(st_sh, sh_sh, NamedSharding(mesh, P(None, "data"))))
        with jax.set_mesh(mesh):
            compiled = fn.lower(stacked, shared, mbs).compile()
            _, _, g_st, g_sh = compiled(stacked, shared, mbs)
            _, (r_st, r_sh) = ref(stacked, shared)
        assert compiled.output_shardings[2]["w1"].spec == P("stage", "data", "model")
        assert compiled.output_shardings[3]["embed"].spec == P(None, "data")
        assert "reduce-scatter" in compiled.as_text()
        if gather:
            assert "all-gather" in compiled.as_text()
        for got, want in ((g_st, r_st), (g_sh, r_sh)):
            for key in want:
                assert _rel(got[key], want[key]) < RTOL, (gather, key, _rel(got[key], want[key]))


def test_bf16_params_accumulate_float32_grads():
    mesh = _mesh((1, 2, 1))
    stacked, shared = toy.init(jax.random.key(1), layers=4)
    mbs = toy.microbatches(jax.random.key(2), m=4, batch=2, seq=8)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (stacked, shared))
    with jax.set_mesh(mesh):
        _, _, g_st, g_sh = toy.pipelined(mesh, make_schedule("zb-h1", 2, 4))(*bf16, mbs, None)
        _, (r_st, _) = jax.jit(jax.value_and_grad(
            lambda a, b: toy.sequential_loss(a, b, mbs)[0], argnums=(0, 1)))(stacked, shared)
    assert g_st["w1"].dtype == jnp.float32 and g_sh["embed"].dtype == jnp.float32
    assert _rel(g_st["w1"], r_st["w1"]) < 5e-2  # bf16 forward, fp32 sums


def _dots(fn, *args):
    return fn.lower(*args).compile().as_text().count(" dot(")


def test_backward_reads_stored_residuals_and_splits_without_overlap():
    """F runs the chunk's forward once; the fused backward, B and W run no forward, and B + W do the
    fused backward's matmuls with no overlap: W is one matmul per weight."""
    from jax3d.pipeline import passes
    with jax.set_mesh(jax.make_mesh((1, 1, 1), ("data", "stage", "model"), devices=jax.devices()[:1],
                                    axis_types=(jax.sharding.AxisType.Auto,) * 3)):
        _check_passes(passes)


def _check_passes(passes):
    stacked, _ = toy.init(jax.random.key(1), layers=3)
    x = jax.random.normal(jax.random.key(2), (2, 4, 16))
    run = lambda w, x: toy.stage_fn(w, x, None)  # noqa: E731
    zero_x, g = jnp.zeros_like(x), jnp.ones_like(x)
    mask = passes.residual_mask(run, stacked, x)
    fwd = jax.jit(lambda w, x: passes.forward(run, w, x, mask))
    y, stored = fwd(stacked, x)
    sp = passes.split(run, stacked, zero_x, mask, stored, g)

    def leaves(w, s):
        return jax.tree.leaves(passes.pullback(run, w, zero_x, mask, s))
    fused = jax.jit(lambda w, s, g: passes.backward(run, w, zero_x, mask, s, g))
    b = jax.jit(lambda w, s, g: sp.b(leaves(w, s), g))
    dx, cut = b(stacked, stored, g)
    w_pass = jax.jit(lambda w, s, g, cut: sp.w(leaves(w, s), g, cut))
    dw = w_pass(stacked, stored, g, cut)
    ref_dw, ref_dx = jax.vjp(run, stacked, x)[1](g)
    assert _rel(dx, ref_dx) < RTOL and all(_rel(dw[k], ref_dw[k]) < RTOL for k in dw)
    assert not any(a is stacked["w1"] for a in stored)  # weights are not stored per micro-batch
    n_f = _dots(fwd, stacked, x)
    n_fused, n_b = _dots(fused, stacked, stored, g), _dots(b, stacked, stored, g)
    n_w = _dots(w_pass, stacked, stored, g, cut)
    assert n_f == 6 and n_w == 6  # 2 weights x 3 layers
    assert n_b + n_w == n_fused == 12


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}


def _copies_in_tick_loop(hlo):
    """(computations visited, sizes in bytes of the copies XLA inserted in them): the tick loop's body
    and the conditionals it runs (copies inside fusions are layout changes of fused values, not
    buffer copies)."""
    comps = {m.group(1): m.group(2) for m in
             re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)^\}", hlo, re.M | re.S)}
    todo, seen, sizes = re.findall(r"body=%?([\w.\-]+)", hlo), set(), []
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for called in re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=|body=)"
                                 r"([^}\s,]+(?:, ?%[\w.\-]+)*)", comps[name]):
            todo += [c.strip().lstrip("%") for c in called.split(",")]
        for dtype, dims in re.findall(r"= (\w+)\[([\d,]*)\][^ ]* copy\(", comps[name]):
            sizes.append(_BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d])))
    return seen, sizes


@pytest.mark.parametrize("name,v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_tick_loop_updates_its_buffers_in_place(name, v):
    """The residual buffers and gradient accumulators are updated in place: no copy in the tick loop is
    as large as one layer's stored hidden activation (the activation-sized hand-offs between passes
    are smaller). A multi-way switch carrying the buffers made XLA copy all of them on every tick."""
    mesh = _mesh((1, 2, 1))
    batch, seq, d = 4, 32, 64
    st, sh = jax.eval_shape(lambda: toy.init(jax.random.key(0), d=d, hidden=4 * d, layers=4))
    mbs = jax.eval_shape(lambda: toy.microbatches(jax.random.key(0), m=4, batch=batch, seq=seq))
    with jax.set_mesh(mesh):
        hlo = toy.pipelined(mesh, make_schedule(name, 2, 4, v)).lower(st, sh, mbs, None).compile().as_text()
    visited, sizes = _copies_in_tick_loop(hlo)
    assert len(visited) > 1, "found no tick loop with conditionals in the compiled step"
    assert max(sizes, default=0) < batch * seq * 4 * d * 4, sorted(sizes)[-5:]
