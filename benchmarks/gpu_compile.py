"""jax3d's programs compiled for a GPU on a machine without one: their kernels, transposes and memory estimate.

XLA's whole GPU pipeline (fusion, GEMM rewriting, Triton lowering of the Pallas kernels, scheduling) runs on
the CPU from a description of the GPU, so a session with no GPU can still read what a change does to the
compiled program. Nothing is autotuned: the GEMMs get one fixed Triton tiling (or cuBLAS, with
`step --opt xla_gpu_enable_triton_gemm=false`), so their kernels may differ from a real compile's; the rest should
not. At gpt-1.3b the decode loop body counted 394 kernels here and in a compile on an H100. Times are never
measured here.

Needs JAX's CUDA plugin (`pip install "jax[cuda13]==0.11.2"`, the GPU machines' JAX, in a Python 3.12 or newer
environment) and a GPU description, a `GpuTargetConfigProto` in text form (XLA's repository keeps one per GPU
under `xla/backends/gpu/target_config/specs/`: `h100_sxm.txtpb`, `h200.txtpb`). The description's cuDNN version
(`dnn_version_info`) decides which cuDNN fusions compile: XLA's H100 file names 8.9.4, and the runs here raised it
to 9.10.0, which is what XLA's H200 file names.

    python -m benchmarks.gpu_compile --target-config h100_sxm.txtpb decode --shape gpt-1.3b --batch 1 32
    python -m benchmarks.gpu_compile --target-config h100_sxm.txtpb decode --batch 1 32 --kv-cache-dtype fp8
    python -m benchmarks.gpu_compile --target-config h100_sxm.txtpb decode --batch 32 --off fused_norm \\
        --opt xla_gpu_experimental_enable_triton_heroless_priority_fusion=true
    python -m benchmarks.gpu_compile --target-config h200.txtpb step --shape 6.7b-b2 --batch 16 --recompute full \\
        --fp8 hybrid --tune fp8_cast:rows=64 --opt xla_gpu_enable_triton_gemm=false

Each line printed is a JSON record: `kernels` (a pass of the program, the bodies of its loops once each),
`by_kind` (fusion kinds, Triton calls, cuBLAS and cuDNN calls), `transposes` (the kernels that
transpose, by result type); `step` adds the compile's peak-memory estimate (`peak_gib`, jax3d.train.memory.step_peak_bytes: at
6.7B, batch 2, full recompute it said 100.7 GiB where the H200 measured 88.7).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

from benchmarks.harness import add_tune_flag, decode_tunings
from benchmarks.profile_decode import PRESET_SHAPES, SHAPES
from jax3d.cli.common import add_decode_dtype_flags


def kernels(hlo: str, loop_body_only: bool = False) -> dict:
    """The kernels of one pass of a compiled program's text (`loop_body_only`: of its first while loop's body;
    benchmarks.profile_decode.kernel_lines): total, by kind (a fusion's kind, Triton's for its fusions, a
    custom call's target, else the operation), and the kernels that transpose (named so by XLA, after their
    hero operation) by their first result's type."""
    from benchmarks.profile_decode import kernel_lines

    by_kind, transposes = collections.Counter(), collections.Counter()
    for op, line in kernel_lines(hlo, loop_body_only):
        if op == "fusion":
            triton = re.search(r'"kind":"(__triton\w*)"', line)
            op = triton.group(1) if triton else re.search(r"kind=(\w+)", line).group(1)
        elif op == "custom-call":
            op = re.search(r'custom_call_target="([^"]+)"', line).group(1)
        if "transpose" in line.split("=", 1)[0]:
            transposes[re.sub(r"[{(].*", "", line.split("=", 1)[1].split()[0].lstrip("("))] += 1
        by_kind[op] += 1
    return {"kernels": sum(by_kind.values()), "by_kind": dict(by_kind.most_common()),
            "transposes": dict(transposes.most_common())}


def _topology(path: str):
    """The compile-only devices of one GPU described by the target config at `path`."""
    from jax.experimental import topologies

    with open(path) as f:
        return topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=f.read())


def _options(pairs: list[str]) -> dict:
    return {k: {"true": True, "false": False}.get(v.lower(), v) for k, v in (p.split("=", 1) for p in pairs)}


