"""The train step's gradients through the pipeline, for meshes with more than one stage.

The model's three pieces become the pipeline's functions: `embed` at the first stage, a slice of
`run_blocks` per stage, and the head with its normalised loss at the last. The loss normalisers and the
fp16 loss scale ride along in the shared (stage-replicated) tree so that no value is closed over.

The state already stores the layer stack in the loop's pipeline order (train/layer_order.py), so the
step hands it over as it is and gets the gradients back in that order: no reorder in the step.

ZeRO (the plan's `zero` facts): the dims the state's specs shard over `data` go to the loop. Sharded
gradients are accumulated there, reduce-scattered per micro-batch; sharded parameters also pass the layer
stack in still sharded, and the loop gathers one chunk at a time (the embedding and head, used at the ends
only, are gathered before the loop).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax3d.models import fp8
from jax3d.parallel import cast_for_compute, constrain_tree
from jax3d.parallel.mesh import DATA
from jax3d.parallel.pipeline_spec import PipelineSpec
from jax3d.parallel.plan import Plan
from jax3d.pipeline import make_schedule
from jax3d.pipeline.loop import pipeline_value_and_grad
from jax3d.pipeline.schedules import summary
from jax3d.pipeline.layout import state_layout


def data_dim(spec) -> int:
    """The dim a PartitionSpec shards over `data`, or -1."""
    for d, part in enumerate(spec):
        if part == DATA or (isinstance(part, tuple) and DATA in part):
            return d
    return -1


def _zero_dims(specs):
    """(stacked, shared) dims for the loop's `data_dims`. The layer dim is on `stage`, so ZeRO never
    shards it over `data`; should a spec do so, that leaf stays whole in the loop."""
    grads = specs["grads"]
    dims = jax.tree.map(data_dim, grads, is_leaf=lambda s: isinstance(s, P))
    stacked = jax.tree.map(lambda d: d if d > 0 else -1, dims["blocks"])
    shared = {k: v for k, v in dims.items() if k != "blocks"}
    shared["_norms"], shared["_scale"] = -1, -1
    return stacked, shared


def pipeline_grads_fn(plan: Plan, mesh, model, specs, dtype):
    """`grads_fn(params, batch, rng, scale, norms) -> (grads, loss, aux)` through the pipeline loop, for
    a plan with a pipeline; params and grads stay in the state's layer order."""
    pipeline, zero = plan.pipeline, plan.zero
    deterministic = plan.cfg.model.deterministic
    stacked_dims, shared_dims = _zero_dims(specs)
    in_pipeline_order = state_layout(pipeline, plan.cfg.model.num_layers) is not None

    def first_fn(shared, mb, key):
        return model.embed(shared, mb, key, deterministic)

    def stage_fn(layer_params, x, keys, mb):
        return model.run_blocks(layer_params, x, None, deterministic, model.block_mask(mb), keys=keys)

    def last_fn(shared, x, mb):
        obj, aux = model.objective(shared, x, mb, shared["_norms"])
        return obj * shared["_scale"], aux

    def split_over_sequence(x):  # sequence parallelism: every stage's input is split over the sequence
        return model.rules.constrain(x, ("batch", "act_seq", "embed"))
    place_x = split_over_sequence if model.rules.splits("act_seq") else None

    def grads_fn(params, batch, rng, scale, norms):
        accum = jax.tree.leaves(batch)[0].shape[0]
        schedule = make_schedule(pipeline.schedule, pipeline.stages, accum, pipeline.virtual_stages)
        ends = {k: v for k, v in params.items() if k != "blocks"}
        shared = cast_for_compute(ends, dtype, {"compute": {k: specs["compute"][k] for k in ends}})
        if zero.parameters:  # stays sharded over `data`; the loop gathers each chunk where it runs
            stacked = constrain_tree(jax.tree.map(lambda a: a.astype(dtype), params["blocks"]),
                                      specs["params"]["blocks"])
        else:
            stacked = cast_for_compute(params["blocks"], dtype, {"compute": specs["compute"]["blocks"]})
        shared["_norms"], shared["_scale"] = norms, jnp.asarray(scale, jnp.float32)
        loss, aux, g_stacked, g_shared = pipeline_value_and_grad(
            first_fn, stage_fn, last_fn, stacked, shared, batch, mesh=mesh, schedule=schedule,
            layers_per_virtual_stage=pipeline.layer_counts, params_in_pipeline_order=in_pipeline_order,
            rng=None if deterministic else rng,
            data_dims=(stacked_dims, shared_dims), shard_grads=zero.gradients, gather_stacked=zero.parameters,
            place_x=place_x, stats=fp8.stat_mask(stacked))
        grads = {k: v for k, v in g_shared.items() if k not in ("_norms", "_scale")}
        grads["blocks"] = g_stacked
        grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        return grads, loss / scale, aux

    return grads_fn


def schedule_report(pipeline: PipelineSpec) -> dict:
    """Schedule figures for --dry-run: ticks, bubble fraction (T_F = T_B = T_W), peak live activations."""
    s = summary(make_schedule(pipeline.schedule, pipeline.stages, pipeline.microbatches, pipeline.virtual_stages))
    return {"schedule": s["schedule"], "ticks": s["ticks"], "bubble_fraction": s["bubble_fraction"],
            "peak_live_activations": s["peak_live_activations"], "virtual_stages": s["virtual_stages"]}
