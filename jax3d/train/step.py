"""Sharded train state, the pure train / eval steps, and their jit with explicit shardings.

`train_step(state, batch) -> (state, metrics)` runs a whole global batch: the micro-batches (leading
`accum` dim of every batch leaf) go through a `lax.scan` with fp32 gradient accumulation, or through
the pipeline when the mesh has more than one stage.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax3d import dropout_keys
from jax3d.config import Config, ConfigError
from jax3d.models import build_model, fp8
from jax3d.parallel import cast_for_compute, constrain_tree, named_shardings, state_specs, tree_specs, with_shardings
from jax3d.parallel.mesh import MeshConfig, with_auto_axes
from jax3d.parallel.plan import Plan
from jax3d.parallel.precision import PrecisionPolicy
from jax3d.train.fp8 import history_specs
from jax3d.pipeline.layout import state_layout
from jax3d.train.layer_order import LayerOrder
from jax3d.train.optimizer import lr_schedule, make_optimizer
from jax3d.train.pipelined import pipeline_grads_fn
from jax3d.train.state import TrainState, initial_loss_scale, seed_keys, update_loss_scale


def _where_tree(pred, a, b):
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _is_spec(x):
    return isinstance(x, P)


@dataclass
class Steps:
    """Everything built for one (config, mesh): the model, specs, shardings and jitted functions."""

    cfg: Config
    mesh_cfg: MeshConfig
    mesh: jax.sharding.Mesh
    model: object
    optimizer: optax.GradientTransformation
    specs: dict  # compute / params / grads / opt PartitionSpec trees, of the state's layer order
    state_shardings: TrainState
    batch_spec: P
    init_state: Callable  # (seed) -> TrainState, created sharded
    train_step: Callable  # (state, batch) -> (state, metrics)
    eval_step: Callable  # (params as the state holds them, batch) -> metrics of the batch's loss
    abstract_state: TrainState
    accum_steps: int
    loss_and_grads: Callable  # (params, batch) -> (loss, grads in logical order): no update
    # The state stores its layer stack in `order` (pipeline order under an interleaved or uneven
    # pipeline, see layer_order.py); everything that reads params outside the step goes through
    # logical_params / logical_state, and restores through state_from_logical.
    order: LayerOrder
    logical_shardings: TrainState  # shardings of the state in logical order (checkpoint targets)
    abstract_logical_state: TrainState
    _to_logical: Callable
    _params_to_logical: Callable
    _from_logical: Callable
    _params_from_logical: Callable
    plan: Plan  # the ZeRO plan and pipeline spec the step was built for
    precision: PrecisionPolicy  # compute dtype, loss scaling, FP8 recipe, compiler options

    def batch_sharding(self):
        return NamedSharding(self.mesh, self.batch_spec)

    def logical_params(self, params):
        """`params` as the state holds them -> logical layer order, padding dropped (a copy when the
        orders differ, else `params` itself)."""
        return params if self.order.logical else self._params_to_logical(params)

    def state_params(self, params):
        """Logical-order params -> the state's order, on the state's shardings."""
        return params if self.order.logical else self._params_from_logical(params)

    def logical_state(self, state: TrainState) -> TrainState:
        """The train state with params and optimizer moments in logical layer order (a copy)."""
        return state if self.order.logical else self._to_logical(state)

    def compiled_logical_copy(self):
        """The conversion to logical order that saves and restores run, compiled from abstract shapes;
        its memory analysis is their peak. Only for a state not in logical order."""
        return self._to_logical.lower(abstract_state(self)).compile()

    def new_run_parts(self) -> dict:
        """What a new run starts its step, loss scale and RNG at (`init_state` with `--seed`): a restore
        starts the parts it doesn't read (--finetune, --no-load-rng, ...) from these."""
        return {"step": np.int32(0), "loss_scale": initial_loss_scale(self.precision.loss_scaling),
                "rng": jax.random.key_data(seed_keys(self.cfg.train.seed)[1])}

    def state_from_logical(self, state: TrainState) -> TrainState:
        """A logical-order train state in the state's order (donates its argument)."""
        if self.order.logical:
            return state
        with warnings.catch_warnings():
            # The other leaves' results are written over their donated inputs. A stack leaf's shard
            # differs in shape between the two orders (padding rows, `stage` on another dim), so XLA
            # can't reuse it and warns on every restore; the caller drops the logical copy instead.
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            return self._from_logical(state)


