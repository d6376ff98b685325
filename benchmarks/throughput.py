"""One-device throughput of jax3d's real train step, optionally beside the PyTorch peer, in one call.

Every configuration runs in its own process (its own peak-memory counter and XLA flags) and prints one
JSON line: tokens/s, TFLOP/s per device, MFU (model FLOPs over 989 TFLOP/s on an H100/H200, counted as
the peer counts them), step time, compile time, peak device memory, and on a GPU the median SM clock and
board power over the timed steps (an H200 runs these steps at its power cap, below its peak clock). With
`--peer` the peer runs at each shape too and a ratio line follows. `--ablate KERNEL` (repeatable, or
`all`) adds a run with that Pallas kernel left out (XLA's code in its place), so each one's worth is
measured in the same call. Because each run is a fresh process, a change patched into this one (a
replaced function, say) never reaches the step; kernel settings travel with the run instead (`--tune`,
`harness.Run.tunings`, which the child builds its step's kernel policy from: `harness.kernel_policy`).

    python -m benchmarks.throughput --shape 1.3b-b16 --peer --ablate all --ablate together
    python -m benchmarks.throughput --shape 1.3b-b16 1.3b-b8 350m-b32 125m-b32 --peer
    python -m benchmarks.throughput --shape 125m-b32 --tune fused_xent:block=2048,warps=4
    python -m benchmarks.throughput --shape bert-large-b32   # BERT (no peer); MFU counts GPT's FLOPs per token
    python -m benchmarks.throughput --shape tiny --dtype float32 --ablate all   # tries it on a CPU
    python -m benchmarks.throughput --shape 1.3b-b16 llama3.2-1b-b8 --peer --fp8 hybrid   # bf16, FP8, peer
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.harness import emitter, DEFAULT_PEER, SHAPES, Run, is_bert, kernel_tuning, run_isolated, run_peer
from jax3d import kernels
from jax3d.kernels import KERNELS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs="+", default=["1.3b-b16"], choices=list(SHAPES), help="model shapes to run")
    p.add_argument("--batch", type=int, nargs="+", default=[0], help="batch sizes (0: the shape's own)")
    p.add_argument("--ablate", action="append", default=[], choices=["all", "together", *KERNELS],
                   help="also run with this Pallas kernel left out, XLA's code in its place (repeatable; "
                        "'all': each in turn; 'together': one run with none of them)")
    p.add_argument("--recompute", nargs="+", default=["none"], choices=["none", "selective", "full"])
    p.add_argument("--xla-flags", action="append", default=[],
                   help="also run with these XLA flags (one string per extra run; with --fp8, in its first format "
                        "and the first --recompute, e.g. to time the FP8 step's compile under XLA's autotuning options)")
    p.add_argument("--tune", action="append", default=[], metavar="KERNEL:FIELD=V[,FIELD=V]",
                   help="also run with these kernel settings, e.g. fused_gelu:cols_fwd=2048,rows_fwd=2 "
                        "(one run per --tune; fields of the kernel module's Tuning). A run in which that "
                        "kernel does not run (a CPU, or settings that do not fit the shape) reports an error. "
                        "Tuned runs take the first --recompute; fp8_cast's also the first --fp8 format, "
                        "e.g. --fp8 hybrid --tune fp8_cast:rows=64")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--fp8", nargs="+", default=[], choices=["hybrid", "e4m3"],
                   help="also run with FP8 GEMMs in these formats, after the plain runs (at each --recompute), so "
                        "vs_first is FP8 over the shape's first plain run (default: none)")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout of every jax3d run (Megatron's default is 0.1; the "
                        "peer runs without); attention with dropout is XLA's, not cuDNN's")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after 3 warm-up steps)")
    p.add_argument("--peer", nargs="?", const=DEFAULT_PEER, default=None,
                   help=f"run the PyTorch peer too (default script: {os.path.relpath(DEFAULT_PEER)})")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    a = p.parse_args(argv)
    if a.peer and not os.path.exists(a.peer):
        p.error(f"--peer: no script at {a.peer}; copy the peer there or pass its path")
    tunings = []
    for t in a.tune:
        module, _, fields = t.partition(":")
        try:
            kernel_tuning(module, fields)
        except ValueError as e:
            p.error(f"--tune {t}: {e}")
        if module == "fp8_cast" and not a.fp8:
            p.error(f"--tune {t}: the FP8 cast kernel runs only in FP8 GEMMs; add --fp8 hybrid")
        tunings.append(((module, fields),))
    # 'all' leaves out each kernel that runs by default; fp8_cast runs in FP8 GEMMs only, so its ablation is an
    # FP8 run, and 'all' takes it only with --fp8
    if "fp8_cast" in a.ablate and not a.fp8:
        p.error("--ablate fp8_cast: the FP8 cast kernel runs only in FP8 GEMMs; add --fp8 hybrid")
    on = [k for k in KERNELS if kernels.module(k).DEFAULT is not None
          and (k != "fp8_cast" or a.fp8)]
    ablations = [(name,) for name in (on if "all" in a.ablate else a.ablate) if name != "together"]
    if "together" in a.ablate:
        ablations.append(KERNELS)

    emit = emitter(a.out)

    rows = []
    for shape in a.shape:
        for batch in a.batch:
            if a.peer and is_bert(shape):
                print(f"--peer: the peer is a GPT; {shape} runs alone", file=sys.stderr)
            peer = run_peer(shape, batch, a.steps, a.peer) if a.peer and not is_bert(shape) else None
            if peer:
                emit(peer)
            runs = [Run(shape, batch, recompute=r, dtype=a.dtype, dropout=a.dropout) for r in a.recompute]
            runs += [Run(shape, batch, recompute=r, dtype=a.dtype, dropout=a.dropout, fp8=f) for f in a.fp8
                     for r in a.recompute]
            in_fp8 = {"fp8": a.fp8[0], "recompute": a.recompute[0]} if a.fp8 else {}  # the first FP8 run's
            runs += [Run(shape, batch, ablate=names, dtype=a.dtype, dropout=a.dropout,
                         **(in_fp8 if names == ("fp8_cast",) else {})) for names in ablations]
            runs += [Run(shape, batch, dtype=a.dtype, dropout=a.dropout, xla_flags=f, **in_fp8) for f in a.xla_flags]
            runs += [Run(shape, batch, recompute=a.recompute[0], dtype=a.dtype, dropout=a.dropout, tunings=t,
                         fp8=a.fp8[0] if t[0][0] == "fp8_cast" else "") for t in tunings]
            base = None
            for run in runs:
                rec = run_isolated(run, a.steps)
                if base is None and "error" not in rec:
                    base = rec
                if base is not None and rec is not base and "error" not in rec:
                    rec["vs_first"] = round(rec["tokens_per_s"] / base["tokens_per_s"], 3)
                if peer and "error" not in peer and "error" not in rec:
                    rec["vs_peer"] = round(rec["tokens_per_s"] / peer["tokens_per_s"], 3)
                    rec["peer_mem_gb"] = peer["mem_gb"]
                    if "sm_clock_mhz" in peer:
                        rec["peer_sm_clock_mhz"] = peer["sm_clock_mhz"]
                emit(rec)
                rows.append(rec)
    print("\n%-44s %10s %7s %8s %8s %8s %6s" % ("run", "tok/s", "MFU", "mem GiB", "vs peer", "vs 1st", "MHz"))
    for r in rows:
        if "error" in r:
            print("%-44s %s" % (r["run"], r["error"][:120]))
            continue
        print("%-44s %10d %7s %8.1f %8s %8s %6s" % (r["run"], r["tokens_per_s"], f"{r['mfu']:.1%}" if r["mfu"] else "-",
                                                   r["mem_gb"], r.get("vs_peer", "-"), r.get("vs_first", "-"),
                                                   r.get("sm_clock_mhz", "-")))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
