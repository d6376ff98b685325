"""Why jax3d's FP8 step has no FP8 GEMMs on a GPU, and which pattern gets them: one GPU call.

`PYTHONPATH=. python -m benchmarks.fp8_probe [--hlo-dir DIR]` compiles and times one large GEMM
(x[8,2048,2048] @ w[2048,8192], bf16 out, the model's "btd,df->btf") written several ways, each under a few
XLA flag sets (one child process per set, since XLA_FLAGS are read once), then a one-layer 1.3b-shaped train
step with FP8 off, on, and on without jax3d's Pallas kernels. For each program it lists what the compiled HLO's
GEMMs became: cuBLAS(Lt) custom calls by target (`__cublas$lt$matmul$f8` is an FP8 GEMM), Triton GEMM fusions
with their dot's operand types and whether f8 values are inside the fusion (an f8 prologue in front of a bf16
dot is fake-quantization, not an FP8 GEMM), plain dots. It also keeps the GEMM rewriter's own log lines
(TF_CPP_VMODULE=gemm_rewriter=1), which say why a dot was not rewritten. `--small` runs the same on a CPU at
toy sizes (no timing worth reading; there the report is the dots' operand types and that no GPU is present).

On the GPU: `PYTHONPATH=. python -m benchmarks.fp8_probe --hlo-dir $OUT/fp8_hlo` (about two minutes: --budget
115 s over four child processes, each keeping what it finished if it runs out of time).

What XLA needs, from its sources and NVIDIA's guide (read for this probe):
- openxla/xla xla/service/gpu/transforms/gemm_rewriter.cc (MatchFp8Param, CreateF8CustomCall): each dot
  operand must trace back to an f8 value through `convert`, then optionally `multiply`/`divide` by a
  `broadcast` of a *scalar* (any float type: the rewriter converts it to f32 itself), then only bitcast,
  broadcast, copy, dynamic-slice, pad, reshape, select-with-zero, slice, transpose. An operand that *is* f8
  (a dot of f8 arrays) also matches, with scale 1, and a later `multiply` of the call's output by a broadcast
  scalar is folded into the call (F8ScaleD). e5m2 x e5m2 is refused (one operand must be e4m3fn); output
  bf16/f16/f32/f8; one contracting and one non-contracting dimension per operand (after XLA's dot
  canonicalization); sm_89+ and CUDA 12. Failures are logged at VLOG(1) ("not rewritten into FP8 Custom
  Call"), so the children run with TF_CPP_VMODULE=gemm_rewriter=1 and the report keeps those lines.
- NVIDIA/JAX-Toolbox rosetta/docs/NATIVE_FP8.md ("Exact pattern that XLA can match"): the same
  convert -> multiply(broadcast scalar) -> (x) -> dot, convert and broadcast of one dtype; for FP8 it asked
  for `--xla_gpu_enable_triton_gemm=false` ("essential for enabling the FP8 functionality") and
  `--xla_gpu_enable_cublaslt=true`. JAX-Toolbox PR #1469 (2025) later removed triton_gemm=false from its
  scripts (issue #317: XLA autotunes between Triton and cuBLAS).
- The pass order moved. Older XLA (tensorflow/tensorflow third_party/xla/.../gpu_compiler.cc) ran the FP8
  GemmRewriter *before* Triton's GemmFusion ("Rewrite FP8 GEMMs ahead of Triton which currently lacks
  support for FP8 and may rewrite quantized FP8 GEMMs as higher-precision GEMMs"). Newer openxla/xla
  gpu_compiler.cc runs DotNormalizer, GemvRewriter, GemmFusion, GemmFusionSwapOperands and only *then*
  AddGemmRewriterPasses (kFp8Only, kNonFp8Only); the autotuner's cuBLAS backend re-runs the FP8 rewriter
  (GetCublasRewriterPipeline) on a fusion only when it tries cuBLAS for it. So with Triton GEMMs on (the
  default) a dot of dequantized operands can become a Triton GEMM fusion that takes the f8 -> bf16 convert
  and scale (and the quantize before it) as a prologue and runs a *bf16* MMA: FP8's extra work for no FP8
  speed, which would fit the 0.94x. Triton's dot does accept f8 operands, the mixed (F8E5M2, F8E4M3FN) pair
  included (openxla/xla PR #43522, support.cc IsTritonSupportedDot).
- flax.linen.fp8_ops.fp8_scaled_dot_general (the installed flax) no longer feeds the dot dequantized values:
  it calls `lax.dot_general(q_lhs, q_rhs, preferred_element_type=...)` on the f8 arrays and multiplies the
  output by lhs_scale * rhs_scale afterwards (`out_dq`); jax-ml/jax issue #17176: a dot with an e4m3fn
  operand goes to cuBLASLt FP8.

jax3d.models.fp8 now takes that road: quantize, then dots of the f8 arrays themselves (forward e4m3 x e4m3,
backward e5m2 x e4m3 and e4m3 x e5m2) with preferred_element_type bf16, the output multiplied by the product of
the two scales (powers of two, so exact); `jax3d` / `jax3d-grad` are that, `direct` the bare forward dot, and
`dequantized-grad` (`dequantized_einsum`) jax3d's first pattern, the dequantized bf16 dots, kept to compare.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks import harness
from jax3d.kernels import fp8_cast
from jax3d.models import fp8

# name: extra XLA_FLAGS; each set runs in its own process.
FLAG_SETS = {
    "default": "",
    "no-triton-gemm": "--xla_gpu_enable_triton_gemm=false",
    "no-triton+lt": "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_cublaslt=true",
}
# in the order they run, the telling ones first (a child out of time still reports those it finished)
GEMM_VARIANTS = ("bf16", "jax3d", "direct", "dq-bf16", "bf16-grad", "jax3d-grad", "dequantized-grad", "flax",
                 "flax-grad", "dq-f32", "dq-div", "direct-f32out", "tn-cast-grad")
STEP_VARIANTS = ("step-bf16", "step-fp8", "step-fp8-no-pallas")  # the last only when --only names it
FP8_CALL = "__cublas$lt$matmul$f8"
RESERVE = {"gemms": 15.0, "steps": 35.0}  # seconds of --budget kept for each child still to run
E4M3, E5M2 = "float8_e4m3fn", "float8_e5m2"


# ---- reading a compiled HLO's GEMMs ----------------------------------------------------------------------------
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([^}\s]+(?:,\s*%[^,}\s]+)*)\}?")
_DOT_GENERAL = re.compile(r"stablehlo\.dot_general.*?:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")
_TYPE = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+?|tf32)\[")


def _computations(hlo: str) -> tuple[dict[str, list[str]], dict[str, dict[str, str]]]:
    """({computation: its instruction lines}, {computation: {value name: element type}})."""
    comps, types, name = {}, {}, None
    for line in hlo.splitlines():
        m = _HEADER.match(line)
        if m and not line.startswith((" ", "\t")):
            name = m.group(1)
            comps[name] = []
            types[name] = dict(re.findall(r"([\w.\-]+):\s*(\w+)\[", line.split("->")[0]))
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line)
            d = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(\w+)\[", line)
            if d:
                types[name][d.group(1)] = d.group(2)
    return comps, types


def _callees(line: str) -> list[str]:
    out = []
    for m in _CALLS.finditer(line):
        out += [c.strip().lstrip("%").rstrip(",") for c in m.group(1).split(",")]
    return out


def _operand_types(line: str, op: str, types: dict[str, str]) -> list[str]:
    """The element types of `op`'s operands on `line`: printed with them, or looked up by name in `types`."""
    i = line.find(op + "(")
    depth, j = 0, i + len(op)
    for j in range(i + len(op), len(line)):
        depth += line[j] == "("
        depth -= line[j] == ")"
        if depth == 0:
            break
    inner = line[i + len(op) + 1:j]
    return _TYPE.findall(inner) or [types.get(n, "?") for n in re.findall(r"%([\w.\-]+)", inner)]