def accumulate_grads(model, params, batch, rng, scale, norms, *, dtype, specs):
    """Objective and (scaled) gradients summed over the micro-batches of `batch`, in a scan. `rng` is one
    key (micro-batch i draws from fold_in(rng, i)) or one per sample, shaped like the batch's leading
    (micro-batches, rows) dims.

    Each micro-batch's objective is its exact share of the global-batch loss (`norms` were counted
    over the whole batch), times the fp16 loss scale, so the sums need no rescaling but 1 / scale.
    """
    def objective(p32, mb, r):
        p = cast_for_compute(p32, dtype, specs)
        obj, aux = model.loss(p, mb, r, model.cfg.deterministic, norms)
        return obj * scale, (obj, aux)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    accum = jax.tree.leaves(batch)[0].shape[0]
    per_sample = dropout_keys.is_per_sample(rng, 2)  # (micro-batches, rows) of keys, else one key
    zeros = constrain_tree(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), params), specs["grads"])

    def body(carry, xs):
        g_acc, obj_acc, aux_acc = carry
        i, mb, keys = xs
        (_, (obj, aux)), g = grad_fn(params, mb, keys if per_sample else jax.random.fold_in(rng, i))
        g_acc = constrain_tree(fp8.accumulate(g_acc, g), specs["grads"])  # FP8 amaxes: their maximum
        return (g_acc, obj_acc + obj, jax.tree.map(jnp.add, aux_acc, aux)), None

    aux0 = _zero_aux(model, params, batch, norms)
    xs = (jnp.arange(accum), batch, rng if per_sample else None)
    (grads, obj, aux), _ = jax.lax.scan(body, (zeros, jnp.float32(0), aux0), xs)
    return grads, obj, aux


def _zero_aux(model, params, batch, norms):
    """Zeros shaped like one micro-batch's aux sums: the start of a scan that adds them up."""
    mb0 = jax.tree.map(lambda a: a[0], batch)
    aux = jax.eval_shape(lambda: model.loss(params, mb0, None, True, norms)[1])
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux)


def loss_metrics(obj, aux, norms) -> dict:
    """Step metrics from the summed objective and aux sums: the loss and, with several terms, each."""
    out = {"loss": obj}
    terms = [k[:-4] for k in aux if k.endswith("_sum")]
    if len(terms) > 1:
        out.update({f"{k}_loss": aux[f"{k}_sum"] / norms[k] for k in terms})
    for k, v in aux.items():
        if k.endswith("_correct"):
            out[k[:-8] + "_acc"] = v / norms[k[:-8]]
    return out


