"""`launch/train.py` beside the benchmark harness at one GPT shape, and the memory guard's verdicts over micro-batches.

`--match N` runs the harness's timed step (`benchmarks.throughput`'s measurement) and the command line's training run
at the same shape N times each, alternating, and prints the command line's tokens/s and peak memory over the
harness's. `--sweep B ...` runs the command line at each micro-batch (global batch the same): where the guard stops
the run, it runs again with `--no-memory-check`, to show that the step really does not fit; each point's record
says whether the guard's verdict matched what happened, and the sentence a run that ran out ended with.

    python -m benchmarks.cli_memory --shape 1.3b-b16 --match 2 --sweep 8 12 16 17 18 20 24   # one 80 GB GPU
    python -m benchmarks.cli_memory --shape tiny --match 1 --sweep 2 4                        # tries it on a CPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.harness import (emitter, ROOT, SHAPES, VOCAB, Run, child_env, dims, is_bert, is_llama,
                                run_isolated)


def cli_flags(shape: str, micro: int) -> list[str]:
    """launch/train.py's flags for the harness's `shape` at micro-batch (= global batch) `micro`: the same model,
    precision and data type as `harness.config_for`, without dropout or evaluation."""
    layers, d, heads, seq, _ = dims(shape)
    flags = ["--num-layers", layers, "--hidden-size", d, "--num-attention-heads", heads, "--seq-length", seq,
             "--max-position-embeddings", seq, "--micro-batch-size", micro, "--global-batch-size", micro,
             "--vocab-size", VOCAB, "--bf16", "--hidden-dropout", 0, "--attention-dropout", 0, "--eval-interval", 0,
             "--no-progress", "--tensor-model-parallel-size", 1, "--pipeline-model-parallel-size", 1]
    from jax3d.cli.train import _accelerator_installed
    if not _accelerator_installed():  # the harness runs on one device; the command line would emulate 8
        flags += ["--cpu-devices", 1]
    return [str(f) for f in flags]


def run_cli(shape: str, micro: int, steps: int, log_interval: int, extra=()) -> dict:
    """One launch/train.py run: its outcome (trained, refused by the guard before or after the state was placed,
    ran out of memory and said so, or crashed), its error line, and for a run that trained, tokens/s over the log
    intervals after the first (the first holds the compile) and its peak memory."""
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), *cli_flags(shape, micro),
               "--train-iters", str(steps), "--log-interval", str(log_interval), "--log-dir", log_dir, *extra]
        proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True)
        path = os.path.join(log_dir, "metrics.jsonl")
        recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    recs = [r for r in recs if "tokens_per_s" in r]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    rec = {"who": "cli", "shape": shape, "micro_batch": micro, "extra": list(extra), "rc": proc.returncode}
    if proc.returncode == 0:
        timed = recs[1:] or recs
        rec.update(outcome="trained", tokens_per_s=round(statistics.mean(r["tokens_per_s"] for r in timed)),
                   mem_gb=round(recs[-1]["mem_gb"], 2))
    elif proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr:
        line = errors[0]
        rec.update(outcome="ran out, said so" if "ran out of device memory" in line else
                   "refused after placing" if "in one block" in line else "refused", error=line)
    else:
        rec.update(outcome="crashed", error=" | ".join(proc.stderr.strip().splitlines()[-3:]))
    return rec


def sweep_point(shape: str, micro: int) -> list[dict]:
    """The command line at `micro`; if the guard stops it, again without the guard. The last record says whether
    the verdict held: a run let through trained, and a run stopped would have run out."""
    first = run_cli(shape, micro, steps=3, log_interval=1)
    recs = [first]
    if first["outcome"].startswith("refused"):
        recs.append(run_cli(shape, micro, steps=3, log_interval=1, extra=("--no-memory-check",)))
        first["verdict_held"] = recs[-1]["outcome"] == "ran out, said so"
    else:
        first["verdict_held"] = first["outcome"] == "trained"
    return recs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpt = [s for s in SHAPES if not is_llama(s) and not is_bert(s)]
    p.add_argument("--shape", default="1.3b-b16", choices=gpt, help="a GPT shape of benchmarks.harness")
    p.add_argument("--match", type=int, default=0, metavar="N",
                   help="time the harness and the command line N times each, alternating (default: 0)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per --match run (default: 10)")
    p.add_argument("--sweep", type=int, nargs="*", default=[], metavar="B", help="micro-batches to sweep")
    p.add_argument("--out", default="", help="also append the JSON lines to this file")
    a = p.parse_args(argv)
    if not a.match and not a.sweep:
        p.error("nothing to run: give --match N, --sweep B ..., or both")

    emit = emitter(a.out)

    ok = True
    batch = SHAPES[a.shape].batch
    harness, cli = [], []
    for _ in range(a.match):
        h = run_isolated(Run(a.shape), a.steps)
        emit({"who": "harness", **h})
        c = run_cli(a.shape, batch, steps=3 * a.steps, log_interval=a.steps)
        emit(c)
        if "error" in h or c["outcome"] != "trained":
            ok = False
            continue
        harness.append(h)
        cli.append(c)
    if cli:
        emit({"summary": "cli / harness", "shape": a.shape, "pairs": len(cli),
              "tokens_per_s": round(statistics.mean(c["tokens_per_s"] for c in cli)
                                    / statistics.mean(h["tokens_per_s"] for h in harness), 4),
              "mem_gb_cli_minus_harness": round(max(c["mem_gb"] for c in cli) - max(h["mem_gb"] for h in harness), 2)})
    for micro in a.sweep:
        recs = sweep_point(a.shape, micro)
        for rec in recs:
            emit(rec)
        ok &= recs[0]["verdict_held"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
