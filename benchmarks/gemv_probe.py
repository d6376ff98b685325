"""How fast the GEMMs of one row (decode at batch 1) read their weights, against the copy rate: one GPU call.

At batch 1 a gpt-1.3b decode step runs at about 61% of its weights' bytes over the copy rate on an H100
(docs/decode.md), and fewer small kernels bought little, so the question is how close each one-row GEMM
comes to the copy rate, and whether a GEMM written for one row (a Pallas kernel, each program a strip of
columns, optionally a share of the rows) does better than XLA's. For each of the block's four GEMM shapes and
the LM head's it times, in one process:
- `xla`: the one-row dot as jax3d writes it (jax3d.inference.one_row.gemm: the row twice, on a GPU);
- `xla-row`: the plain one-row dot (which XLA's GPU compiler rewrites into a multiply and a sum below 10M
  elements);
- `xla-splitS`: XLA's GEMM of the row twice with K split S ways as a batch dimension, the parts added after
  (`xla-split4-row`: of the row once);
- `xla-twice-kept`: the row twice, written to memory before the GEMM rather than broadcast inside it;
- `xla-rowsR`: the row R times (4, 8, 16), as the row twice otherwise;
- `xla-wT`, `xla-wT-row`: the weight stored transposed, (N, K), so each output's K weights lie together (the
  GEMM's operands both contracted along their minor dimension), with the row twice or once;
- `pallas-CxS/W`: `gemv` below, C columns a program, the rows split S ways (partial sums added by XLA), W warps.
Each program runs many GEMMs in turn, over enough distinct weights to overflow L2, inside one compiled loop
(their outputs summed, so none is dropped), so the time per GEMM is its weight's read. Results: one JSON line
per shape, GB/s and the fraction of the copy rate. One H100's figures, and what they meant for decode:
docs/decode.md.

With `--quantization fp8` the weights are generation's fp8 ones (jax3d.models.quantized: e4m3 values, a scale
per column), and `reduce` is decode's one-row GEMM of them (quantized.dot: a row reduction over the values
stored column by column); each XLA variant converts the values inside its GEMM, the Pallas GEMV reads them as
f8, and every output is scaled after; the bytes are the f8 values'.

    PYTHONPATH=. python -m benchmarks.gemv_probe                # gpt-1.3b's shapes, on a GPU (about a minute)
    PYTHONPATH=. python -m benchmarks.gemv_probe --quantization fp8 --shape qkv up   # fp8 weights
    PYTHONPATH=. python -m benchmarks.gemv_probe --small        # toy shapes, any backend (checks, no timing)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jax3d.inference import one_row
from jax3d.models import quantized
from jax3d.kernels.pallas_gpu import compiler_params

# gpt-1.3b's one-row GEMMs (K, N): QKV, attention out, MLP up, MLP down, the LM head
SHAPES = {"qkv": (2048, 6144), "out": (2048, 2048), "up": (2048, 8192), "down": (8192, 2048), "head": (2048, 50304)}
# XLA's GEMM with its rows split this many ways as a batch dimension (partial sums added after)
SPLITS = (2, 4, 8, 16)
# the row repeated this many times (jax3d repeats it twice)
ROWS = (4, 8, 16)
# (columns a program, row splits, warps)
TILINGS = ((32, 1, 4), (64, 1, 4), (64, 1, 8), (128, 1, 8), (32, 4, 4), (64, 4, 4), (16, 8, 4))


def _kernel(x_ref, w_ref, o_ref, *, rows: int, cols: int, per_split: int):
    j, s = pl.program_id(0), pl.program_id(1)
    at = pl.ds(pl.multiple_of(j * cols, cols), cols)

    def step(i, acc):
        k = pl.ds(pl.multiple_of(s * per_split + i * rows, rows), rows)
        x = x_ref[0, k].astype(jnp.float32)
        w = w_ref[k, at].astype(jnp.float32)
        return acc + jnp.sum(x[:, None] * w, axis=0)

    acc = jax.lax.fori_loop(0, per_split // rows, step, jnp.zeros((cols,), jnp.float32))
    o_ref[s, at] = acc


@functools.partial(jax.jit, static_argnames=("cols", "splits", "warps", "rows", "interpret"))
def gemv(x_1k, w_kn, cols: int = 64, splits: int = 1, warps: int = 4, rows: int = 256, interpret: bool = False):
    """x (1, K) @ w (K, N) in fp32 sums, x's dtype out: one program per `cols` columns and per `splits`-th of
    the rows, each walking its rows `rows` at a time; the splits' partial sums are added after. K must divide
    into splits x rows, N into cols."""
    k, n = w_kn.shape
    per_split = k // splits
    if per_split % rows or n % cols:
        raise ValueError(f"K={k} N={n} do not divide into {splits} splits of {rows} rows, {cols} columns")
    partial = pl.pallas_call(
        functools.partial(_kernel, rows=rows, cols=cols, per_split=per_split),
        out_shape=jax.ShapeDtypeStruct((splits, n), jnp.float32),
        grid=(n // cols, splits),
        compiler_params=compiler_params(warps, interpret),
        interpret=interpret,
    )(x_1k, w_kn)
    return jnp.sum(partial, axis=0, keepdims=True).astype(x_1k.dtype)


def split_k(x_1k, w_kn, splits: int, rows: int = 2):
    """x (1, K) @ w (K, N) as a batched GEMM of `splits` parts of K (the row `rows` times: twice as
    one_row.gemm), fp32 partial sums added after: more programs for a short, wide weight."""
    k, n = w_kn.shape
    x = jnp.broadcast_to(x_1k, (rows, k)).reshape(rows, splits, k // splits)
    part = jax.lax.dot_general(x, w_kn.reshape(splits, k // splits, n), (((2,), (1,)), ((1,), (0,))),
                               preferred_element_type=jnp.float32)
    return jnp.sum(part[:, :1], axis=0).astype(w_kn.dtype)


def twice_kept(x_1k, w_kn):
    """The row twice as one_row.gemm, but the two rows written to memory first (an optimization barrier keeps
    XLA from fusing the broadcast into the GEMM's operand)."""
    return (jax.lax.optimization_barrier(jnp.broadcast_to(x_1k, (2, x_1k.shape[1]))) @ w_kn)[:1]


def repeated(x_1k, w_kn, rows: int):
    """The row `rows` times (a broadcast XLA fuses into the GEMM's operand), the first row of the product."""
    return (jnp.broadcast_to(x_1k, (rows, x_1k.shape[1])) @ w_kn)[:1]


def transposed(x_1k, w_nk, rows: int):
    """x (1, K) @ w_nk.T for a weight stored (N, K), on the row `rows` times."""
    x = jnp.broadcast_to(x_1k, (rows, x_1k.shape[1]))
    return jax.lax.dot_general(x, w_nk, (((1,), (1,)), ((), ())))[:1]


# variants that take the weight stored transposed, (N, K)
TRANSPOSED = ("xla-wT", "xla-wT-row")


def variants(interpret: bool) -> dict:
    """name: f(x (1, K), w) -> (1, N), w (K, N), or (N, K) for the names in TRANSPOSED."""
    out = {"xla": lambda x, w: one_row.gemm(lambda a, b: jnp.einsum("btk,kn->btn", a, b), x[None], w)[0],
           "xla-row": lambda x, w: x @ w}
    for rows in ROWS:
        out[f"xla-rows{rows}"] = functools.partial(repeated, rows=rows)
    out["xla-wT"] = functools.partial(transposed, rows=2)
    out["xla-wT-row"] = functools.partial(transposed, rows=1)
    for splits in SPLITS:
        out[f"xla-split{splits}"] = functools.partial(split_k, splits=splits)
    out["xla-split4-row"] = functools.partial(split_k, splits=4, rows=1)
    out["xla-twice-kept"] = twice_kept
    for cols, splits, warps in TILINGS:
        out[f"pallas-{cols}x{splits}/{warps}"] = functools.partial(
            gemv, cols=cols, splits=splits, warps=warps, interpret=interpret)
    return out


def fp8_variants(interpret: bool) -> dict:
    """jax3d's one-row GEMM of fp8 weights (`reduce`: quantized.dot, a row reduction over the values stored column
    by column), and variants() on the values in (K, N) order ((N, K) for TRANSPOSED): XLA's converting them inside
    its GEMM, the Pallas GEMV reading the f8 values themselves; every output scaled after."""
    def scaled(name, f):
        if name.startswith("pallas"):
            return lambda x, w: f(x, w[0]) * w[1].astype(x.dtype)
        return lambda x, w: f(x, w[0].astype(x.dtype)) * w[1].astype(x.dtype)
    return {"reduce": lambda x, w: quantized.dot(jnp.matmul, x, w),
            **{name: scaled(name, f) for name, f in variants(interpret).items()}}


def weights_for(name: str, w_kn, fp8: bool):
    """A variant's weight: w (K, N), or (N, K) for the names in TRANSPOSED; with `fp8`, Quantized by column for
    `reduce`, else its values in that order and its scale."""
    if not fp8:
        return jnp.asarray(w_kn.T) if name in TRANSPOSED else w_kn
    q = quantized.quantize(w_kn, (0,))
    if name == "reduce":
        return q
    values = q.unstored()
    return (jnp.asarray(values.T) if name in TRANSPOSED else values), q.scale


def timed(f, x, ws, reps: int, n: int) -> float:
    """Seconds per GEMM: `reps` rounds over the weights `ws`, each GEMM's output added to a running sum (so
    none is dropped), in one compiled loop; best of 5 after a warm-up."""
    def run(x, ws):
        def body(_, acc):
            for w in ws:
                acc = acc + f(x, w).astype(jnp.float32)
            return acc
        return jax.lax.fori_loop(0, reps, body, jnp.zeros((1, n), jnp.float32))

    run = jax.jit(run)
    run(x, ws).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        run(x, ws).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best / (reps * len(ws))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="toy shapes; checks each variant against a dot, no timing")
    p.add_argument("--shape", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--l2-mib", type=int, default=256, help="distinct weights per loop, at least this many MiB")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="the weights as they are (none) or generation's fp8 ones (jax3d.models.quantized)")
    a = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    fp8 = a.quantization == "fp8"
    key = jax.random.key(0)
    all_variants = (fp8_variants if fp8 else variants)(interpret=not gpu)
    if a.small or not gpu:
        for name, f in all_variants.items():
            x = jax.random.normal(key, (1, 2048), dtype)
            w = jax.random.normal(jax.random.fold_in(key, 1), (2048, 256), dtype)
            y = f(x, weights_for(name, w, fp8))
            ref = x.astype(jnp.float32) @ (quantized.dequantize(quantized.quantize(w, (0,))) if fp8 else w)
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)))
            print(json.dumps({"variant": name, "max_abs_err": round(err, 5)}), flush=True)
        return 0
    from benchmarks.profile_decode import copy_rate

    rate = copy_rate(dtype, 1.0)
    print(json.dumps({"device": jax.devices()[0].device_kind, "copy_tb_s": round(rate / 1e12, 3)}), flush=True)
    for shape in a.shape:
        k, n = SHAPES[shape]
        nbytes = k * n * (1 if fp8 else jnp.dtype(dtype).itemsize)
        copies = max(1, math.ceil(a.l2_mib * 2**20 / nbytes))
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), dtype) for i in range(copies)]
        x = jax.random.normal(key, (1, k), dtype)
        rec = {"shape": shape, "k": k, "n": n, "weights": copies, "quantization": a.quantization}
        for name, f in all_variants.items():
            try:
                s = timed(f, x, [weights_for(name, w, fp8) for w in ws], a.reps, n)
                rec[name] = {"us": round(s * 1e6, 2), "gb_s": round(nbytes / s / 1e9, 1),
                             "of_copy_rate": round(nbytes / s / rate, 3)}
            except Exception as e:  # a tiling that does not compile is a result too
                rec[name] = {"error": f"{type(e).__name__}: {str(e)[:120]}"}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
