"""The pipeline loop: one shard_map that executes any schedule table.

Inside `jax.shard_map`, manual over `stage` and `data` (`model` stays automatic, so tensor-parallel
sharding annotations in the user's functions keep working), each stage runs a `lax.scan` over the
schedule's ticks. Per tick it runs the pass the table names (F, a fused backward, or split B / W;
each a two-way `lax.cond`, which differs at the first and last virtual stage), then a `ppermute` on
`stage` in each direction, skipped on ticks where the table says no stage sends that way. What
arrives is written into buffer slots chosen statically (program.py).

Compute: F runs the chunk under `jax.vjp` and stores the residuals that depend on its input in loop
buffers sized by the schedule's peak occupancy (not by m); B rebuilds the pullback from them and
never re-runs the forward. What the residuals are is the user's functions' business: layers under
`jax.checkpoint` store only their inputs and recompute inside the pullback, exactly as they would
without a pipeline. The loss head's backward runs in the last stage's F, where its seed is known.
Split schedules (ZB-H1): the pullback is cut in two (passes.split); B computes the input grad and
the cotangents W needs, W only the weight grads, and neither repeats the other's matmuls.

Gradients: one running sum per stage. With ZeRO-2 dims given, each micro-batch's weight grad is
reduce-scattered over `data` into an accumulator holding 1/data of the stage's grads; otherwise the
sums are reduced over `data` once, after the loop. With ZeRO-3 the stacked params arrive sharded
over `data` and each layer's weights are gathered where they are used.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jax3d import dropout_keys
from jax3d.parallel.mesh import DATA, STAGE
from jax3d.pipeline import program as prog_mod
from jax3d.pipeline import passes
from jax3d.pipeline.layout import (PipelineError, dropout_key, from_pipeline_order, layer_keys,
                                   make_layout, to_pipeline_order)
from jax3d.pipeline.schedules import B, F, W, Schedule, ScheduleError, validate

_MANUAL = (STAGE, DATA)


def _vary(x):
    """Mark x varying over the manual axes it does not vary over yet (cond branches and scan
    carries must agree on varying-ness, and vjp of a non-varying input would psum inside a branch)."""
    missing = tuple(a for a in _MANUAL if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _vary_tree(tree):
    return jax.tree.map(_vary, tree)


def _leading(tree, what):
    sizes = {a.shape[0] for a in jax.tree.leaves(tree)}
    if len(sizes) != 1:
        raise PipelineError(f"every leaf of {what} must share one leading dim, got {sorted(sizes)}")
    return sizes.pop()


def pipeline_value_and_grad(first_fn, stage_fn, last_fn, stacked_params, shared_params, microbatches,
                            *, mesh, schedule: Schedule, layers_per_virtual_stage=None,
                            params_in_pipeline_order=False, rng=None,
                            grad_dtype=jnp.float32, data_dims=None, shard_grads=False,
                            gather_stacked=False, place_x=None, stats=None):
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
      `data` index when data > 1 so data shards draw different masks. Or one key per sample, shaped
      like the micro-batches' leading (m, batch) dims (jax3d.dropout_keys.sample_keys): then layer l
      of a sample gets fold_in(its key, l) wherever it runs, and the keys first_fn and stage_fn get
      carry the batch dim (one per row of mb; the keys of stage_fn are (layers, rows)): draw masks with
      jax3d.dropout_keys.bernoulli, which takes either kind.
    data_dims: optional pair (stacked_dims, shared_dims) of pytrees like the params, an int per leaf:
      the dim ZeRO shards over `data`, or -1. With shard_grads (ZeRO-2) the gradient accumulators of
      leaves with a dim are sharded there over `data` (reduce-scattered per micro-batch) and returned
      so (stacked dims must not be 0, the layer dim). With gather_stacked (ZeRO-3) stacked_params
      arrive sharded there over `data` and each layer is gathered when it runs; their gradients then
      come back sharded, so it needs shard_grads too.
    place_x: optional function applied to each stage's input, whether embedded or received, e.g. a
      sharding constraint over the automatic axes. The branches that produce the input must agree on
      its sharding, so a first_fn whose output is constrained (sequence parallelism) needs one.
    stats: optional pytree of bools like stacked_params: True marks a leaf whose "gradient" is a statistic
      reduced by its maximum over micro-batches and data shards, never summed (FP8 amaxes, jax3d.models.fp8);
      such a leaf must not be sharded over `data`.

    Returns (loss_sum, aux_sums, grads_stacked, grads_shared): sums over all micro-batches and data
    shards (divide by the token count yourself); grads_stacked in the order stacked_params came in.
    """
    p = mesh.shape[STAGE]
    v = schedule.virtual_stages
    m = _leading(microbatches, "microbatches")
    if schedule.stages != p or schedule.microbatches != m:
        raise PipelineError(
            f"the schedule is for {schedule.stages} stages x {schedule.microbatches} micro-batches, "
            f"but the mesh has {p} stages and {m} micro-batches were given")
    if gather_stacked and not shard_grads:
        raise PipelineError("gather_stacked returns the stacked params' gradients sharded over `data`; pass "
                            "shard_grads=True with it")
    dp = mesh.shape[DATA]
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
    stats = jax.tree.map(lambda _: False, stacked_params) if stats is None else stats
    st_dims, sh_dims = data_dims if data_dims is not None else (None, None)
    st_dims = _dims(stacked_params, st_dims if shard_grads else None)
    sh_dims = _dims(shared_params, sh_dims if shard_grads else None)
    if shard_grads and any(d == 0 for d in jax.tree.leaves(st_dims)):
        raise PipelineError("data_dims cannot shard stacked params over `data` on their layer dim, "
                            "which `stage` splits")
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipelineError(f"the schedule table is invalid: {e}") from None
    program = prog_mod.lower(schedule)
    use_rng = rng is not None
    if rng is None:
        rng = jax.random.key(0)
    per_sample = dropout_keys.is_per_sample(rng, 2)
    want = (m, jax.tree.leaves(microbatches)[0].shape[1])
    typed = jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
    if rng.ndim != (0 if typed else 1) and (not per_sample or tuple(rng.shape) != want):
        raise PipelineError(f"rng is a key array of shape {tuple(rng.shape)} ({rng.dtype}); pass one key, or typed "
                            f"keys one per sample shaped like the micro-batches' leading (m, batch) dims {want} "
                            f"(jax3d.dropout_keys.sample_keys; raw uint32 key data needs jax.random.wrap_key_data)")

    body = functools.partial(_stage_loop, first_fn, stage_fn, last_fn, program, k, layout.padded,
                             use_rng, dp > 1 and not per_sample, p, grad_dtype, layout.num_layers,
                             (st_dims, sh_dims), gather_stacked, place_x or (lambda x: x), stats)
    st_specs = jax.tree.map(lambda d: _spec(d, STAGE), st_dims)
    sh_specs = jax.tree.map(lambda d: _spec(d, None), sh_dims)
    run = jax.shard_map(
        body, mesh=mesh, axis_names=set(_MANUAL),
        in_specs=(st_specs if gather_stacked else P(STAGE), P(), P(None, DATA), P(None, STAGE),
                  P(), P(STAGE), P(None, DATA) if per_sample else P()),
        out_specs=(P(), P(), st_specs if shard_grads else P(STAGE), sh_specs if shard_grads else P()))
    loss, aux, g_stacked, g_shared = run(stacked_params, shared_params, microbatches,
                                         jnp.asarray(program.table), jnp.asarray(program.sends),
                                         jnp.asarray(layout.rows), rng)
    if not params_in_pipeline_order:
        g_stacked = from_pipeline_order(g_stacked, layout)
    return loss, aux, g_stacked, g_shared


