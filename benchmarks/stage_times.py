"""Times one pipeline stage's work on the current device with the loop's own pass functions.

The stage runs `--num-layers / --stages` blocks of the preset on one micro-batch. Timed, each jitted
alone: F (`passes.forward`: the chunk under vjp, keeping its input-dependent residuals), the fused
backward of 1F1B-family schedules (`passes.backward`), ZB-H1's B and W (`passes.split`: the
pullback cut into input-grad and weight-grad halves), and, as the reference, the chunk's plain
forward + backward (`jax.vjp` then its pullback, what the unpipelined step pays). HLO dot / GEMM
counts come from each compiled program.

    python -m benchmarks.stage_times --preset gpt-1.3b --stages 4 --micro-batch-size 4 --bf16

With --api-check it also times the public `pipeline_value_and_grad` at p = 1 (one stage, 1F1B over
--microbatches micro-batches of the same layer stack) against per-micro-batch value-and-grad
accumulated in a scan, the unpipelined step's way, and checks they agree.

It is a GPU benchmark; on a CPU it counts matmuls for small stages (docs/pipeline-costs.md), and a stage
that needs more than the host's free memory stops with one sentence before anything is allocated.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp

from benchmarks.harness import host_shortfall, median_seconds
from jax3d.config import PrecisionConfig
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import build_model, get_preset
from jax3d.parallel.precision import PrecisionPolicy, dtype_of_flags
from jax3d.pipeline import make_schedule, passes, pipeline_value_and_grad


def _gemms(fn, *args) -> tuple[int, int]:
    """Matrix multiplies (XLA dots, or GEMM custom calls on the GPU) and fused-attention calls in the
    compiled program: a dead forward that XLA failed to remove would show up here."""
    text = fn.lower(*args).compile().as_text()
    gemms = len(re.findall(r"= [^=]*\bdot\(", text)) + len(re.findall(r'custom_call_target="__cublas', text))
    return gemms, len(re.findall(r'custom_call_target="__cudnn\$fmha', text))


def stage_passes(run, blocks, x):
    """The jitted pass functions the loop runs, for one chunk `run(blocks, x)`."""
    g = jnp.ones_like(x)
    zero_x = jnp.zeros_like(x)
    mask = passes.residual_mask(run, blocks, x)
    fwd = jax.jit(lambda w, x: passes.forward(run, w, x, mask))
    stored = fwd(blocks, x)[1]
    sp = passes.split(run, blocks, zero_x, mask, stored, g)

    def leaves(w, stored):
        return jax.tree.leaves(passes.pullback(run, w, zero_x, mask, stored))

    fused = jax.jit(lambda w, s, g: passes.backward(run, w, zero_x, mask, s, g))
    b = jax.jit(lambda w, s, g: sp.b(leaves(w, s), g))
    cut = b(blocks, stored, g)[1]
    w_pass = jax.jit(lambda w, s, g, cut: sp.w(leaves(w, s), g, cut))
    plain = jax.jit(lambda w, x, g: jax.vjp(run, w, x)[1](g))
    return {"F": (fwd, (blocks, x)), "BW_fused": (fused, (blocks, stored, g)),
            "B": (b, (blocks, stored, g)), "W": (w_pass, (blocks, stored, g, cut)),
            "plain_fwd_bwd": (plain, (blocks, x, g))}, stored, cut


def api_check(model, blocks, x_shape, dtype, m):
    """p = 1 through the public API against scan-accumulated value-and-grad; (ms, ms, max rel err of the
    loss and gradients)."""
    mesh = jax.make_mesh((1, 1, 1), ("data", "stage", "model"), devices=jax.devices()[:1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    mbs = {"x": jax.random.normal(jax.random.key(2), (m, *x_shape), dtype),
           "t": jax.random.normal(jax.random.key(3), (m, *x_shape), dtype)}

    def stage_fn(w, x, keys, mb):
        return model.run_blocks(w, x)

    def last_fn(shared, h, mb):
        return jnp.mean(jnp.square(h.astype(jnp.float32) - mb["t"])) * shared["s"], {}

    shared = {"s": jnp.float32(1.0)}
    sched = make_schedule("1f1b", 1, m)
    piped = jax.jit(lambda w, mbs: pipeline_value_and_grad(
        lambda sh, mb, key: mb["x"], stage_fn, last_fn, w, shared, mbs, mesh=mesh, schedule=sched)[::2])

    def ref(w, mbs):
        def body(acc, mb):
            loss, g = jax.value_and_grad(lambda w: last_fn(shared, stage_fn(w, mb["x"], None, mb), mb)[0])(w)
            return (acc[0] + loss, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), acc[1], g)), None
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), w)
        return jax.lax.scan(body, (jnp.float32(0), zeros), mbs)[0]
    ref = jax.jit(ref)
    with jax.set_mesh(mesh):
        (l1, g1), (l2, g2) = piped(blocks, mbs), ref(blocks, mbs)
        err = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
                  for a, b in zip(jax.tree.leaves((l1, g1)), jax.tree.leaves((l2, g2))))
        return (median_seconds(piped, (blocks, mbs), 5, warmup=3) * 1e3,
                median_seconds(ref, (blocks, mbs), 5, warmup=3) * 1e3, err)


def print_stage_times(a, cfg, layers, model, blocks, x, dtype):
    """Times the pass functions and prints their JSON line."""
    fns, stored, cut = stage_passes(lambda w, x: model.run_blocks(w, x), blocks, x)
    ms = {k: median_seconds(fn, args, a.reps, warmup=3) * 1e3 for k, (fn, args) in fns.items()}
    counts = {k: _gemms(fn, *args) for k, (fn, args) in fns.items()}
    gemms = {k: c[0] for k, c in counts.items()}
    attention_calls = {k: c[1] for k, c in counts.items()}
    nbytes = lambda tree: sum(l.size * l.dtype.itemsize for l in jax.tree.leaves(tree))  # noqa: E731
    plain = ms["plain_fwd_bwd"]
    out = {"device": jax.devices()[0].device_kind, "preset": a.preset, "layers_per_stage": layers,
           "micro_batch": a.micro_batch_size, "seq": cfg.seq_length, "dtype": str(jnp.dtype(dtype)),
           "recompute": a.recompute, **{f"T_{k}_ms": v for k, v in ms.items()},
           "gemms": gemms, "attention_calls": attention_calls, "residual_mib": nbytes(stored) / 2**20, "cut_mib": nbytes(cut) / 2**20,
           "1f1b_F_plus_fused_over_plain": (ms["F"] + ms["BW_fused"]) / plain,
           "zbh1_F_B_W_over_plain": (ms["F"] + ms["B"] + ms["W"]) / plain,
           "B_plus_W_over_fused": (ms["B"] + ms["W"]) / ms["BW_fused"],
           "fused_over_F": ms["BW_fused"] / ms["F"]}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}), flush=True)


def host_shortfall_of(run, blocks, x) -> str | None:
    """On a CPU, `host_shortfall` of timing the stage `run(blocks, x)` (ShapeDtypeStructs: nothing is
    allocated), at least: its plain forward + backward, the largest program (F, B and W in one), beside
    the residuals F stores, which stay alive while the passes are timed (B's smaller cut is left out)."""
    if jax.devices()[0].platform != "cpu":
        return None
    from jax3d.train.memory import step_peak_bytes

    mask = passes.residual_mask(run, blocks, x)
    stored = jax.eval_shape(lambda w, x: passes.forward(run, w, x, mask)[1], blocks, x)
    plain = jax.jit(lambda w, x, g: jax.vjp(run, w, x)[1](g)).lower(blocks, x, x).compile()
    kept = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(stored))
    return host_shortfall(step_peak_bytes(plain) + kept, at_least=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-1.3b")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=0)
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--api-check", action="store_true")
    p.add_argument("--api-only", action="store_true", help="only the --api-check timing")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    cfg, _ = get_preset(a.preset)
    cfg = dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0, recompute=a.recompute,
                              seq_length=a.seq_length or cfg.seq_length)
    layers = cfg.num_layers // a.stages
    # the kernels where the stage runs (no mesh: this process's devices)
    model = build_model(cfg, kernels=KernelPolicy.resolve(jax.default_backend(), jax.device_count()))
    dtype = PrecisionPolicy.of(PrecisionConfig(dtype=dtype_of_flags(a.bf16))).compute_dtype
    keys = jax.random.split(jax.random.key(0), layers)

    def make_blocks(keys):
        blocks = jax.vmap(lambda k: model.block.init(k, model._dummy_x())["params"])(keys)
        return jax.tree.map(lambda w: w.value.astype(dtype) if hasattr(w, "value") else w.astype(dtype), blocks,
                            is_leaf=lambda w: hasattr(w, "value"))

    x_shape = (a.micro_batch_size, cfg.seq_length, cfg.hidden_size)
    short = host_shortfall_of(lambda w, x: model.run_blocks(w, x), jax.eval_shape(make_blocks, keys),
                              jax.ShapeDtypeStruct(x_shape, dtype))
    if short:
        print(f"error: stage_times.py --preset {a.preset} is a GPU benchmark, and a stage of {layers} layers at "
              f"--micro-batch-size {a.micro_batch_size}, seq {cfg.seq_length} {short}; run it on a GPU, or shrink "
              "it (docs/pipeline-costs.md counts matmuls on a CPU with --preset gpt-125m --stages 12 "
              "--micro-batch-size 1 --seq-length 64)", file=sys.stderr)
        return 2
    blocks = jax.jit(make_blocks)(keys)
    x = jax.random.normal(jax.random.key(1), x_shape, dtype)
    if a.api_only:
        a.api_check = True
    else:
        print_stage_times(a, cfg, layers, model, blocks, x, dtype)
    if a.api_check:
        t_pipe, t_ref, err = api_check(model, blocks, x.shape, dtype, a.microbatches)
        print(json.dumps({"api_p1_microbatches": a.microbatches, "api_p1_pipelined_ms": round(t_pipe, 3),
                          "api_p1_accumulated_ms": round(t_ref, 3), "api_p1_ratio": round(t_pipe / t_ref, 3),
                          "api_p1_max_rel_grad_err": err}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