def _out_type(line: str) -> str:
    m = re.search(r"=\s*\(?\s*(\w+)\[", line)
    return m.group(1) if m else "?"


def gemm_lowering(hlo: str) -> collections.Counter:
    """How each GEMM of a compiled HLO module runs, counted by label: `custom-call <target> [operand types]`,
    `<fusion backend kind> dot[lhs,rhs->out]` (+ ` f8-in-fusion` when f8 values are inside that fusion), or
    `xla dot[...]` for a dot XLA emits itself (CPU, or a GPU's loop fusion)."""
    return collections.Counter(label for label, _ in gemm_details(hlo))


def gemm_details(hlo: str) -> list[tuple[str, str]]:
    """(label, the op_name XLA kept in its metadata: which einsum it came from) for each GEMM, as gemm_lowering."""
    comps, types = _computations(hlo)
    parent = {}  # callee -> (caller computation, caller line)
    for cname, lines in comps.items():
        for line in lines:
            for callee in _callees(line):
                parent.setdefault(callee, (cname, line))

    def closure(cname):
        seen, todo = set(), [cname]
        while todo:
            c = todo.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                todo += _callees(line)
        return seen

    def outer_fusion(cname):
        """The backend kind of the outermost fusion enclosing computation `cname`, and that fusion's callee."""
        kind, top = None, None
        while cname in parent:
            caller_comp, line = parent[cname]
            if " fusion(" in line:
                m = re.search(r'"kind":"([^"]+)"', line)
                fk = re.search(r"kind=(k\w+)", line)
                kind, top = (m.group(1) if m else (fk.group(1) if fk else "fusion")), cname
            cname = caller_comp
        return kind, top

    def where(line):  # "mlp/btd,df->btf" (forward) or "mlp/transpose(jvp(btd,df->btf))" (its backward)
        m = re.search(r'op_name="([^"]+)"', line)
        parts = [p for p in m.group(1).split("/") if p != "dot_general"] if m else ["?"]
        return "/".join(parts[-2:])

    out = []
    for cname, lines in comps.items():
        for line in lines:
            if "custom-call(" in line:
                m = re.search(r'custom_call_target="([^"]+)"', line)
                target = m.group(1) if m else "?"
                if any(k in target.lower() for k in ("cublas", "gemm", "matmul", "triton", "pallas", "mosaic")):
                    ops = _operand_types(line, "custom-call", types[cname])
                    out.append((f"custom-call {target} [{','.join(ops[:2])}->{_out_type(line)}]", where(line)))
                continue
            for op in ("scaled-dot", "dot"):
                if re.search(rf"\s{op}\(", line):
                    ops = _operand_types(line, op, types[cname])
                    kind, top = outer_fusion(cname)
                    label = f"{kind or 'xla'} {op}[{','.join(ops[:2])}->{_out_type(line)}]"
                    if top and any("f8e" in ln for c in closure(top) for ln in comps[c]) and not any(
                            t.startswith("f8") for t in ops[:2]):
                        label += " f8-in-fusion"
                    out.append((label, where(line)))
                    break
    return out