def decode(a, topology) -> None:
    import jax
    from jax.experimental import topologies

    from benchmarks.profile_decode import decode_config
    from jax3d.inference import Generator
    from jax3d.config import PrecisionConfig
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.models import build_model
    from jax3d.parallel.precision import PrecisionPolicy

    cfg = decode_config(a.shape)
    params = jax.eval_shape(lambda: build_model(cfg).init(jax.random.key(0)))
    mesh = topologies.make_mesh(topology, (1, 1), ("data", "model"))
    policy = KernelPolicy.resolve("gpu", 1, tunings=a.tuned, off=a.off)
    precision = PrecisionPolicy.of(PrecisionConfig(dtype="bfloat16"), kv_cache_dtype=a.kv_cache_dtype,
                                   quantization=a.quantization)
    for b in a.batch:
        gen = Generator(cfg, params, mesh, batch=b, max_len=a.prompt_len + a.new, dtype=precision.compute_dtype,
                        cache_dtype=precision.cache_dtype, weight_dtype=precision.weight_dtype, kernels=policy)
        # generation's own compiler options, and --opt's beside them
        hlo = gen.decode_hlo([[1] * a.prompt_len] * b, compiler_options=_options(a.opt) or None)
        print(json.dumps({"decode": a.shape, "batch": b, "kv_cache_dtype": gen.cache_dtype.name,
                          "quantization": a.quantization,
                          **kernels(hlo, loop_body_only=True)}), flush=True)


def step(a, topology) -> None:
    from jax.experimental import topologies

    from benchmarks.harness import Run, config_for, kernel_policy
    from jax3d.parallel.plan import resolve
    from jax3d.train.memory import step_peak_bytes
    from jax3d.train.step import abstract_batch, abstract_state, build_steps

    run = Run(a.shape, batch=a.batch[0] if a.batch else 0, recompute=a.recompute, fp8=a.fp8, ablate=tuple(a.ablate),
              tunings=tuple(tuple(t.split(":", 1)) for t in a.tune))
    plan = resolve(config_for(run), 1, platform="gpu", kernels=kernel_policy(run, "gpu", 1))
    mesh = topologies.make_mesh(topology, (1, 1, 1), ("data", "stage", "model"))
    steps = build_steps(plan, mesh)
    lowered = steps.train_step.lower(abstract_state(steps), abstract_batch(steps, steps.model.sample_shapes()))
    compiled = lowered.compile(compiler_options=_options(a.opt) or None)
    print(json.dumps({"step": run.label(), "peak_gib": round(step_peak_bytes(compiled) / 2**30, 2),
                      **kernels(compiled.as_text())}), flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-config", required=True, help="the GPU's GpuTargetConfigProto, in text form")
    sub = p.add_subparsers(dest="program", required=True)
    d = sub.add_parser("decode", help="generation's decode loop (benchmarks.profile_decode's shapes)")
    d.add_argument("--shape", default="gpt-1.3b", choices=[*SHAPES, *PRESET_SHAPES])
    d.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    d.add_argument("--prompt-len", type=int, default=128)
    d.add_argument("--new", type=int, default=256)
    d.add_argument("--off", action="append", default=[], metavar="KERNEL",
                   help="a Pallas kernel left out, its plain JAX in its place (repeatable; "
                        "jax3d.kernels' KERNELS and DECODE_KERNELS)")
    add_tune_flag(d)
    add_decode_dtype_flags(d)
    s = sub.add_parser("step", help="the train step (benchmarks.harness shapes)")
    s.add_argument("--shape", default="1.3b-b16")
    s.add_argument("--batch", type=int, nargs="*", default=[])
    s.add_argument("--recompute", default="none")
    s.add_argument("--fp8", default="")
    s.add_argument("--tune", action="append", default=[], help="module:field=value,... (throughput.py's --tune)")
    s.add_argument("--ablate", action="append", default=[], help="a Pallas kernel left out (throughput.py's --ablate)")
    for program in (d, s):
        program.add_argument("--opt", action="append", default=[],
                             help="an XLA compile option, name=value (repeatable)")
    a = p.parse_args(argv)
    if not os.path.isfile(a.target_config):
        p.error(f"--target-config {a.target_config} is not a file; pass a GPU's GpuTargetConfigProto in text form")
    # Before JAX starts: the host's backend stays the CPU (a CUDA client would find no GPU), and the CUDA
    # plugin skips its library version check, which needs a driver.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    if a.program == "decode":
        from jax3d.kernels import DECODE_KERNELS, KERNELS
        from jax3d.kernels.policy import unknown_kernels

        unknown = unknown_kernels(a.off)
        if unknown:
            p.error(f"--off {unknown[0]} is no kernel of jax3d's; choose from {', '.join(KERNELS + DECODE_KERNELS)}")
        a.tuned = decode_tunings(p, a.tune)
    try:
        topology = _topology(a.target_config)
    except Exception as e:  # noqa: BLE001 (no plugin, or a description it refuses: one sentence either way)
        print(f"gpu_compile: cannot describe a GPU from {a.target_config} ({str(e).splitlines()[0][:200]}); it "
              "needs JAX's CUDA plugin (pip install \"jax[cuda13]\") and a GpuTargetConfigProto text file",
              file=sys.stderr)
        return 2
    (decode if a.program == "decode" else step)(a, topology)
    return 0


if __name__ == "__main__":
    sys.exit(main())
