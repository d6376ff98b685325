"""`--dry-run`: compile the train step ahead of time from abstract shapes and report per-device memory.

No parameter is allocated: the state and the batch are ShapeDtypeStructs carrying their shardings, so a
175B-shaped step compiles on a laptop's emulated CPU devices.
"""
from __future__ import annotations

import math
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from jax3d.parallel import named_shardings
from jax3d.parallel.mesh import AXES
from jax3d.parallel.plan import Plan
from jax3d.train.metrics import model_flops_per_token
from jax3d.train.memory import allocator_offer, step_peak_bytes
from jax3d.train.step import abstract_batch, abstract_state, build_steps


def per_device_bytes(abstract_tree, shardings) -> int:
    """Bytes one device holds of a sharded tree (the largest shard of each leaf)."""
    total = 0
    for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def dry_run(plan: Plan, mesh=None) -> dict:
    """Per-device bytes of params, opt_state, grads, temp and peak, and the step's FLOPs.

    The plan is compiled as given, so that it reports what the real run compiles from the same
    `jax3d.parallel.plan.resolve` output (whether the layers are scanned included).
    """
    cfg, mesh_cfg = plan.cfg, plan.mesh
    steps = build_steps(plan, mesh)
    mesh = steps.mesh
    state = abstract_state(steps)
    batch = abstract_batch(steps, steps.model.sample_shapes())
    t0 = time.perf_counter()
    compiled = steps.train_step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # With stages the gradient accumulators live in the pipeline loop, laid out like the grads specs: ZeRO-2/3
    # shard them over `data` there too (pipelined.py).
    grad_shardings = named_shardings(mesh, steps.specs["grads"])
    params = per_device_bytes(state.params, steps.state_shardings.params)
    opt = per_device_bytes(state.opt_state, steps.state_shardings.opt_state)
    grads = per_device_bytes(state.params, grad_shardings)  # fp32, like the params
    temp = int(mem.temp_size_in_bytes)
    args = int(mem.argument_size_in_bytes)
    peak = step_peak_bytes(compiled)  # the figure the train loop's memory guard checks
    report = {
        "model": cfg.model.model_type, "num_params": steps.model.num_params(),
        "mesh": dict(zip(AXES, (mesh_cfg.data, mesh_cfg.stage, mesh_cfg.model))),
        "zero_stage": cfg.parallel.zero_stage, "dtype": plan.precision.dtype,
        **({"fp8": plan.precision.fp8.format} if plan.precision.fp8 else {}),
        "micro_batches": steps.accum_steps, "scan_layers": cfg.model.scan_layers,
        "params": params, "opt_state": opt, "grads": grads, "temp": temp, "peak": peak,
        "arguments": args,
        # XLA's count for one device; it counts a scanned loop body once, so with scan_layers it is low.
        "flops": float(cost.get("flops", 0.0)) if cost else 0.0,
        "model_flops_per_device": model_flops_per_token(cfg.model) * cfg.train.global_batch_size
        * cfg.model.seq_length / mesh_cfg.size,
        "compile_s": round(compile_s, 2),
    }
    offer = allocator_offer(jax.local_devices()[0]) if jax.local_devices()[0].platform != "cpu" else None
    if offer is not None:  # what the guard holds the peak against, on this process's first device
        report["device_offer"], report["fits"] = offer[0], peak <= offer[0]
    if not steps.order.logical:
        # Saves and restores hold the state and its logical-order copy at once; the guard checks this too.
        report["checkpoint_copy_peak"] = step_peak_bytes(steps.compiled_logical_copy())
    if steps.plan.pipeline.pipelined:
        from jax3d.train.pipelined import schedule_report
        report.update(schedule_report(steps.plan.pipeline))
    return report