def lowered_dots(text: str) -> list[str]:
    """The operand and result element types of each dot_general in a lowered (StableHLO) module."""
    found = []
    for m in _DOT_GENERAL.finditer(text):
        found.append("{},{}->{}".format(*(t.rsplit("x", 1)[-1].rstrip(">") for t in m.groups())))
    return found


def summarize(counter: collections.Counter) -> str:
    return "; ".join(f"{n}x {k}" for k, n in sorted(counter.items())) or "-"


# ---- the programs ----------------------------------------------------------------------------------------------
def _dequantize(q, scale, dtype):
    """jax3d's first pattern: convert, then multiply by a broadcast scalar, right before a bf16 dot."""
    return q.astype(dtype) * scale.astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def dequantized_einsum(fmt, x, w, scales):
    """jax3d's first FP8 GEMM, for x[b,t,d] @ w[d,f]: quantize, then bf16 dots of the dequantized operands
    (measured 0.94x of bf16 with no FP8 GEMM compiled; jax3d.models.fp8 now dots the f8 arrays)."""
    return _dequantized_fwd(fmt, x, w, scales)[0]


def _dequantized_fwd(fmt, x, w, scales):
    f8 = fp8.FORMATS[fmt][0]
    qx, qw = fp8.quantize(x, scales[fp8.X], f8), fp8.quantize(w, scales[fp8.W], f8)
    y = jnp.einsum("btd,df->btf", _dequantize(qx, scales[fp8.X], x.dtype), _dequantize(qw, scales[fp8.W], w.dtype))
    return y, (qx, qw, scales, fp8.amax(x), fp8.amax(w))


