"""Decode speed of jax3d's KV-cache generation beside transformers' `generate`, same weights, one device.

A GPT-2-shaped HF model with random weights is built from a config (nothing downloaded), saved as
safetensors, read into jax3d with `jax3d.hf.load_hf_params`, and both generate greedily from the same
random prompts. Decode tokens/s counts the new tokens after the first (prefill excluded); jax3d also
reports how often prefill and decode were compiled (decode must stay at 1 however many tokens).

    python -m benchmarks.generate_speed                      # gpt-1.3b, bf16, GPU
    python -m benchmarks.generate_speed --small --batch 1 4  # a tiny model on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

SHAPES = {"gpt-1.3b": dict(n_layer=24, n_embd=2048, n_head=16), "small": dict(n_layer=2, n_embd=64, n_head=4)}


def hf_model(shape: str, path: str, vocab: int, positions: int, device: str, dtype):
    """A random GPT-2 of `shape`, saved to `path` in `dtype` (the weights both sides then use)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=positions, **SHAPES[shape])
    with torch.device(device):  # initialising 1.3B parameters is much faster on the GPU
        model = transformers.GPT2LMHeadModel(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # always the full number of new tokens
    model.save_pretrained(path)
    return model


def time_hf(model, prompts: np.ndarray, new: int, device: str) -> dict:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)

    def run(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, use_cache=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out

    run(8)  # warm-up
    t_one, _ = run(1)  # prefill and the first token
    t_all, out = run(new)
    b = prompts.shape[0]
    return {"decode_tokens_per_s": b * (new - 1) / max(t_all - t_one, 1e-9), "total_s": t_all,
            "tokens": out[:, prompts.shape[1]:].cpu().numpy()}


def time_jax3d(cfg, params, prompts: np.ndarray, new: int, dtype) -> dict:
    import jax

    from jax3d.inference import Generator
    from jax3d.parallel.mesh import MeshConfig

    b = prompts.shape[0]
    gen = Generator(cfg, params, MeshConfig(1, 1, 1).build(jax.devices()[:1]), batch=b,
                    max_len=prompts.shape[1] + new, dtype=dtype)
    rows = [list(map(int, r)) for r in prompts]
    t0 = time.perf_counter()
    gen.generate(rows, 2)  # warm-up: prefill and decode compile here, for these shapes
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    stamps, toks = [], []
    for tok in gen.stream(rows, new):
        stamps.append(time.perf_counter())
        toks.append(tok)
    total = stamps[-1] - t0
    return {"decode_tokens_per_s": b * (new - 1) / max(stamps[-1] - stamps[0], 1e-9), "total_s": total,
            "compiles": gen.compile_counts(), "warmup_s": compile_s, "tokens": np.stack(toks, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="gpt-1.3b")
    p.add_argument("--small", action="store_true", help="the tiny shape in fp32 on CPU, short prompts")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    a = p.parse_args()
    if a.small:
        a.shape, a.prompt_len, a.new = "small", 16, 16
    import jax
    import jax.numpy as jnp
    import torch

    from jax3d.hf import load_hf_params

    on_gpu = jax.default_backend() == "gpu"
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    bf16 = on_gpu and not a.small
    vocab, positions = 50257, 2048 if a.shape == "gpt-1.3b" else 64
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        model = hf_model(a.shape, d, vocab, positions, device, torch.bfloat16 if bf16 else torch.float32)
        cfg, params = load_hf_params(d)
        convert_s = time.perf_counter() - t0
    rs = np.random.RandomState(0)
    print(json.dumps({"shape": a.shape, "device": jax.devices()[0].device_kind, "dtype": "bfloat16" if bf16 else
                      "float32", "prompt_len": a.prompt_len, "new_tokens": a.new, "save_and_import_s": round(convert_s, 1)}))
    for b in a.batch:
        prompts = rs.randint(0, vocab, (b, a.prompt_len)).astype(np.int32)
        ours = time_jax3d(cfg, params, prompts, a.new, jnp.bfloat16 if bf16 else jnp.float32)
        rec = {"batch": b, "jax3d_decode_tok_s": round(ours["decode_tokens_per_s"], 1),
               "jax3d_total_s": round(ours["total_s"], 3), "jax3d_compiles": ours["compiles"],
               "jax3d_warmup_s": round(ours["warmup_s"], 1)}
        if not a.no_peer:
            peer = time_hf(model, prompts, a.new, device)
            rec.update(hf_decode_tok_s=round(peer["decode_tokens_per_s"], 1), hf_total_s=round(peer["total_s"], 3),
                       speedup=round(ours["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 2),
                       # in bf16 near-ties can flip a greedy pick, so agreement is reported, not asserted
                       same_tokens_frac=float(np.mean(ours["tokens"] == peer["tokens"])))
        print(json.dumps(rec), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    main()
