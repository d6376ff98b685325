"""FP8 against bf16 training, same model, seed and data, in one call: both loss curves as JSON (issue 33).

Each run is `launch/train.py` (jax3d.cli.train.main) on the bundled corpus (the Python standard library's source,
jax3d.data.default_corpus) with `--bf16`, once plain and once with `--fp8-<format>`, in this process one after the
other; every step's loss is read back from the run's metrics.jsonl, validation losses too (the evaluation runs
the plain model on the fp32 weights, so it scores the weights FP8 training wrote). `OUT/fp8_loss.json` holds both
curves and the verdict of issue 33's rules: the mean loss of the last 50 steps within 1% relative of bf16's, and
no step after step 100 more than 5% above bf16's. `python -m benchmarks.plot_loss OUT/fp8_loss.json` draws them.
The FP8 recipe is the flags' default (amax of the latest step, history 1); Transformer Engine's (max over 1,024
steps, `--history 1024 --algo max`) ended 1.15% above bf16 in its one run (docs/performance.md, FP8).

    python -m benchmarks.fp8_loss --out /tmp/fp8_loss                   # gpt-350m, seq 1024, batch 16, 1000 steps
    python -m benchmarks.fp8_loss --preset gpt-tiny --seq 64 --batch 16 --micro-batch 1 --steps 20 --out /tmp/f  # CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

FINAL_STEPS, FINAL_TOL, AFTER, STEP_TOL = 50, 0.01, 100, 0.05  # issue 33's rules


def train_argv(a, log_dir: str, fp8: str) -> list[str]:
    """The train command line of one run; the two differ only in the FP8 flag and the log folder."""
    argv = ["--preset", a.preset, "--seq-length", str(a.seq), "--micro-batch-size", str(a.micro_batch or a.batch),
            "--global-batch-size", str(a.batch), "--train-iters", str(a.steps), "--lr", str(a.lr),
            "--lr-warmup-iters", str(min(a.warmup, a.steps - 1)), "--bf16", "--seed", str(a.seed),
            "--log-interval", "1", "--eval-interval", str(a.eval_interval), "--eval-iters", "4",
            "--log-dir", log_dir, "--hidden-dropout", "0", "--attention-dropout", "0", *a.train_flag]
    recipe = ["--fp8-amax-history-len", str(a.history), "--fp8-amax-compute-algo", a.algo]
    return argv + ([f"--fp8-{fp8}", *recipe] if fp8 else [])


def read_curve(log_dir: str) -> dict:
    """{"loss": per-step losses, "val": [(step, validation loss)]} from a run's metrics.jsonl."""
    loss, val = [], []
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "val_loss" in rec:
                val.append((rec["step"], rec["val_loss"]))
            elif "loss" in rec:
                loss.append(rec["loss"])
    return {"loss": loss, "val": val}


def verdict(bf16: list[float], fp8: list[float]) -> dict:
    """Issue 33's rules: the final losses (means of the last FINAL_STEPS steps) and the worst step past AFTER."""
    b, f = np.asarray(bf16), np.asarray(fp8)
    final_b, final_f = float(b[-FINAL_STEPS:].mean()), float(f[-FINAL_STEPS:].mean())
    rel = final_f / final_b - 1.0
    later = f[AFTER:] / b[AFTER:] - 1.0 if len(b) > AFTER else np.zeros(0)
    worst = float(later.max()) if later.size else 0.0
    return {"final_bf16": final_b, "final_fp8": final_f, "final_rel": rel, "final_ok": abs(rel) <= FINAL_TOL,
            "worst_step_rel_after_100": worst, "no_divergence": worst <= STEP_TOL}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for fp8_loss.json and the two runs' logs")
    p.add_argument("--preset", default="gpt-350m", help="the model (default: gpt-350m)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length (default: 1024)")
    p.add_argument("--batch", type=int, default=16, help="global batch, one micro-batch (default: 16)")
    p.add_argument("--micro-batch", type=int, default=0, help="micro-batch per data shard (default: --batch, one GPU)")
    p.add_argument("--steps", type=int, default=1000, help="train steps of each run (default: 1000)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate, cosine decay (default: 3e-4)")
    p.add_argument("--warmup", type=int, default=100, help="warm-up steps (default: 100)")
    p.add_argument("--eval-interval", type=int, default=500, help="steps between validations (default: 500)")
    p.add_argument("--seed", type=int, default=1234, help="seed of both runs (default: 1234)")
    p.add_argument("--fp8", default="hybrid", choices=["hybrid", "e4m3"], help="FP8 format (default: hybrid)")
    p.add_argument("--history", type=int, default=1,
                   help="amax history length (default: 1, the flag's default; Transformer Engine's is 1024)")
    p.add_argument("--algo", default="most_recent", choices=["max", "most_recent"],
                   help="amax of the history (default: most_recent, the flag's default; Transformer Engine's is max)")
    p.add_argument("--train-flag", action="append", default=[], metavar="FLAG",
                   help="one more train flag for both runs, e.g. --train-flag=--recompute=selective (repeatable)")
    a = p.parse_args(argv)
    from jax3d.cli.train import main as train

    os.makedirs(a.out, exist_ok=True)
    result = {"preset": a.preset, "seq": a.seq, "batch": a.batch, "steps": a.steps, "lr": a.lr, "seed": a.seed,
              "fp8_format": a.fp8, "fp8_history": a.history, "fp8_algo": a.algo}
    for name, fp8 in (("bf16", ""), ("fp8", a.fp8)):
        log_dir = os.path.join(a.out, name)
        t0 = time.perf_counter()
        rc = train(train_argv(a, log_dir, fp8))
        if rc:
            print(f"fp8_loss: the {name} run failed (exit {rc}); its log is in {log_dir}", file=sys.stderr)
            return rc
        result[name] = {**read_curve(log_dir), "wall_s": round(time.perf_counter() - t0, 1)}
    result["verdict"] = verdict(result["bf16"]["loss"], result["fp8"]["loss"])
    path = os.path.join(a.out, "fp8_loss.json")
    with open(path, "w") as f:
        json.dump(result, f)
    print(json.dumps({"file": path, **result["verdict"],
                      "wall_s": {k: result[k]["wall_s"] for k in ("bf16", "fp8")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