def _dequantized_bwd(fmt, res, g):
    qx, qw, scales, ax, aw = res
    qg = fp8.quantize(g, scales[fp8.G], fp8.FORMATS[fmt][1])
    _, pull = jax.vjp(functools.partial(jnp.einsum, "btd,df->btf"), _dequantize(qx, scales[fp8.X], g.dtype),
                      _dequantize(qw, scales[fp8.W], g.dtype))
    dx, dw = pull(_dequantize(qg, scales[fp8.G], g.dtype))
    observed = jnp.stack([ax.astype(scales.dtype), aw.astype(scales.dtype), fp8.amax(g).astype(scales.dtype)])
    return dx, dw, observed


dequantized_einsum.defvjp(_dequantized_fwd, _dequantized_bwd)


def gemm_programs(small: bool):
    """{name: (function, args, GEMM flops)} for x[b,t,d] @ w[d,f] in bf16."""
    b, t, d, f = (2, 64, 128, 256) if small else (8, 2048, 2048, 8192)
    spec = "btd,df->btf"
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    bf = jnp.bfloat16
    x = jax.random.normal(kx, (b, t, d), bf)
    w = (jax.random.normal(kw, (d, f), jnp.float32) / d ** 0.5).astype(bf)
    g = jax.random.normal(kg, (b, t, f), bf)
    scales = jnp.array([1.0 / 64, 1.0 / 512, 1.0 / 1024], jnp.float32)  # x, w, g: dequantizing multipliers
    qx = fp8.quantize(x, scales[0], jnp.float8_e4m3fn)
    qw = fp8.quantize(w, scales[1], jnp.float8_e4m3fn)
    sx, sw = scales[0], scales[1]
    flops = 2 * b * t * d * f

    def vjp3(fn, *args):  # forward and both input gradients, the cotangent a random input (not a constant)
        def run(*a):
            y, pull = jax.vjp(fn, *a[:-1])
            return y, pull(a[-1])
        return run, (*args, g)

    programs = {
        "bf16": (lambda x, w: jnp.einsum(spec, x, w), (x, w), flops),
        "jax3d": (lambda x, w, s: fp8.einsum(spec, x, w, s, "hybrid"), (x, w, scales), flops),
        # jax3d's dequantize with the f8 arrays as inputs: is the pattern itself matched, quantize aside?
        "dq-bf16": (lambda qx, qw, sx, sw: jnp.einsum(spec, _dequantize(qx, sx, bf), _dequantize(qw, sw, bf)),
                    (qx, qw, sx, sw), flops),
        # convert and scale in f32 (the scale cuBLASLt takes), dot in f32, then bf16
        "dq-f32": (lambda qx, qw, sx, sw: jnp.einsum(spec, qx.astype(jnp.float32) * sx, qw.astype(jnp.float32) * sw)
                   .astype(bf), (qx, qw, sx, sw), flops),
        "dq-div": (lambda qx, qw, sx, sw: jnp.einsum(spec, qx.astype(bf) / (1 / sx).astype(bf),
                                                     qw.astype(bf) / (1 / sw).astype(bf)), (qx, qw, sx, sw), flops),
        "direct": (lambda qx, qw, sx, sw: fp8.scaled_dot(spec, qx, qw, sx, sw, bf), (qx, qw, sx, sw), flops),
        # the same with an f32 output scaled by the f32 product of the scales (no bf16 rounding of that product;
        # the rewriter can fold the multiply into the call, but the convert to bf16 stays a pass of its own)
        "direct-f32out": (lambda qx, qw, sx, sw: fp8.scaled_dot(spec, qx, qw, sx, sw, jnp.float32).astype(bf),
                          (qx, qw, sx, sw), flops),
    }
    run, args = vjp3(lambda x, w: jnp.einsum(spec, x, w), x, w)
    programs["bf16-grad"] = (run, args, 3 * flops)
    run, args = vjp3(lambda x, w, s: fp8.einsum(spec, x, w, s, "hybrid"), x, w, scales)
    programs["jax3d-grad"] = (run, args, 3 * flops)
    run, args = vjp3(lambda x, w, s: dequantized_einsum("hybrid", x, w, s), x, w, scales)
    programs["dequantized-grad"] = (run, args, 3 * flops)
    # jax3d's TN GEMMs, operands cast in both layouts by the Pallas kernel (jax3d.kernels.fp8_cast); on a CPU
    # they fall back to `jax3d-grad`'s einsum (the kernel runs on one GPU only)
    cast = fp8_cast.Tuning() if jax.default_backend() == "gpu" else None  # the kernel policy of one GPU

    def cast_einsum(x, w, s):
        return fp8.einsum(spec, x, w, s, "hybrid", cast)
    run, args = vjp3(cast_einsum, x, w, scales)
    programs["tn-cast-grad"] = (run, args, 3 * flops)
    try:
        from flax.linen import fp8_ops

        one, hist = jnp.ones((1,), jnp.float32), jnp.zeros((16,), jnp.float32)

        def flax_dot(x, w):
            return fp8_ops.fp8_scaled_dot_general(x, w, (((2,), (0,)), ((), ())), preferred_element_type=bf,
                                                  lhs_scale=one, rhs_scale=one, grad_scale=one, lhs_amax_history=hist,
                                                  rhs_amax_history=hist, grad_amax_history=hist)
        programs["flax"] = (flax_dot, (x, w), flops)
        run, args = vjp3(flax_dot, x, w)
        programs["flax-grad"] = (run, args, 3 * flops)
    except Exception as e:  # noqa: BLE001 - an old or new flax without it: say so in the table
        programs["flax"] = programs["flax-grad"] = (None, f"flax.linen.fp8_ops unusable: {e!r:.120}", 0)
    return {name: programs[name] for name in GEMM_VARIANTS}