def build_steps(plan: Plan, mesh=None) -> Steps:
    """Builds the model, the state shardings (ZeRO applied) and the jitted steps of `plan` (what
    jax3d.parallel.plan.resolve returned), on `mesh` (default: the plan's mesh on the first devices), with the
    plan's kernels and precision."""
    cfg, mesh_cfg, rules, kernels = plan.cfg, plan.mesh, plan.rules, plan.kernels
    mesh = with_auto_axes(mesh if mesh is not None else mesh_cfg.build(jax.devices()[: mesh_cfg.size]))
    # The state's layer stack always divides over the stages: in logical order it has L rows, which an
    # even split divides, and an uneven or interleaved layout stores the stack padded in pipeline order.
    model = build_model(cfg.model, rules, kernels=kernels)
    # With FP8 the train step runs its own copy of the model, whose GEMMs take scales; the state's parameters,
    # their init, evaluation and `loss_and_grads` are the plain model's.
    precision = plan.precision
    recipe = precision.fp8
    step_model = model if recipe is None else build_model(cfg.model, rules, kernels=kernels, fp8=recipe.format)
    optimizer = make_optimizer(cfg.optim, cfg.train.train_iters)
    order = LayerOrder(state_layout(plan.pipeline, cfg.model.num_layers), optimizer)
    schedule = lr_schedule(cfg.optim, cfg.train.train_iters)
    dtype = precision.compute_dtype
    accum = plan.pipeline.microbatches

    abstract_params = jax.eval_shape(lambda k: order.params_from_logical(model.init(k)), jax.random.key(0))
    param_specs = tree_specs(rules, model.logical_axes())
    specs = state_specs(param_specs, abstract_params, mesh_cfg.data, plan.zero)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    step_specs, fp8_abstract = specs, None
    if recipe is not None:  # the step's params hold each GEMM's scales too, never sharded over `data`
        scales_axes = fp8.split(step_model.logical_axes())[1]
        fp8_abstract = fp8.split(jax.eval_shape(lambda k: order.params_from_logical(step_model.init(k)),
                                                jax.random.key(0)))[1]
        scales_specs = tree_specs(rules, scales_axes)
        step_specs = {k: fp8.merge(v, scales_specs) for k, v in specs.items()}
    opt_specs = optax.tree_utils.tree_map_params(
        optimizer, lambda _, spec: spec, abstract_opt, specs["opt"],
        transform_non_params=lambda _: P(), is_leaf=_is_spec)
    ls_specs = jax.tree.map(lambda _: P(), initial_loss_scale(precision.loss_scaling))
    state_spec = TrainState(step=P(), params=specs["params"], opt_state=opt_specs, rng=P(), loss_scale=ls_specs,
                            fp8=None if recipe is None else history_specs(scales_specs))
    state_shardings = named_shardings(mesh, state_spec)
    batch_spec = plan.batch_spec
    batch_sharding = NamedSharding(mesh, batch_spec)
    repl = NamedSharding(mesh, P())

    def init_fn(seed):
        k_params, k_run = seed_keys(seed)
        params = order.params_from_logical(model.init(k_params))  # reordered once, here
        return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                          rng=jax.random.key_data(k_run), loss_scale=initial_loss_scale(precision.loss_scaling),
                          fp8=None if recipe is None else recipe.init(fp8_abstract))

    # Entries of the stack's padding rows (layer_order.py), whose gradients are zeros that no layer owns.
    padding = 0 if order.logical else sum(
        (a.shape[0] - cfg.model.num_layers) * math.prod(a.shape[1:]) for a in jax.tree.leaves(abstract_params["blocks"]))
    grads_fn = _make_grads_fn(plan, mesh, model, specs, dtype)
    step_grads_fn = grads_fn if recipe is None else _make_grads_fn(plan, mesh, step_model, step_specs, dtype)

    def check_batch(batch):
        """At trace time, so it costs nothing per step: a batch the model would misread (a sequence one
        token short trains silently) is refused in a sentence."""
        for key, (shape, _) in model.sample_shapes().items():
            got = tuple(batch[key].shape) if key in batch else None
            if got is None or len(got) != 2 + len(shape) or got[2:] != tuple(shape):
                want = ", ".join(["micro-batches", "rows", *map(str, shape)])
                raise ConfigError(f"batch[{key!r}] has shape {got}; this {cfg.model.model_type} step takes ({want}), "
                                  f"as abstract_batch and batch_sharding describe")

    def step_keys(rng, batch):
        """With dropout, one key per sample of the global batch, by its index there, so that a sample's
        masks don't depend on the layout (jax3d.dropout_keys); without, `rng` as it is."""
        if model.cfg.deterministic:
            return rng
        rows = jax.tree.leaves(batch)[0].shape[:2]
        return dropout_keys.sample_keys(rng, jnp.arange(rows[0] * rows[1]).reshape(rows))

    def train_step(state: TrainState, batch):
        check_batch(batch)
        rng = step_keys(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step), batch)
        scale = state.loss_scale.scale
        norms = model.normalizers(batch)
        params = state.params if recipe is None else fp8.merge(state.params, recipe.scales(state.fp8))
        with jax.named_scope("forward_backward"):
            grads, obj, aux = step_grads_fn(params, batch, rng, scale, norms)
        if recipe is not None:  # the scales' "gradients" are the amaxes seen: the history's next entry
            grads, amaxes = fp8.split(grads)
        with jax.named_scope("optimizer"):  # the scope profiles class the update by
            grads = constrain_tree(jax.tree.map(lambda g: g / scale, grads), specs["grads"])
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(grad_norm)
            updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
        # A non-finite step is never applied: Megatron skips overflowed fp16 steps, and in bf16 / fp32 a
        # NaN update would poison the master weights for good.
        new_params = _where_tree(finite, new_params, state.params)
        new_opt = _where_tree(finite, new_opt, state.opt_state)
        new_state = state.replace(step=state.step + 1, params=new_params, opt_state=new_opt,
                                  loss_scale=update_loss_scale(state.loss_scale, finite, precision.loss_scaling))
        if recipe is not None:
            new_state = new_state.replace(fp8=_where_tree(finite, recipe.update(state.fp8, amaxes), state.fp8))
        metrics = {**loss_metrics(obj, aux, norms), "grad_norm": grad_norm,
                   "lr": schedule(state.step - state.loss_scale.skipped),  # optax counts applied updates only
                   "loss_scale": scale, "skipped": new_state.loss_scale.skipped}
        if cfg.train.log_params_norm:  # Megatron's, of the weights after the update
            metrics["params_norm"] = optax.tree.norm(new_params)
        if cfg.train.log_num_zeros_in_grad:
            metrics["num_zeros_in_grad"] = count_zeros(grads) - padding
        return new_state, metrics

    # An uneven split's logical stack keeps `stage` on another dim, so eval holds a share of it, not all.
    logical_compute = {"compute": order.moved_logical_specs(specs["compute"], abstract_params, mesh)}

    def eval_step(params, batch):
        check_batch(batch)
        norms = model.normalizers(batch)
        # Cast and move `stage` off the layer dim first: the reorder is then local, in the compute dtype.
        p = order.params_to_logical(cast_for_compute(params, dtype, logical_compute))

        def one(carry, mb):
            obj, aux = model.loss(p, mb, None, True, norms)
            return (carry[0] + obj, jax.tree.map(jnp.add, carry[1], aux)), None
        (obj, aux), _ = jax.lax.scan(one, (jnp.float32(0), _zero_aux(model, p, batch, norms)), batch)
        return loss_metrics(obj, aux, norms)

    def loss_and_grads(params, batch):
        check_batch(batch)
        rng = step_keys(jax.random.key(0), batch)
        grads, obj, _ = grads_fn(params, batch, rng, jnp.float32(1.0), model.normalizers(batch))
        grads = constrain_tree(grads, specs["grads"])
        return obj, order.params_to_logical(grads)

    with jax.set_mesh(mesh):
        init_jit = jax.jit(init_fn, static_argnums=0, out_shardings=state_shardings)
        abstract_state = jax.eval_shape(init_fn, 0)
        abstract_logical = jax.eval_shape(order.state_to_logical, abstract_state)
    logical_shardings = order.logical_shardings(with_shardings(abstract_state, state_shardings))
    # Only the train step runs FP8 GEMMs (evaluation and loss_and_grads run the plain model).
    train_jit = jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                        out_shardings=(state_shardings, repl), donate_argnums=0,
                        compiler_options=precision.compiler_options)
    eval_jit = jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding), out_shardings=repl)
    grads_jit = jax.jit(loss_and_grads, out_shardings=(repl, jax.tree.map(
        lambda s: NamedSharding(mesh, s), order.moved_logical_specs(specs["grads"], abstract_params, mesh),
        is_leaf=_is_spec)))
    to_logical = jax.jit(order.state_to_logical, out_shardings=logical_shardings)
    params_to_logical = jax.jit(order.params_to_logical, out_shardings=logical_shardings.params)
    from_logical = jax.jit(order.state_from_logical, out_shardings=state_shardings, donate_argnums=0)
    params_from_logical = jax.jit(order.params_from_logical, out_shardings=state_shardings.params)
    return Steps(cfg, mesh_cfg, mesh, model, optimizer, specs, state_shardings, batch_spec,
                 _with_mesh(mesh, init_jit), _with_mesh(mesh, train_jit), _with_mesh(mesh, eval_jit),
                 abstract_state, accum, _with_mesh(mesh, grads_jit), order=order,
                 logical_shardings=logical_shardings, abstract_logical_state=abstract_logical,
                 _to_logical=to_logical, _params_to_logical=params_to_logical, _from_logical=from_logical,
                 _params_from_logical=params_from_logical, plan=plan, precision=precision)


