"""The pipeline loop: one shard_map that executes any schedule table.

Inside `jax.shard_map`, manual over `stage` and `data` (`model` stays automatic, so tensor-parallel
sharding annotations in the user's functions keep working), each stage runs a `lax.scan` over the
schedule's ticks. Per tick it runs `lax.switch` over the branches the table uses (idle, and F/B/W at
the first, middle or last virtual stage), then two `ppermute`s on `stage`: activations forward,
input grads backward. What arrives is written into buffer slots chosen statically (program.py).

Memory and compute: each stage keeps only the *input* activation of a chunk per live micro-batch
(and, for split schedules, its output grad between B and W), in buffers sized by the schedule's
peak occupancy, not by m. B and W recompute the chunk's forward from that input (activation
checkpointing at chunk granularity): fused schedules cost 2 forwards + 1 backward per chunk and
micro-batch, ZB-H1 costs 3 forwards + backward-input + backward-weight. Weight grads accumulate in
one running sum per stage; grads are reduced over `data` once, after the loop.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax3d.pipeline import program as prog_mod
from jax3d.pipeline.layout import (PipelineError, dropout_key, from_pipeline_order, layer_keys,
                                   make_layout, to_pipeline_order)
from jax3d.pipeline.schedules import B, F, IDLE, W, Schedule, ScheduleError, validate

_MANUAL = ("stage", "data")


def _vary(x):
    """Mark x varying over the manual axes it does not vary over yet (switch branches and scan
    carries must agree on varying-ness, and vjp of a non-varying input would psum inside a branch)."""
    missing = tuple(a for a in _MANUAL if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _vary_tree(tree):
    return jax.tree.map(_vary, tree)


def _add_grad(acc, g):
    return acc if g.dtype == jax.dtypes.float0 else acc + g.astype(acc.dtype)


def _leading(tree, what):
    sizes = {a.shape[0] for a in jax.tree.leaves(tree)}
    if len(sizes) != 1:
        raise PipelineError(f"every leaf of {what} must share one leading dim, got {sorted(sizes)}")
    return sizes.pop()


def pipeline_value_and_grad(first_fn, stage_fn, last_fn, stacked_params, shared_params, microbatches,
                            *, mesh, schedule: Schedule, layers_per_virtual_stage=None,
                            params_in_pipeline_order=False, rng=None,
                            grad_dtype=jnp.float32):
    """Loss, aux and gradients of a layer-stacked model, run as a pipeline over mesh axis `stage`.

    Contract of the user functions (all pure; they never see the pipeline):
      first_fn(shared_params, mb, key) -> x       runs at virtual stage 0 (e.g. embedding); key is
                                                  None or dropout_key(rng, mb, num_layers), the key a
                                                  sequential model gives what runs before layer 0
      stage_fn(layer_params, x, keys, mb) -> x    runs consecutive layers; every leaf of layer_params
                                                  has a leading dim = number of layers; keys is None
                                                  or a stack of one dropout key per layer
                                                  (see dropout_key); mb is the micro-batch, for
                                                  what every layer needs (a padding mask, say)
      last_fn(shared_params, x, mb) -> (loss_sum, aux)   runs at the last virtual stage; aux is a
                                                  dict of scalars summed like the loss
    x must have the same shape and dtype at every stage boundary. Call this inside jit under
    `jax.set_mesh(mesh)`; the mesh has axes ('data', 'stage', 'model').

    stacked_params: pytree, leaves with a leading `layers` dim (logical order 0..L-1 unless
      params_in_pipeline_order, see layout.to_pipeline_order); sharded on `stage` by the caller.
    shared_params: pytree used by first_fn and last_fn, replicated over `stage`; a tied embedding
      gets the sum of both uses' gradients.
    microbatches: pytree, leaves (m, batch, ...); batch is split over `data`.
    schedule: a Schedule with schedule.stages == mesh.shape['stage'] and m micro-batches.
    layers_per_virtual_stage: optional p*v layer counts for uneven splits (padded to the max with
      skipped layers).
    grad_dtype: dtype of the gradient accumulators and of the returned grads (float32 by default,
      like Megatron's fp32 main grads, so bf16 params do not lose small micro-batch grads); None
      keeps each param's dtype.
    rng: optional key; layer l of micro-batch i gets dropout_key(rng, i, l), folded further with the
      `data` index when data > 1 so data shards draw different masks.

    Returns (loss_sum, aux_sums, grads_stacked, grads_shared): sums over all micro-batches and data
    shards (divide by the token count yourself); grads_stacked in the order stacked_params came in.
    """
    p = mesh.shape["stage"]
    v = schedule.virtual_stages
    m = _leading(microbatches, "microbatches")
    if m < p:
        raise PipelineError(f"{m} micro-batches are fewer than the {p} pipeline stages")
    if schedule.stages != p or schedule.microbatches != m:
        raise PipelineError(
            f"the schedule is for {schedule.stages} stages x {schedule.microbatches} micro-batches, "
            f"but the mesh has {p} stages and {m} micro-batches were given")
    dp = mesh.shape["data"]
    for a in jax.tree.leaves(microbatches):
        if a.ndim < 2 or a.shape[1] % dp:
            raise PipelineError(
                f"micro-batch leaves need a batch dim divisible by the {dp} data shards, got shape "
                f"{tuple(a.shape)}")
    rows = _leading(stacked_params, "stacked_params")
    if params_in_pipeline_order:
        n_layers = sum(layers_per_virtual_stage) if layers_per_virtual_stage is not None else rows
    else:
        n_layers = rows
    layout = make_layout(n_layers, p, v, layers_per_virtual_stage)
    k = layout.layers_per_chunk
    if params_in_pipeline_order and rows != p * v * k:
        raise PipelineError(f"pipeline-ordered params need {p * v * k} stacked rows, got {rows}")
    if not params_in_pipeline_order:
        stacked_params = to_pipeline_order(stacked_params, layout)
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipelineError(f"the schedule table is invalid: {e}") from None
    program = prog_mod.lower(schedule)
    use_rng = rng is not None
    if rng is None:
        rng = jax.random.key(0)

    body = functools.partial(_stage_loop, first_fn, stage_fn, last_fn, program, k, layout.padded,
                             use_rng, dp > 1, p, grad_dtype, layout.num_layers)
    run = jax.shard_map(
        body, mesh=mesh, axis_names=set(_MANUAL),
        in_specs=(P("stage"), P(), P(None, "data"), P(None, "stage"), P("stage"), P()),
        out_specs=(P(), P(), P("stage"), P()))
    loss, aux, g_stacked, g_shared = run(stacked_params, shared_params, microbatches,
                                         jnp.asarray(program.table), jnp.asarray(layout.rows), rng)
    if not params_in_pipeline_order:
        g_stacked = from_pipeline_order(g_stacked, layout)
    return loss, aux, g_stacked, g_shared


def _stage_loop(first_fn, stage_fn, last_fn, program, k, padded, use_rng, fold_data, p, grad_dtype,
                num_layers, stacked, shared, mbs, table, layer_rows, rng):
    """Body of the shard_map: the view of one (data, stage) shard."""
    stacked, shared = _vary_tree(stacked), _vary_tree(shared)
    rows = layer_rows[0]  # (v, k) logical layer per position of this stage, -1 = padding
    if use_rng and fold_data:
        rng = jax.random.fold_in(rng, lax.axis_index("data") + 1_000_003)  # keeps data=1 keys equal

    def microbatch(i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), mbs)

    def chunk_params(c):
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, c * k, k, 0), stacked)

    def run_chunk(wc, x, mb, i, c):
        ids = rows[c]
        keys = layer_keys(rng, i, ids) if use_rng else None
        if not padded:
            return stage_fn(wc, x, keys, mb)
        for j in range(k):  # padded positions run as identity (skipped by cond)
            wj = jax.tree.map(lambda a: a[j:j + 1], wc)
            kj = None if keys is None else keys[j:j + 1]
            x = lax.cond(ids[j] >= 0, lambda x, wj=wj, kj=kj: _vary(stage_fn(wj, x, kj, mb)),
                         lambda x: _vary(x), x)
        return x

    def chunk_fn(first, last, wc, sh, x, mb, i, c):
        if first:
            h = first_fn(sh, mb, dropout_key(rng, i, num_layers) if use_rng else None)
        else:
            h = x
        h = run_chunk(wc, h, mb, i, c)
        if last:
            return last_fn(sh, h, mb)
        return h, {}

    mb0 = microbatch(0)
    x_aval = jax.eval_shape(lambda: first_fn(shared, mb0, None))
    zero_x = _vary(jnp.zeros(x_aval.shape, x_aval.dtype))
    _, aux_aval = jax.eval_shape(lambda: last_fn(shared, zero_x, mb0))
    act_buf = _vary(jnp.zeros((program.act_slots,) + x_aval.shape, x_aval.dtype))
    grad_buf = _vary(jnp.zeros((program.grad_slots,) + x_aval.shape, x_aval.dtype))
    def zeros_grad(a):
        return jnp.zeros(a.shape, grad_dtype or a.dtype)

    acc0 = (_vary_tree(jax.tree.map(zeros_grad, stacked)),
            _vary_tree(jax.tree.map(zeros_grad, shared)),
            _vary(jnp.zeros((), jnp.float32)),
            _vary_tree(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_aval)))

    def add_chunk_grad(gw, dwc, c):
        def upd(g, d):
            if d.dtype == jax.dtypes.float0:  # integer leaf: no gradient
                return g
            cur = lax.dynamic_slice_in_dim(g, c * k, k, 0)
            return lax.dynamic_update_slice_in_dim(g, cur + d.astype(g.dtype), c * k, 0)
        return jax.tree.map(upd, gw, dwc)

    program_split = any(b[0] == W for b in program.branches)

    def make_branch(kind, first, last):
        def branch(act_buf, grad_buf, acc, row):
            gw, gs, loss, aux = acc
            i, c = row[prog_mod.MB], row[prog_mod.CHUNK]
            y_send, dx_send = zero_x, zero_x
            if kind == IDLE:
                return acc, y_send, dx_send
            mb, wc = microbatch(i), chunk_params(c)
            x = zero_x if first else act_buf[row[prog_mod.ACT_SLOT]]
            f = functools.partial(chunk_fn, first, last)
            if kind == F:
                out, aux_i = f(wc, shared, x, mb, i, c)
                if last:
                    loss = loss + out.astype(jnp.float32)
                    aux = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), aux, aux_i)
                else:
                    y_send = out
            else:
                if last:
                    ct = None  # seeded below with ones of the loss
                else:
                    ct = grad_buf[row[prog_mod.GRAD_SLOT]]
                if kind == B and program_split:  # input grad only
                    out, vjp = jax.vjp(lambda x: f(wc, shared, x, mb, i, c)[0], x)
                    (dx,) = vjp(_vary(jnp.ones_like(out)) if ct is None else ct)
                    dx_send = dx
                else:
                    wrt_x = kind == B and not first
                    def fn(wc, sh, x):
                        return f(wc, sh, x, mb, i, c)[0]
                    out, vjp = jax.vjp(fn, wc, shared, x)
                    dwc, dsh, dx = vjp(_vary(jnp.ones_like(out)) if ct is None else ct)
                    gw = add_chunk_grad(gw, dwc, c)
                    gs = jax.tree.map(_add_grad, gs, dsh)
                    if wrt_x:
                        dx_send = dx
            return (_vary_tree((gw, gs, loss, aux)), _vary(y_send), _vary(dx_send))
        return branch

    branches = [make_branch(*b) for b in program.branches]
    fwd_perm = [(s, (s + 1) % p) for s in range(p)]
    bwd_perm = [(s, (s - 1) % p) for s in range(p)]

    def write(buf, slot, value):
        valid = slot >= 0
        slot = jnp.maximum(slot, 0)
        return buf.at[slot].set(jnp.where(valid, value, buf[slot]))

    def tick(carry, row):
        act_buf, grad_buf, acc = carry
        row = row[0]
        acc, y_send, dx_send = lax.switch(row[prog_mod.BRANCH], branches, act_buf, grad_buf, acc, row)
        if p > 1:
            y_send = lax.ppermute(y_send, "stage", fwd_perm)
            dx_send = lax.ppermute(dx_send, "stage", bwd_perm)
        act_buf = write(act_buf, row[prog_mod.RECV_ACT], y_send)
        grad_buf = write(grad_buf, row[prog_mod.RECV_GRAD], dx_send)
        return (act_buf, grad_buf, acc), None

    (_, _, (gw, gs, loss, aux)), _ = lax.scan(tick, (act_buf, grad_buf, acc0), table)
    gw = jax.tree.map(lambda g: lax.psum(g, "data"), gw)
    gs = jax.tree.map(lambda g: lax.psum(g, _MANUAL), gs)
    loss = lax.psum(loss, _MANUAL)
    aux = jax.tree.map(lambda a: lax.psum(a, _MANUAL), aux)
    return loss, aux, gw, gs