def _save(hlo_dir, flagset, name, hlo):
    if hlo_dir:
        os.makedirs(hlo_dir, exist_ok=True)
        with open(os.path.join(hlo_dir, f"{flagset}.{name}.hlo.txt"), "w") as fh:
            fh.write(hlo)


def probe_gemms(flagset: str, small: bool, repeats: int, hlo_dir: str, only=()):
    for name, (fn, args, flops) in gemm_programs(small).items():
        if only and name not in only:
            continue
        rec = {"flags": flagset, "variant": name}
        if fn is None:
            yield {**rec, "error": args}
            continue
        try:
            lowered = jax.jit(fn).lower(*args)
            t0 = time.perf_counter()
            compiled = lowered.compile()
            hlo = compiled.as_text()
            _save(hlo_dir, flagset, name, hlo)
            rec.update(compile_s=round(time.perf_counter() - t0, 2), lowered=lowered_dots(lowered.as_text()),
                       gemms=dict(gemm_lowering(hlo)), fp8_gemms=hlo.count(f'"{FP8_CALL}"'))
            dt = harness.median_seconds(compiled, args, repeats)
            rec.update(ms=round(dt * 1e3, 3), tflops=round(flops / dt / 1e12, 1))
        except Exception as e:  # noqa: BLE001 - one failing variant must not cost the others
            rec["error"] = harness.error_line(e)
        yield rec


