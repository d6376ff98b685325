"""Where a decoded token's time goes: a device trace of jax3d's generation, against the bytes a step must read.

A GPT of the shape asked (random weights; bf16 on a GPU, fp32 on a CPU) generates `--new` tokens for `--batch`
random prompts of `--prompt-len` tokens. Per decode step (one token of every row) it reports:
- the wall time: (generate(new) - generate(1)) / (new - 1), so prefill is left out;
- the breakdown: `weights_ms`, the weights' bytes over the rate a timed on-device copy moves bytes at (read and
  written, as the bandwidth figures in the issues count them); `cache_ms`, the KV cache the step reads
  (`slots_read`: the decode kernel's whole blocks of the filled part where it runs, else every slot, as XLA's
  attention reads them; see jax3d/inference/cached_attention.py); `else_ms`, the rest of the wall time (launch
  gaps, the host, kernels slower than the bandwidth);
- the kernel time by operation class (benchmarks.profile_step's classes: matmul, attention, elementwise_norm,
  copies, ...), how many kernels ran and how busy the device was, from traces of generate(new) and
  generate(1), the second subtracted from the first;
- with `--top N`, `top_kernels`: the N kernel names that took the most time, [name, us, launches] a step;
- with `--hlo`, `hlo_kernels_per_step`: the kernels of one pass of the compiled token loop's body (fusions,
  GEMMs, copies, collectives), read from the compiled program (on a CPU too; it compiles decode once more).

    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 1 32
    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 1 32 --decode-kernel off   # XLA's attention, and XLA's blocks at batch 1
    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 32 --tune decode_attention:block=128   # a kernel's settings
    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 1 --off row_gemv   # XLA's blocks, not the fused ones
    XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN \
        python -m benchmarks.profile_decode --shape gpt-1.3b --batch 32 --top 12   # the kernels one by one
    python -m benchmarks.profile_decode --shape llama3.2-1b --batch 1 4 8   # grouped-query heads, rotary positions
    python -m benchmarks.profile_decode --shape gpt-1.3b --batch 1 32 --quantization fp8   # GEMM weights in fp8
    python -m benchmarks.profile_decode --shape tiny --batch 1 --new 8   # tries it on a CPU (16-token prompts)
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import tempfile
import time

import numpy as np

from benchmarks.harness import add_decode_kernel_flags, decode_kernel_flags
from benchmarks.profile_step import CLASSES, classify, traced_kernels
from jax3d.cli.common import add_decode_dtype_flags

SHAPES = {"gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=50304, seq_length=2048),
          "tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64)}
# jax3d presets (jax3d.models.presets): grouped-query heads, rotary positions
PRESET_SHAPES = ("llama3.2-1b", "llama-tiny")


def decode_config(shape: str):
    """The ModelConfig a decode benchmark builds for `shape` (SHAPES' or PRESET_SHAPES'), without dropout."""
    from jax3d.config import ModelConfig
    from jax3d.models import get_preset

    cfg = ModelConfig(**SHAPES[shape]) if shape in SHAPES else get_preset(shape)[0]
    return dataclasses.replace(cfg, hidden_dropout=0.0, attention_dropout=0.0)


# HLO operations that are no kernel of their own
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "call", "while", "conditional",
         "after-all", "partition-id", "replica-id"}


def copy_rate(dtype, gib: float) -> float:
    """Bytes per second an on-device copy of a `gib` GiB array moves (read plus written), best of 10 after a
    second of copies. Measured straight after start, with 5 copies, one H100 gave 2.03-2.11 TB/s where earlier calls
    gave 2.43-2.66; an idle GPU starts at low clocks (405 MHz), which may be why."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // jnp.dtype(dtype).itemsize
    x = jnp.ones((n,), dtype)
    copy = jax.jit(lambda a: a + jnp.asarray(1, dtype))
    until = time.perf_counter() + 1.0
    while time.perf_counter() < until:
        copy(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        copy(x).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * jnp.dtype(dtype).itemsize / best


def step_bytes(cfg, params, batch: int, slots: float, itemsize: int, cache_itemsize: int = 0,
               quantized_itemsize: int = 0) -> tuple[int, float]:
    """(weight bytes, cache bytes) one decode step reads: every weight once but the tables a step looks a row up
    in (the positions, and the word embedding where the head has its own table), those generation can keep in fp8
    (jax3d.models.quantized.CONTRACTED) at `quantized_itemsize` bytes each (0: `itemsize`; their scales, under
    0.1%, not counted), and keys and values of `slots` slots of every row and layer, at `cache_itemsize` bytes
    each (0: `itemsize`)."""
    import jax

    from jax3d.models.quantized import CONTRACTED

    looked_up = {"position"} | ({"word"} if cfg.untie_embeddings_and_output_weights else set())

    def read(path, x) -> int:
        name = path[-1].key
        if name in looked_up:
            return 0
        return x.size * ((quantized_itemsize or itemsize) if name in CONTRACTED else itemsize)

    weights = sum(read(path, x) for path, x in jax.tree_util.tree_leaves_with_path(params))
    return weights, 2 * cfg.num_layers * batch * cfg.kv_heads * cfg.head_dim * slots * (cache_itemsize or itemsize)


def breakdown(weight_bytes: int, cache_bytes: int, rate: float, step_ms: float) -> dict:
    """A decode step's milliseconds: the weights' and the cache's bytes at the copy rate, and the rest."""
    weights, cache = weight_bytes / rate * 1e3, cache_bytes / rate * 1e3
    return {"weights": round(weights, 3), "cache": round(cache, 3), "else": round(step_ms - weights - cache, 3)}


def loop_body_kernels(hlo: str) -> collections.Counter:
    """Kernels by HLO operation in one pass of the body of the outermost while loop of a compiled program's
    text, counting into the computations it calls (command buffers on a GPU) but not into fusions or inner
    loops (sampling's sort)."""
    return collections.Counter(op for op, _ in kernel_lines(hlo, loop_body_only=True))


def kernel_lines(hlo: str, loop_body_only: bool):
    """(operation, line) of each kernel a pass of a compiled program's text launches: with `loop_body_only`,
    of the first while loop's body, counting into the computations it calls but not into inner loops; else of
    the whole program, each loop's body once. Fusions count as one kernel."""
    comps, name, entry = {}, None, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head:
            name = head.group(2)
            comps[name] = []
            entry = name if head.group(1) else entry
        elif name is not None and line.startswith("  "):
            comps[name].append(line)

    def loop_in(comp: str):  # the first while loop of `comp` or of the computations it calls
        for line in comps.get(comp, []):
            if " while(" in line:
                return re.search(r"body=%?([\w.\-]+)", line).group(1)
            called = re.search(r" call\(.*to_apply=%?([\w.\-]+)", line)
            if called and loop_in(called.group(1)):
                return loop_in(called.group(1))
        return None

    into = {"call"} if loop_body_only else {"call", "while", "conditional"}
    seen = set()

    def visit(comp: str):
        if comp in seen:
            return
        seen.add(comp)
        for line in comps.get(comp, []):
            line = re.sub(r"/\*.*?\*/", "", line)  # a long tuple's "/*index=5*/" would stop the match
            op = re.search(r"= (?:\([^=]*\)|[\w\[\]{},:\d]+) ([\w\-]+)\(", line)
            if op is None:
                continue
            if op.group(1) in into:
                for called in re.findall(r"(?:to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", line):
                    yield from visit(called)
            elif op.group(1) not in _FREE and not op.group(1).endswith("-done"):
                yield op.group(1), line

    yield from visit(loop_in(entry) if loop_body_only else entry)


def _trace(fn) -> list:
    import jax

    with tempfile.TemporaryDirectory(prefix="jax3d-decode-prof-") as logdir:
        with jax.profiler.trace(logdir, create_perfetto_trace=True):
            fn()
        return traced_kernels(logdir, {})


def best_time(fn, repeats: int) -> tuple[float, object]:
    """(the fewest seconds of `repeats` calls of `fn`, the last call's result)."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def step_wall_ms(gen, rows: list[list[int]], new: int, repeats: int = 3) -> float | None:
    """A decode step's wall ms: (generate(new) - generate(1)) / (new - 1), each the best of `repeats`; timed
    again with twice the repeats, twice, while it is not positive (a short run on a CPU can take less than the
    timer's noise), then None."""
    for tries in range(3):
        t_new, t_one = (best_time(lambda n=n: gen.generate(rows, n), repeats << tries)[0] for n in (new, 1))
        if t_new > t_one:
            return (t_new - t_one) / (new - 1) * 1e3
    return None


def profile(gen, rows: list[list[int]], new: int, top: int = 0) -> dict:
    """Per decode step, from device traces of generate(new) and generate(1): kernel ms by class, kernels and
    device busy fraction; with `top`, the `top` kernel names that took the most time, each with its us and
    launches a step."""
    long, short = _trace(lambda: gen.generate(rows, new)), _trace(lambda: gen.generate(rows, 1))
    by_class, by_name, launches = collections.Counter(), collections.Counter(), collections.Counter()
    for sign, kernels in ((1, long), (-1, short)):
        for name, hlo_op, scope, us, _ in kernels:
            by_class[classify(name, hlo_op, scope)] += sign * us
            by_name[name] += sign * us
            launches[name] += sign
    spans = sorted((ts, ts + us) for *_, us, ts in long)
    busy, first, end = 0.0, spans[0][0], spans[0][0]
    start = first
    for s, e in spans:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    per = 1.0 / (new - 1)
    named = {"top_kernels": [[name, round(us * per, 2), round(launches[name] * per, 2)]
                             for name, us in by_name.most_common(top)]} if top else {}
    return {"kernel_ms_per_step": {c: round(by_class[c] / 1e3 * per, 3) for c in CLASSES},
            "kernel_ms_total_per_step": round(sum(by_class.values()) / 1e3 * per, 3),
            "kernels_per_step": round((len(long) - len(short)) * per, 1),
            "device_busy": round(busy / max(end - first, 1e-9), 3), **named}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, *PRESET_SHAPES], default="gpt-1.3b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=0, help="default 128 (16 for the tiny shapes: tiny, llama-tiny)")
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--hlo", action="store_true", help="count the kernels of the compiled token loop's body")
    p.add_argument("--decode-kernel", choices=["auto", "off"], default="auto",
                   help="decode's attention as jax3d.kernels.decode_attention, a Pallas kernel reading only the "
                        "filled slots, where it runs (auto: on one GPU; --tune decode_attention:parts=N sets its "
                        "parts a row), or never: XLA's attention, and at batch 1 XLA's blocks (off: every decode "
                        "kernel, as --off for each)")
    p.add_argument("--top", type=int, default=0, metavar="N",
                   help="also list the N kernels (by name) that took the most time a step, with their us and "
                        "launches a step; decode runs as a CUDA graph, whose kernels a trace does not show one by "
                        "one: add XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN")
    add_decode_kernel_flags(p)
    add_decode_dtype_flags(p)
    a = p.parse_args(argv)
    if a.top < 0:
        p.error(f"--top {a.top}: give how many kernels to list, 0 (none) or more")
    if a.new < 2:
        p.error(f"--new {a.new}: give 2 or more (a step's time is generate(new) less generate(1))")
    tuned, off = decode_kernel_flags(p, a)
    a.prompt_len = a.prompt_len or (16 if a.shape.endswith("tiny") else 128)
    cfg = decode_config(a.shape)
    if a.prompt_len + a.new > cfg.max_position_embeddings:
        p.error(f"--prompt-len {a.prompt_len} plus --new {a.new} is longer than {a.shape}'s "
                f"{cfg.max_position_embeddings} positions; ask for fewer")
    import jax
    import jax.numpy as jnp

    from jax3d.kernels import DECODE_KERNELS
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import build_model
    from jax3d.config import PrecisionConfig
    from jax3d.parallel.mesh import MeshConfig
    from jax3d.parallel.precision import PrecisionPolicy, dtype_of_flags

    on_gpu = jax.default_backend() == "gpu"
    precision = PrecisionPolicy.of(PrecisionConfig(dtype=dtype_of_flags(on_gpu)), kv_cache_dtype=a.kv_cache_dtype,
                                   quantization=a.quantization)
    dtype, cache_dtype, weights = precision.compute_dtype, precision.cache_dtype, precision.weight_dtype
    item = jnp.dtype(dtype).itemsize
    params = build_model(cfg).init(jax.random.key(0))
    weight_bytes = step_bytes(cfg, params, 1, 0, item, quantized_itemsize=jnp.dtype(weights or dtype).itemsize)[0]
    rate = copy_rate(dtype, 2.0 if on_gpu else 0.125)
    weights_ms = weight_bytes / rate * 1e3
    print(json.dumps({"shape": a.shape, "device": jax.devices()[0].device_kind, "dtype": jnp.dtype(dtype).name,
                      "weight_gb": round(weight_bytes / 1e9, 3), "copy_tb_s": round(rate / 1e12, 3),
                      "weights_ms": round(weights_ms, 3), "decode_kernel": a.decode_kernel,
                      "kv_cache_dtype": cache_dtype.name, "quantization": a.quantization,
                      **({"tune": a.tune} if a.tune else {}), **({"off": a.off} if a.off else {})}), flush=True)
    rs = np.random.RandomState(0)
    mesh = MeshConfig(1, 1, 1).build(jax.devices()[:1])
    off = DECODE_KERNELS if a.decode_kernel == "off" else off
    kernels = KernelPolicy.resolve(jax.devices()[0].platform, 1, tunings=tuned, off=off)
    _profile_batches(a, cfg, params, mesh, (dtype, cache_dtype, weights), rs, weight_bytes, rate, weights_ms, kernels)
    return 0


def decode_kernel_runs(cfg, kernels, batch: int, slots: int) -> bool:
    """Whether decode's attention is jax3d.kernels.decode_attention's under the KernelPolicy `kernels`
    (generation's)."""
    import jax
    import jax.numpy as jnp

    cache = jax.ShapeDtypeStruct((batch, cfg.kv_heads, slots, cfg.head_dim), jnp.bfloat16)
    return kernels.takes("decode_attention", cache)


def fused_blocks_run(gen, batch: int) -> bool:
    """Whether `gen`'s decode runs its blocks as jax3d.inference.decode_rows' kernels (batch 1 on one GPU), under
    its kernel policy."""
    import jax

    from jax3d.inference import decode_rows

    cfg = gen.cfg
    x = jax.ShapeDtypeStruct((batch, 1, cfg.hidden_size), gen.dtype)
    cache = {"k": jax.ShapeDtypeStruct((batch, cfg.kv_heads, gen.max_len, cfg.head_dim), gen.cache_dtype),
             "start": None}
    with jax.set_mesh(gen.mesh):
        return decode_rows.applies(cfg, gen.params["blocks"][0], x, cache, gen.kernels)


def slots_read(cfg, kernels, batch: int, prompt_len: int, new: int) -> float:
    """The cache slots a decode step reads per row, averaged over the steps: where the decode kernel runs, whole
    blocks from slot 0 (a row of a full-length prompt) to the block of the slot before the one being decoded
    (whose key and value the kernel has in hand, and writes); else every slot, as XLA's attention reads them."""
    if not decode_kernel_runs(cfg, kernels, batch, prompt_len + new):
        return prompt_len + new
    block = kernels.tuning("decode_attention").block
    steps = range(prompt_len, prompt_len + new - 1)
    return sum(-(-i // block) * block for i in steps) / len(steps)


def _profile_batches(a, cfg, params, mesh, dtypes, rs, weight_bytes, rate, weights_ms, kernels) -> None:
    """Decode of each of --batch's sizes, the model computing, keeping its cache and its GEMM weights in
    `dtypes`, under the KernelPolicy `kernels`."""
    from jax3d.inference import Generator

    dtype, cache_dtype, weights = dtypes
    for b in a.batch:
        max_len = a.prompt_len + a.new
        gen = Generator(cfg, params, mesh, batch=b, max_len=max_len, dtype=dtype, cache_dtype=cache_dtype,
                        weight_dtype=weights, kernels=kernels)
        rows = [list(map(int, r)) for r in rs.randint(0, cfg.vocab_size, (b, a.prompt_len))]
        gen.generate(rows, a.new)  # compiles prefill and decode
        wall = step_wall_ms(gen, rows, a.new)
        if wall is None:
            raise SystemExit(f"profile_decode: generating {a.new} tokens took no longer than generating 1, within "
                             f"the timer's noise; pass a larger --new")
        wall = round(wall, 3)
        rec = {"wall_ms_per_step": wall, **profile(gen, rows, a.new, top=a.top)}
        tuning = kernels.tuning("decode_attention")
        kernel = decode_kernel_runs(cfg, kernels, b, max_len)
        read = slots_read(cfg, kernels, b, a.prompt_len, a.new)
        rec = {"batch": b, "tokens_per_s": round(b * 1e3 / wall, 1), "decode_kernel_ran": kernel,
               "fused_blocks_ran": fused_blocks_run(gen, b),
               **({"decode_kernel_parts": tuning.parts_for(b * cfg.num_attention_heads)} if kernel else {}),
               "breakdown_ms": breakdown(weight_bytes, step_bytes(cfg, params, b, read, cache_dtype.itemsize)[1],
                                         rate, wall),
               "of_weights_limit": round(weights_ms / wall, 3), **rec, "compiles": gen.compile_counts()}
        if a.hlo:
            body = loop_body_kernels(gen.decode_hlo(rows))
            rec.update(hlo_kernels_per_step=sum(body.values()), hlo_kernels_by_op=dict(body.most_common(8)))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