def _dims(params, dims):
    """The ZeRO dim of every leaf (-1: none); `dims` may be a prefix tree (one int for a subtree)."""
    if dims is None:
        return jax.tree.map(lambda _: -1, params)

    def expand(d, sub):
        d = -1 if d is None or d < 0 else int(d)
        for a in jax.tree.leaves(sub):
            if d >= a.ndim:
                raise PipelineError(f"data dim {d} is out of range for a leaf of shape {tuple(a.shape)}")
        return jax.tree.map(lambda _: d, sub)
    return jax.tree.map(expand, dims, params, is_leaf=lambda d: d is None or isinstance(d, int))


def _spec(d, lead):
    """PartitionSpec with `lead` on dim 0 and `data` on dim d (d < 0: none)."""
    if d < 0:
        return P(lead) if lead else P()
    parts = [lead] + [None] * (d - 1) + [DATA] if d > 0 else [DATA]
    return P(*parts)


def _stage_loop(first_fn, stage_fn, last_fn, program, k, padded, use_rng, fold_data, p, grad_dtype,
                num_layers, dims, gather_stacked, place_x, stats, stacked, shared, mbs, table, sends, layer_rows,
                rng):
    """Body of the shard_map: the view of one (data, stage) shard."""
    st_dims, sh_dims = dims
    stacked, shared = _vary_tree(stacked), _vary_tree(shared)
    rows = layer_rows[0]  # (v, k) logical layer per position of this stage, -1 = padding
    if use_rng and fold_data:
        rng = jax.random.fold_in(rng, lax.axis_index(DATA) + 1_000_003)  # keeps data=1 keys equal

    program_split = any(b[0] == W for b in program.branches)

    def microbatch(i):
        return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, 0, keepdims=False), mbs)

    def chunk_params(c):
        return jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, c * k, k, 0), stacked)

    def gather(wj):
        # ZeRO-3: one layer's weights, gathered over `data` just before it runs (B gathers again:
        # weights are never stored as residuals)
        return jax.tree.map(lambda a, d: a if d < 0 else lax.all_gather(a, DATA, axis=d, tiled=True),
                            wj, st_dims)

    def run_chunk(wc, x, mb, i, c):
        ids = rows[c]
        keys = layer_keys(rng, i, ids) if use_rng else None
        if not padded and not gather_stacked:
            return _vary(stage_fn(wc, x, keys, mb))
        for j in range(k):  # layer by layer; padded positions run as identity (skipped by cond)
            wj = jax.tree.map(lambda a: a[j:j + 1], wc)
            wj = gather(wj) if gather_stacked else wj
            kj = None if keys is None else keys[j:j + 1]
            if not padded:
                x = _vary(stage_fn(wj, x, kj, mb))
                continue
            x = lax.cond(ids[j] >= 0, lambda x, wj=wj, kj=kj: _vary(stage_fn(wj, x, kj, mb)),
                         lambda x: _vary(x), x)
        return x

    def chunk_of(mb, i, c):
        return lambda w, x: run_chunk(w, x, mb, i, c)

    def first_key(i):
        return dropout_key(rng, i, num_layers) if use_rng else None

    mb0 = microbatch(0)
    x_aval = jax.eval_shape(lambda: first_fn(shared, mb0, None))
    zero_x = _vary(jnp.zeros(x_aval.shape, x_aval.dtype))
    _, aux_aval = jax.eval_shape(lambda: last_fn(shared, zero_x, mb0))

    # What F stores for B: the chunk's vjp residuals that depend on its input (see residuals.py).
    chunk0, wc0 = chunk_of(mb0, jnp.int32(0), jnp.int32(0)), chunk_params(0)
    res_mask = passes.residual_mask(chunk0, wc0, zero_x)
    res_avals = jax.eval_shape(lambda: passes.forward(chunk0, wc0, zero_x, res_mask)[1])
    res_bufs = [_vary(jnp.zeros((program.res_slots,) + a.shape, a.dtype)) for a in res_avals]
    cut_bufs, sp = [], None
    if program_split:  # B and W share one cut of the pullback, traced once here
        sp = passes.split(chunk0, wc0, zero_x, res_mask, [b[0] for b in res_bufs], zero_x)
        cut_bufs = [_vary(jnp.zeros((program.cut_slots,) + a.shape, a.dtype)) for a in sp.cut_avals()]
    act_buf = _vary(jnp.zeros((program.act_slots,) + x_aval.shape, x_aval.dtype))
    grad_buf = _vary(jnp.zeros((program.grad_slots,) + x_aval.shape, x_aval.dtype))

    def acc_zeros(a, d, arrives_sharded=False):
        shape = list(a.shape)
        if d >= 0 and not arrives_sharded:
            shape[d] //= lax.axis_size(DATA)
        return jnp.zeros(shape, grad_dtype or a.dtype)

    acc0 = (_vary_tree(jax.tree.map(lambda a, d: acc_zeros(a, d, gather_stacked), stacked, st_dims)),
            _vary_tree(jax.tree.map(acc_zeros, shared, sh_dims)),
            _vary(jnp.zeros((), jnp.float32)),
            _vary_tree(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), aux_aval)))

    def scatter(g, d):
        """A micro-batch's grad, reduced over `data` into this shard's part of a ZeRO-2 accumulator."""
        return g if d < 0 else lax.psum_scatter(g, DATA, scatter_dimension=d, tiled=True)

    def add_shared(gs, dsh):
        return jax.tree.map(lambda g, d, dim: g if d.dtype == jax.dtypes.float0
                            else g + scatter(d.astype(g.dtype), dim), gs, dsh, sh_dims)

    def add_chunk_grad(gw, dwc, c):
        def upd(g, d, dim, stat):
            if d.dtype == jax.dtypes.float0:  # integer leaf: no gradient
                return g
            # under ZeRO-3 the vjp of the gather already reduce-scattered the grad over `data`; a statistic is
            # this data shard's maximum, reduced over `data` after the loop
            d = d.astype(g.dtype) if gather_stacked or stat else scatter(d.astype(g.dtype), dim)
            cur = lax.dynamic_slice_in_dim(g, c * k, k, 0)
            return lax.dynamic_update_slice_in_dim(g, jnp.maximum(cur, d) if stat else cur + d, c * k, 0)
        return jax.tree.map(upd, gw, dwc, st_dims, stats)

    # Each pass is its own two-way lax.cond that writes only the buffers it owns. XLA updates a
    # buffer in place inside a two-way conditional with one writing branch; a switch over three or
    # more branches, or two branches that both write, makes it copy every buffer it carries on
    # every tick (the residual buffers and the gradient accumulators, gigabytes per tick at 1.3B).
    kinds = jnp.asarray([b[0] for b in program.branches], jnp.int32)
    firsts = jnp.asarray([b[1] for b in program.branches])
    lasts = jnp.asarray([b[2] for b in program.branches])
    used = {b[0] for b in program.branches}

    def forward_pass(carry, row, first, last, act_buf):
        res_bufs, grad_buf, gs, loss, aux = carry
        i, c = row[prog_mod.MB], row[prog_mod.CHUNK]
        mb = microbatch(i)
        x = lax.cond(first, lambda: place_x(_vary(first_fn(shared, mb, first_key(i)))),
                     lambda: place_x(_vary(act_buf[jnp.maximum(row[prog_mod.ACT_SLOT], 0)])))
        h, stored = passes.forward(chunk_of(mb, i, c), chunk_params(c), x, res_mask)
        res_bufs = [b.at[row[prog_mod.RES_SLOT]].set(_vary(a)) for b, a in zip(res_bufs, stored)]

        def head(grad_buf, gs, loss, aux):  # the loss head's backward runs here: its seed is known
            out, head_vjp, aux_i = jax.vjp(lambda sh, h: last_fn(sh, h, mb), shared, h, has_aux=True)
            dsh, dh = head_vjp(_vary(jnp.ones_like(out)))
            grad_buf = grad_buf.at[row[prog_mod.GRAD_SLOT]].set(_vary(dh))
            aux = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), aux, aux_i)
            return _vary_tree((grad_buf, add_shared(gs, dsh), loss + out.astype(jnp.float32), aux, zero_x))

        def send_on(grad_buf, gs, loss, aux):
            return _vary_tree((grad_buf, gs, loss, aux, h))
        grad_buf, gs, loss, aux, y = lax.cond(last, head, send_on, grad_buf, gs, loss, aux)
        return _vary_tree((res_bufs, grad_buf, gs, loss, aux)), _vary(y)

    def pullback_of(row, res_bufs):
        i, c = row[prog_mod.MB], row[prog_mod.CHUNK]
        mb = microbatch(i)
        stored = [b[row[prog_mod.RES_SLOT]] for b in res_bufs]
        return mb, i, c, passes.pullback(chunk_of(mb, i, c), chunk_params(c), zero_x, res_mask, stored)

    def fused_backward(carry, row, first, res_bufs, grad_buf):
        gw, gs = carry
        mb, i, c, pullback = pullback_of(row, res_bufs)
        dwc, dx = pullback(grad_buf[row[prog_mod.GRAD_SLOT]])
        gw = add_chunk_grad(gw, dwc, c)

        def embed(gs):
            _, embed_vjp = jax.vjp(lambda sh: first_fn(sh, mb, first_key(i)), shared)
            (dsh,) = embed_vjp(_vary(dx))
            return _vary_tree((add_shared(gs, dsh), zero_x))
        gs, dx_send = lax.cond(first, embed, lambda gs: _vary_tree((gs, dx)), gs)
        return _vary_tree((gw, gs)), _vary(dx_send)

    def input_grad(cut_bufs, row, res_bufs, grad_buf):  # split B: the input grad, and W's side of the cut
        _, _, _, pullback = pullback_of(row, res_bufs)
        dx, cut = sp.b(jax.tree.leaves(pullback), grad_buf[row[prog_mod.GRAD_SLOT]])
        cut_bufs = [b.at[row[prog_mod.CUT_SLOT]].set(_vary(a)) for b, a in zip(cut_bufs, cut)]
        return _vary_tree(cut_bufs), _vary(dx)

    def weight_grad(gw, row, res_bufs, grad_buf, cut_bufs):  # split W: weight grads only
        _, _, c, pullback = pullback_of(row, res_bufs)
        cut = [b[row[prog_mod.CUT_SLOT]] for b in cut_bufs]
        dwc = sp.w(jax.tree.leaves(pullback), grad_buf[row[prog_mod.GRAD_SLOT]], cut)
        return _vary_tree(add_chunk_grad(gw, dwc, c))

    fwd_perm = [(s, (s + 1) % p) for s in range(p)]
    bwd_perm = [(s, (s - 1) % p) for s in range(p)]

    def write(buf, slot, value):
        valid = slot >= 0
        slot = jnp.maximum(slot, 0)
        return buf.at[slot].set(jnp.where(valid, value, buf[slot]))

    def send(flag, x, perm):
        # the table knows statically whether any stage sends in this direction at this tick
        return lax.cond(flag, lambda x: lax.ppermute(x, STAGE, perm), lambda x: x, x)

    def keep(carry, *_):
        return _vary_tree(carry), zero_x

    def tick(carry, xs):
        (act_buf, grad_buf, res_bufs, cut_bufs), (gw, gs, loss, aux) = carry
        row, flags = xs
        row = row[0]
        kind, first, last = kinds[row[prog_mod.BRANCH]], firsts[row[prog_mod.BRANCH]], lasts[row[prog_mod.BRANCH]]
        y_send, dx_send = zero_x, zero_x
        if F in used:
            (res_bufs, grad_buf, gs, loss, aux), y_send = lax.cond(
                kind == F, lambda cr: forward_pass(cr, row, first, last, act_buf), keep,
                (res_bufs, grad_buf, gs, loss, aux))
        # fused backward: B of a 1F1B-family schedule, or W at the first virtual stage of a split one
        fused = (kind == W) & first if program_split else kind == B
        if (B in used and not program_split) or (W in used and program_split):
            (gw, gs), dx = lax.cond(fused, lambda cr: fused_backward(cr, row, first, res_bufs, grad_buf),
                                    keep, (gw, gs))
            dx_send = jnp.where(fused, dx, dx_send)
        if program_split and B in used:
            cut_bufs, dx = lax.cond(kind == B, lambda cb: input_grad(cb, row, res_bufs, grad_buf), keep,
                                    cut_bufs)
            dx_send = jnp.where(kind == B, dx, dx_send)
        if program_split and W in used:
            gw = lax.cond((kind == W) & ~first, lambda g: weight_grad(g, row, res_bufs, grad_buf, cut_bufs),
                          _vary_tree, gw)
        if p > 1:
            y_send = send(flags[0], y_send, fwd_perm)
            dx_send = send(flags[1], dx_send, bwd_perm)
        act_buf = write(act_buf, row[prog_mod.RECV_ACT], y_send)
        grad_buf = write(grad_buf, row[prog_mod.RECV_GRAD], dx_send)
        return ((act_buf, grad_buf, res_bufs, cut_bufs), (gw, gs, loss, aux)), None

    bufs0 = (act_buf, grad_buf, res_bufs, cut_bufs)
    (_, (gw, gs, loss, aux)), _ = lax.scan(tick, (bufs0, acc0), (table, sends))
    gw = jax.tree.map(lambda g, d, stat: lax.pmax(g, DATA) if stat else lax.psum(g, DATA) if d < 0 else g,
                      gw, st_dims, stats)
    gs = jax.tree.map(lambda g, d: lax.psum(g, _MANUAL if d < 0 else STAGE), gs, sh_dims)
    loss = lax.psum(loss, _MANUAL)
    aux = jax.tree.map(lambda a: lax.psum(a, _MANUAL), aux)
    return loss, aux, gw, gs