def probe_steps(flagset: str, small: bool, repeats: int, hlo_dir: str, only=()):
    """One transformer layer of the 1.3b shape (batch 4), the real train step: FP8 off, on (and on without the Pallas
    kernels, when `only` names step-fp8-no-pallas)."""
    import dataclasses

    from jax3d.kernels import KERNELS

    shape = "tiny" if small else "1.3b-b16"
    batch = 2 if small else 4
    for name, fmt, ablate in (("step-bf16", "", ()), ("step-fp8", "hybrid", ()),
                              ("step-fp8-no-pallas", "hybrid", tuple(KERNELS))):
        if (only and name not in only) or (not only and name == "step-fp8-no-pallas"):
            continue
        rec = {"flags": flagset, "variant": name}
        try:
            run = harness.Run(shape, fp8=fmt, ablate=ablate)
            cfg = harness.config_for(run)
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=1),
                                      train=dataclasses.replace(cfg.train, micro_batch_size=batch,
                                                                global_batch_size=batch))
            steps, state, data, compiled, compile_s = harness.build_config(cfg, 1, run)
            hlo = compiled.as_text()
            _save(hlo_dir, flagset, name, hlo)
            details = gemm_details(hlo)
            rec.update(compile_s=round(compile_s, 2), gemms=dict(collections.Counter(lb for lb, _ in details)),
                       dots=dict(collections.Counter(f"{lb}  <-  {op}" for lb, op in details)),
                       fp8_gemms=hlo.count(f'"{FP8_CALL}"'), kernels=harness.kernels_used(hlo))
            _, _, t0, t1 = harness.time_steps(steps, compiled, state, data, repeats, warmup=1)
            rec["ms"] = round((t1 - t0) / repeats * 1e3, 3)
        except Exception as e:  # noqa: BLE001
            rec["error"] = harness.error_line(e)
        yield rec


