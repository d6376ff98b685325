"""A GPT step's GEMMs alone, in their forward and backward layouts, through XLA and (with --torch) PyTorch.

The 1.3B profile (docs/performance.md) has the step's forward GEMMs at 800-830 TFLOP/s and its backward
ones at 715-730. This times each GEMM of a block and of the tied LM head at the step's shapes, bf16 in
and out with fp32 accumulation, in the three layouts a linear layer needs: forward x @ W, input
gradient dy @ W^T, and weight gradient x^T @ dy (contracting over every token). Slow backward layouts
in both XLA and cuBLAS-through-PyTorch point at the shapes; slow in XLA alone, at how XLA calls them.

Its first run (an H200, 10 calls a round, XLA's product in fp32 cast to bf16) had every layout at
570-800 TFLOP/s, below the same GEMMs inside the step (docs/performance.md, per layout), so it said
nothing about the step. It now asks for bf16 out, as the model does, and times 50 calls a round; check
its forward rates against the step's before reading its backward ones. A later probe of the same kind
(not this script) had every layout of the MLP and QKV GEMMs, forward included, at 690-713 TFLOP/s: back
to back, GEMMs run at the H200's power cap. A fourth layout here, the weight gradient from operands
stored token-minor, asks whether the step's weight-gradient layout is the slow part; in that probe it
was not.

    python -m benchmarks.gemm_shapes --torch                  # 1.3B: d 2048, 32768 tokens
    python -m benchmarks.gemm_shapes --d 768 --tokens 32768   # 125M
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Each layout as (operand shapes from tokens t, in features k, out features n; dot_general's contraction).
LAYOUTS = {
    "forward": (lambda t, k, n: ((t, k), (k, n)), ((1,), (0,))),  # x @ W -> (t, n)
    "input_grad": (lambda t, k, n: ((t, n), (k, n)), ((1,), (1,))),  # dy @ W^T -> (t, k)
    "weight_grad": (lambda t, k, n: ((t, k), (t, n)), ((0,), (0,))),  # x^T @ dy -> (k, n)
    # The same product from operands stored token-minor (x^T and dy^T written out): is the step's
    # weight-gradient layout, which contracts over both operands' leading dim, the slow part?
    "weight_grad_token_minor": (lambda t, k, n: ((k, t), (n, t)), ((1,), (1,))),  # x^T @ (dy^T)^T -> (k, n)
}


def gemms(d: int, ffn: int, vocab: int) -> dict:
    """(in, out) features of each GEMM in a GPT block and its tied head."""
    return {"qkv": (d, 3 * d), "attn_out": (d, d), "mlp_up": (d, ffn), "mlp_down": (ffn, d), "lm_head": (d, vocab)}


def jax_gemm(layout: str):
    """The layout's product as the model's einsums ask for it: bf16 in, bf16 out (fp32 accumulation is
    XLA's own). An fp32 result cast back to bf16 would add a pass over the output to every timing."""
    contract = LAYOUTS[layout][1]
    return jax.jit(lambda a, b: jax.lax.dot_general(a, b, (contract, ((), ()))))


def _seconds(call, wait, reps: int) -> float:
    """Median over 5 rounds of `reps` back-to-back calls, per call; `wait(output)` blocks until it is done."""
    wait(call())
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            out = call()
        wait(out)
        rounds.append((time.perf_counter() - t) / reps)
    return sorted(rounds)[2]


def time_jax(layout: str, t: int, k: int, n: int, reps: int) -> float:
    shapes = LAYOUTS[layout][0](t, k, n)
    a, b = (jax.random.normal(jax.random.key(i), s, jnp.bfloat16) for i, s in enumerate(shapes))
    f = jax_gemm(layout)
    return _seconds(lambda: f(a, b), jax.block_until_ready, reps)


def time_torch(layout: str, t: int, k: int, n: int, reps: int) -> float:
    import torch

    shapes = LAYOUTS[layout][0](t, k, n)
    a, b = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes)
    call = {"forward": lambda: a @ b, "input_grad": lambda: a @ b.t(), "weight_grad": lambda: a.t() @ b,
            "weight_grad_token_minor": lambda: a @ b.t()}[layout]
    return _seconds(call, lambda out: torch.cuda.synchronize(), reps)


def check_layouts(t: int = 6, k: int = 4, n: int = 5) -> None:
    """Each layout's dot_general computes the product it is named for (against numpy in fp64)."""
    rng = np.random.default_rng(0)
    want = {"forward": lambda a, b: a @ b, "input_grad": lambda a, b: a @ b.T, "weight_grad": lambda a, b: a.T @ b,
            "weight_grad_token_minor": lambda a, b: a @ b.T}
    for layout, (shapes, _) in LAYOUTS.items():
        a, b = (rng.standard_normal(s) for s in shapes(t, k, n))
        got = jax.lax.dot_general(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                  (LAYOUTS[layout][1], ((), ())))
        np.testing.assert_allclose(np.asarray(got), want[layout](a, b), rtol=1e-5, atol=1e-5)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d", type=int, default=2048, help="hidden size")
    p.add_argument("--ffn", type=int, default=0, help="MLP hidden size (0: 4 x d)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch x sequence)")
    p.add_argument("--reps", type=int, default=50, help="back-to-back calls per timing round")
    p.add_argument("--torch", action="store_true", help="also time each GEMM through PyTorch (GPU only)")
    a = p.parse_args(argv)
    check_layouts()
    for name, (k, n) in gemms(a.d, a.ffn or 4 * a.d, a.vocab).items():
        for layout in LAYOUTS:
            flop = 2 * a.tokens * k * n
            rec = {"gemm": name, "layout": layout, "tokens": a.tokens, "in": k, "out": n}
            rec["xla_tflops"] = round(flop / time_jax(layout, a.tokens, k, n, a.reps) / 1e12, 1)
            if a.torch:
                rec["torch_tflops"] = round(flop / time_torch(layout, a.tokens, k, n, a.reps) / 1e12, 1)
            print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
