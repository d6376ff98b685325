"""Where a decoded token's time goes: a device trace of jax3d's KV-cache generation.

A GPT of the shape asked (random weights; bf16 on a GPU, fp32 on a CPU) generates `--new` tokens for `--batch`
random prompts of `--prompt-len` tokens. Per decoded token it reports the wall time (median interval of the
stream), the kernel time by operation class (benchmarks.profile_step's classes: matmul, attention,
elementwise_norm, copies, ...), how many kernels ran, how busy the device was, and the floor the weights set:
their bytes over the rate a timed on-device copy moves bytes at (read and written, as the bandwidth figures
in the issues count them). The trace spans the whole stream, prefill included (one call of many).

    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 1 32
    python -m benchmarks.profile_decode --shape tiny --batch 1 --new 8   # tries it on a CPU
"""
from __future__ import annotations

import argparse
import collections
import json
import tempfile
import time

import numpy as np

from benchmarks.profile_step import CLASSES, classify, traced_kernels

SHAPES = {"gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304, seq_length=2048),
          "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)}


def copy_rate(dtype, gib: float) -> float:
    """Bytes per second an on-device copy of a `gib` GiB array moves (read plus written), best of 5."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
    x = jnp.ones((n,), dtype)
    copy = jax.jit(lambda a: a + jnp.asarray(1, dtype))
    copy(x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * jnp.dtype(dtype).itemsize / best


def profile(gen, rows: list[list[int]], new: int) -> dict:
    """Per decoded token: wall ms, kernel ms by class, kernels and device busy fraction."""
    import jax

    stamps = [time.perf_counter() for _ in gen.stream(rows, new)]
    wall = float(np.median(np.diff(stamps))) * 1e3
    logdir = tempfile.mkdtemp(prefix="jax3d-decode-prof-")
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in gen.stream(rows, new):
            pass
    kernels = traced_kernels(logdir, {})
    by_class = collections.Counter()
    for name, hlo_op, scope, us, _ in kernels:
        by_class[classify(name, hlo_op, scope)] += us
    spans = sorted((ts, ts + us) for *_, us, ts in kernels)
    busy, first, end = 0.0, spans[0][0], spans[0][0]
    start = first
    for s, e in spans:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    per = 1.0 / new
    return {"wall_ms_per_token": round(wall, 3),
            "kernel_ms_per_token": {c: round(by_class[c] / 1e3 * per, 3) for c in CLASSES},
            "kernel_ms_total_per_token": round(sum(by_class.values()) / 1e3 * per, 3),
            "kernels_per_token": round(len(kernels) * per, 1),
            "device_busy": round(busy / max(end - first, 1e-9), 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="gpt-1.3b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    a = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jax3d.config import ModelConfig
    from jax3d.inference import Generator
    from jax3d.models import build_model
    from jax3d.parallel.mesh import MeshConfig

    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    cfg = ModelConfig(**SHAPES[a.shape], hidden_dropout=0.0, attention_dropout=0.0)
    params = build_model(cfg).init(jax.random.key(0))
    weight_bytes = sum(x.size for x in jax.tree.leaves(params)) * jnp.dtype(dtype).itemsize
    rate = copy_rate(dtype, 2.0 if on_gpu else 0.125)
    print(json.dumps({"shape": a.shape, "device": jax.devices()[0].device_kind, "dtype": jnp.dtype(dtype).name,
                      "weight_gb": round(weight_bytes / 1e9, 3), "copy_tb_s": round(rate / 1e12, 3),
                      "floor_ms_per_token": round(weight_bytes / rate * 1e3, 3)}), flush=True)
    rs = np.random.RandomState(0)
    mesh = MeshConfig(1, 1, 1).build(jax.devices()[:1])
    for b in a.batch:
        gen = Generator(cfg, params, mesh, batch=b, max_len=a.prompt_len + a.new, dtype=dtype)
        rows = [list(map(int, r)) for r in rs.randint(0, cfg.vocab_size, (b, a.prompt_len))]
        gen.generate(rows, 2)  # compiles prefill and decode
        rec = profile(gen, rows, a.new)
        rec = {"batch": b, "tokens_per_s": round(b * 1e3 / rec["wall_ms_per_token"], 1), **rec,
               "compiles": gen.compile_counts()}
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