def child(args) -> int:
    dev = jax.devices()[0]
    print("RESULT " + json.dumps({"flags": args.flagset, "variant": "_device", "platform": dev.platform,
                                  "device": dev.device_kind, "jax": jax.__version__}), flush=True)
    only = set(args.only.split(",")) if args.only else ()
    if args.steps:
        recs = probe_steps(args.flagset, args.small, max(2, args.repeats // 2), args.hlo_dir, only)
    else:
        recs = probe_gemms(args.flagset, args.small, args.repeats, args.hlo_dir, only)
    for rec in recs:
        print("RESULT " + json.dumps(rec), flush=True)
    return 0


# ---- the parent: one child per flag set, then the table --------------------------------------------------------
def run_job(name: str, steps: bool, args, timeout: float) -> tuple[list[dict], list[str]]:
    """One child under flag set `name`: the GEMM programs, or (`steps`) the one-layer train steps."""
    env = harness.child_env()
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip()
    env["TF_CPP_VMODULE"] = "gemm_rewriter=1"
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.fp8_probe", "--child", name, "--repeats", str(args.repeats)]
    cmd += ["--small"] * args.small + ["--hlo-dir", args.hlo_dir] * bool(args.hlo_dir)
    cmd += ["--only", args.only] * bool(args.only)
    cmd += ["--steps"] * steps
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, err = p.stdout, p.stderr, (None if p.returncode == 0 else f"exit {p.returncode}")
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        err = f"timed out after {timeout:.0f}s"
    recs = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    if err:
        tail = [ln for ln in stderr.splitlines() if ln.strip()][-3:]
        recs.append({"flags": name, "variant": "_steps" if steps else "_gemms",
                     "error": f"{err}: {' | '.join(tail)[:400]}"})
    notes = collections.Counter()
    for ln in stderr.splitlines():
        if "FP8" in ln or "F8" in ln or "fp8" in ln.lower():
            notes[re.sub(r"^.*?\] ", "", ln).strip()[:300]] += 1
    return recs, [f"{n}x {t}" for t, n in notes.most_common(12)]


def table(recs: list[dict]) -> str:
    """One row a program: its time against the plain bf16 program of the same kind and flag set, and its GEMMs."""
    def ms_of(flags, variant):
        return next((x.get("ms") for x in recs if x["flags"] == flags and x["variant"] == variant), None)

    rows = [("flags", "variant", "ms", "TFLOP/s", "vs bf16", "fp8 gemms", "lowered dots", "compiled GEMMs")]
    for r in recs:
        if r["variant"] == "_device":
            continue
        if "error" in r:
            rows.append((r["flags"], r["variant"], "-", "-", "-", "-", "-", "ERROR " + r["error"]))
            continue
        v = r["variant"]
        ref = "step-bf16" if v.startswith("step-") else "bf16-grad" if v.endswith("-grad") else "bf16"
        ref_ms = ms_of(r["flags"], ref)
        vs = f"{ref_ms / r['ms']:.2f}x" if ref_ms and r.get("ms") else "-"
        gemms = summarize(collections.Counter(r.get("gemms", {})))
        if r.get("kernels"):
            gemms += f" | pallas: {','.join(r['kernels'])}"
        rows.append((r["flags"], v, str(r.get("ms", "-")), str(r.get("tflops", "-")), vs,
                     str(r.get("fp8_gemms", "-")), ";".join(r.get("lowered", [])) or "-", gemms))
    widths = [max(len(row[i]) for row in rows) for i in range(7)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:7], widths)) + "  " + row[7] for row in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="toy sizes, for a CPU")
    p.add_argument("--flags", default=",".join(FLAG_SETS), help=f"flag sets to run, of {', '.join(FLAG_SETS)}")
    p.add_argument("--step-flags", default="default",
                   help="flag sets under which the one-layer train steps run, after every set's GEMMs ('' for none)")
    p.add_argument("--only", default="", help="comma-separated variants (default: all)")
    p.add_argument("--repeats", type=int, default=10, help="timed calls per GEMM program (the median is shown)")
    p.add_argument("--budget", type=float, default=115, help="seconds for every child; each child still to run "
                   f"keeps {RESERVE['gemms']:.0f}s ({RESERVE['steps']:.0f}s for steps), and one out of time "
                   "reports what it finished")
    p.add_argument("--hlo-dir", default="", help="write each compiled program's HLO here")
    p.add_argument("--child", dest="flagset", default="", help=argparse.SUPPRESS)
    p.add_argument("--steps", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flagset:
        return child(args)
    unknown = [f for f in (args.flags + "," + args.step_flags).split(",") if f and f not in FLAG_SETS]
    if unknown:
        p.error(f"no flag set {unknown}; choose from {', '.join(FLAG_SETS)}")
    t0 = time.perf_counter()
    recs, notes = [], {}
    jobs = [(n, False) for n in args.flags.split(",") if n] + [(n, True) for n in args.step_flags.split(",") if n]
    for i, (name, steps) in enumerate(jobs):
        kept = sum(RESERVE["steps" if s else "gemms"] for _, s in jobs[i + 1:])
        r, n = run_job(name, steps, args, max(args.budget - (time.perf_counter() - t0) - kept, 10.0))
        recs += r
        notes[name + (" steps" if steps else "")] = n
        for rec in r:
            print(json.dumps(rec), flush=True)
    dev = next((r for r in recs if r["variant"] == "_device"), {})
    print(f"\n# device: {dev.get('device', '?')} ({dev.get('platform', '?')}), jax {dev.get('jax', '?')}; "
          f"{time.perf_counter() - t0:.0f}s")
    if dev.get("platform") != "gpu":
        print("# no GPU present: GEMM lowering below is this platform's (XLA emulates f8 dots); read 'lowered dots'")
    for name, n in notes.items():
        if n:
            print(f"# gemm_rewriter log, {name}:")
            for line in n:
                print(f"#   {line}")
    for r in recs:
        if r.get("dots"):
            print(f"# {r['flags']} {r['variant']}: each GEMM  <-  the op it came from")
            for line, n in sorted(r["dots"].items(), key=lambda kv: kv[0].split("  <-  ")[::-1]):
                print(f"#   {n}x {line}")
    print("# flag sets: " + "; ".join(f"{k}={v or '(none)'}" for k, v in FLAG_SETS.items()))
    print(table(recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
