"""Breaks one train step down by operation class, from a device trace: where the time goes.

jax3d's real step runs a few steps under `jax.profiler`; every GPU kernel is classed as matmul,
attention, elementwise and normalisation, optimizer, communication or copies (by kernel name, and by
the jax name scope that XLA's metadata keeps for each fusion), and the classes are summed per step.
With `--peer` the PyTorch peer's step is traced with `torch.profiler` and classed by the same rules.
One JSON line per side, then a table in milliseconds per step, with each side's GPU busy fraction and
median SM clock over the traced steps (kernel times scale with the clock, which the power cap sets).

    python -m benchmarks.profile_step --shape 1.3b-b16 --peer
    python -m benchmarks.profile_step --shape tiny    # tries it on a CPU (XLA's CPU ops, classed the same way)

It is a GPU benchmark: on a CPU, a shape whose train step needs more than the host's free memory stops
with one sentence before anything is allocated.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import importlib.util
import json
import os
import re
import sys
import tempfile
import time

from benchmarks.harness import (DEFAULT_PEER, SHAPES, VOCAB, GpuLog, Run, _child, build, child_env, dims, is_bert,
                                step_host_shortfall)
from jax3d.kernels import KERNELS

CLASSES = ("matmul", "attention", "elementwise_norm", "optimizer", "communication", "copies")
_COMM = ("nccl", "all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_ATTN = ("cudnn", "fmha", "flash", "sdpa", "attention", "dot_product_attention")
_GEMM = ("gemm", "nvjet", "cutlass", "xmma", "cublas", "gemv", "matmul", "sm90_", "dot")
_OPT = ("/optimizer/", "adam", "multi_tensor")


def classify(kernel: str, hlo_op: str = "", scope: str = "") -> str:
    """The operation class of one kernel, from its name, HLO instruction and jax name scope."""
    k, h, s = kernel.lower(), hlo_op.lower(), scope.lower()
    if any(c in k or c in h for c in _COMM):
        return "communication"
    if "memcpy" in k or "memset" in k:
        return "copies"
    if any(a in k for a in _ATTN) or "dot_product_attention" in s:
        return "attention"
    if any(o in s or o in k for o in _OPT):
        return "optimizer"
    if any(g in k for g in _GEMM) or h.startswith(("cublas", "gemm", "custom-call")):
        return "matmul"
    if h.startswith(("ynn", "xnn")) and s.endswith("dot_general"):  # a CPU's library-fused product
        return "attention" if "bnts" in s else "matmul"  # the attention core's einsums, spelled out in XLA
    if h.startswith(("copy", "transpose")) or k.startswith(("copy", "transpose")) or "transpose" in k:
        return "copies"
    return "elementwise_norm"


def _scopes_from_hlo(hlo_text: str) -> dict:
    """HLO instruction name -> jax name scope (op_name metadata), for the trace's `hlo_op`.

    A fusion carries the scope of its root, which for the optimizer's update is often the
    concatenate or select it fused in; a fusion with any instruction from the `optimizer` scope
    inside it is given that scope, so the update is classed as optimizer work."""
    out, calls = {}, {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", hlo_text, re.M):
        name, rest = m.groups()
        scope = re.search(r'op_name="([^"]*)"', rest)
        if scope:
            out[name] = scope.group(1)
        called = re.search(r"calls=%([\w.\-]+)", rest)
        if called:
            calls[name] = called.group(1)
    optimizer_comps = set()
    for m in re.finditer(r"^%([\w.\-]+) .*?\{\n(.*?)^\}", hlo_text, re.M | re.S):
        if "/optimizer/" in m.group(2):
            optimizer_comps.add(m.group(1))
    for name, comp in calls.items():
        if comp in optimizer_comps and "/optimizer/" not in out.get(name, ""):
            out[name] = "/optimizer/" + out.get(name, "")
    return out


def _summarise(kernels, steps: int) -> dict:
    """kernels: (name, hlo_op, scope, microseconds, start in microseconds). Milliseconds per step by
    class, the top kernels (instances of one HLO op kind in one scope taken together, e.g. the 24
    layers' attention backward, with how many ran per step), and how busy the GPU was from the first
    kernel's start to the last one's end."""
    by_class = collections.Counter()
    by_kernel = collections.Counter()
    count = collections.Counter()
    by_scope = collections.Counter()
    for name, hlo_op, scope, us, _ in kernels:
        c = classify(name, hlo_op, scope)
        by_class[c] += us
        key = (c, re.sub(r"\.\d+$", "", hlo_op) if hlo_op else name[:80], _scope_key(scope))
        by_kernel[key] += us
        count[key] += 1
        by_scope[(c, _scope_key(scope))] += us
    ms = {c: round(by_class[c] / 1e3 / steps, 2) for c in CLASSES}
    ms["total"] = round(sum(by_class.values()) / 1e3 / steps, 2)
    top = [{"class": c, "op": n, "scope": sc, "per_step": round(count[(c, n, sc)] / steps, 1),
            "ms": round(us / 1e3 / steps, 2)} for (c, n, sc), us in by_kernel.most_common(60)]
    scopes = [{"class": c, "scope": n, "ms": round(us / 1e3 / steps, 2)}
              for (c, n), us in by_scope.most_common(50) if n]
    return {"ms_per_step": ms, "gpu_busy": _busy(kernels), "top": top, "top_scopes": scopes}


def _busy(kernels) -> float:
    """The fraction of the traced span in which at least one kernel ran; the rest is the GPU waiting
    (on launches, on the host) between kernels."""
    spans = sorted((ts, ts + us) for *_, us, ts in kernels)
    if not spans:
        return 0.0
    busy, (start, end) = 0.0, spans[0]
    first = start
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return round(busy / max(end - first, 1e-9), 4)


def _scope_key(scope: str) -> str:
    """A name scope without its jit prefixes and per-call numbering: where in the model a kernel ran."""
    parts = [q for q in scope.split("/") if q and not q.startswith("jit(")]
    return re.sub(r"\d+", "#", "/".join(parts))[:140]


def profile_jax3d(run: Run, steps: int, hlo_out: str = "") -> dict:
    import jax

    st, state, batch, compiled, _ = build(run)
    hlo = compiled.as_text()
    if hlo_out:
        with open(hlo_out, "w") as f:
            f.write(hlo)
    scopes = _scopes_from_hlo(hlo)
    with jax.set_mesh(st.mesh), tempfile.TemporaryDirectory(prefix="jax3d-prof-") as logdir:
        for _ in range(3):
            state, _m = compiled(state, batch)
        jax.block_until_ready(state)
        with GpuLog() as gpu, jax.profiler.trace(logdir, create_perfetto_trace=True):
            t0 = time.perf_counter()
            for _ in range(steps):
                state, _m = compiled(state, batch)
            jax.block_until_ready(state)
            t1 = time.perf_counter()
        kernels = traced_kernels(logdir, scopes)
    return {"who": "jax3d", "run": run.label(), **_summarise(kernels, steps), "kernels_seen": len(kernels),
            **gpu.summary(t0, t1)}


def traced_kernels(logdir: str, scopes: dict) -> list:
    """(name, hlo_op, scope, microseconds, start) of every device kernel in the jax.profiler trace under
    `logdir` (XLA's CPU thunks where there is no GPU); `scopes` maps HLO instruction names to name scopes."""
    path = sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    kernels = []
    for e in events:
        if e.get("ph") != "X" or not procs.get(e.get("pid"), "").startswith("/device:GPU"):
            continue
        # Device streams hold the kernels; the derived "XLA Ops"/"XLA Modules" lines would count them twice.
        if "stream" not in threads.get((e["pid"], e.get("tid")), "").lower():
            continue
        hlo_op = (e.get("args") or {}).get("hlo_op", "")
        kernels.append((e.get("name", ""), hlo_op, scopes.get(hlo_op, ""), float(e.get("dur", 0)), float(e["ts"])))
    if not kernels:  # no GPU: XLA's CPU thunks carry the same hlo_op, which lets the tool run anywhere
        kernels = [(e["name"], e["args"]["hlo_op"], scopes.get(e["args"]["hlo_op"], ""), float(e.get("dur", 0)),
                    float(e["ts"]))
                   for e in events if e.get("ph") == "X" and "hlo_op" in (e.get("args") or {})]
    return kernels


def profile_peer(shape: str, batch: int, steps: int, script: str) -> dict:
    import torch

    spec = importlib.util.spec_from_file_location("torch_gpt_peer", script)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    layers, d, heads, seq, b = dims(shape)
    batch = batch or b
    torch.manual_seed(0)
    model = peer.GPT(VOCAB, seq, d, heads, layers).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model)
    x = torch.randint(0, VOCAB, (batch, seq), device="cuda")
    y = torch.randint(0, VOCAB, (batch, seq), device="cuda")

    def step():  # the peer script's own step
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with GpuLog() as gpu, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="peer-prof-") as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], "", "", float(e.get("dur", 0)), float(e["ts"])) for e in events
               if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    return {"who": "peer", "run": f"{shape} b{batch}", **_summarise(kernels, steps), "kernels_seen": len(kernels),
            **gpu.summary(t0, t1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.3b-b16", choices=list(SHAPES))
    p.add_argument("--batch", type=int, default=0, help="batch size (0: the shape's own)")
    p.add_argument("--ablate", action="append", default=[], choices=KERNELS,
                   help="profile with this Pallas kernel left out, XLA's code in its place (repeatable)")
    p.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    p.add_argument("--fp8", default="", choices=["hybrid", "e4m3"], help="profile with FP8 GEMMs in the blocks")
    p.add_argument("--steps", type=int, default=3, help="traced steps")
    p.add_argument("--peer", nargs="?", const=DEFAULT_PEER, default=None, help="trace the PyTorch peer too")
    p.add_argument("--out", default="", help="also write the JSON lines to this file")
    p.add_argument("--hlo-out", default="", help="also write jax3d's compiled HLO text to this file")
    p.add_argument("--peer-only", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.peer_only:
        print("RESULT " + json.dumps(profile_peer(a.shape, a.batch, a.steps, a.peer)))
        return 0
    recs = []
    if a.peer and is_bert(a.shape):
        print(f"--peer: the peer is a GPT; {a.shape} is profiled alone", file=sys.stderr)
    elif a.peer:  # first, in its own process: once JAX starts here it holds most of the device memory
        cmd = [sys.executable, "-m", "benchmarks.profile_step", "--peer-only", "--peer", a.peer, "--shape", a.shape,
               "--batch", str(a.batch), "--steps", str(a.steps)]
        recs.append(_child(cmd, child_env(), "peer profile"))
    # Command buffers (CUDA graphs) hide which fusion each kernel ran for; the trace then names only
    # the buffer. Profile without them, so every kernel keeps its HLO name and name scope.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    run = Run(a.shape, a.batch, ablate=tuple(a.ablate), recompute=a.recompute, fp8=a.fp8)
    short = step_host_shortfall(run)  # starts JAX: after the peer, whose device memory JAX would take
    if short:
        print(f"error: profile_step.py --shape {a.shape} is a GPU benchmark, and its train step {short}; run it "
              "on a GPU, or try --shape tiny on a CPU", file=sys.stderr)
        return 2
    recs.insert(0, profile_jax3d(run, a.steps, a.hlo_out))
    for r in recs:
        print(json.dumps(r), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(r) + "\n")
    recs = [r for r in recs if "error" not in r]
    print("\n%-18s" % "ms per step" + "".join("%12s" % r["who"] for r in recs))
    for c in (*CLASSES, "total"):
        print("%-18s" % c + "".join("%12.1f" % r["ms_per_step"][c] for r in recs))
    print("%-18s" % "GPU busy" + "".join("%12s" % f"{r['gpu_busy']:.1%}" for r in recs))
    print("%-18s" % "SM clock, MHz" + "".join("%12s" % r.get("sm_clock_mhz", "-") for r in recs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