def count_zeros(tree) -> jax.Array:
    """How many entries of `tree` are exactly zero, as Megatron's --log-num-zeros-in-grad counts them (a float,
    as Megatron sums it; each leaf's count is exact)."""
    return sum(jnp.sum(x == 0, dtype=jnp.int32).astype(jnp.float32) for x in jax.tree.leaves(tree))


def _make_grads_fn(plan, mesh, model, specs, dtype):
    if plan.pipeline.pipelined:
        return pipeline_grads_fn(plan, mesh, model, specs, dtype)

    def grads_fn(params, batch, rng, scale, norms):
        return accumulate_grads(model, params, batch, rng, scale, norms, dtype=dtype, specs=specs)
    return grads_fn


class _with_mesh:
    """Calls a jitted function under `jax.set_mesh`, so bare PartitionSpec constraints resolve."""

    def __init__(self, mesh, fn):
        self.mesh, self.fn = mesh, fn

    def __call__(self, *args):
        with jax.set_mesh(self.mesh):
            return self.fn(*args)

    def lower(self, *args):
        with jax.set_mesh(self.mesh):
            return self.fn.lower(*args)


def abstract_state(steps: Steps) -> TrainState:
    """ShapeDtypeStructs of the train state, carrying its shardings: compiles the step without allocating it."""
    return with_shardings(steps.abstract_state, steps.state_shardings)


def abstract_batch(steps: Steps, batch_keys: dict) -> dict:
    """ShapeDtypeStructs of one global batch, given {key: (per-sample shape, dtype)}."""
    rows = steps.cfg.train.global_batch_size // steps.accum_steps
    sharding = steps.batch_sharding()
    return {k: jax.ShapeDtypeStruct((steps.accum_steps, rows, *shape), dt, sharding=sharding)
            for k, (shape, dt) in batch_keys.items()}
