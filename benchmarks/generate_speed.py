"""Decode speed of jax3d's generation beside transformers' `generate` (eager, and with its static cache, which
transformers compiles), same weights, same prompts, one device; and the bandwidth limit measured in the same
call: the bytes a decode step must read over the rate a timed on-device copy moves bytes at.

An HF model with random weights is built from a config (nothing downloaded): a GPT-2 of `SHAPES`, or the
LlamaForCausalLM of a jax3d Llama preset (profile_decode's `PRESET_SHAPES`), saved as safetensors, read
into jax3d with `jax3d.hf.load_hf_params`, and both generate greedily from the same random prompts. Decode
tokens/s counts the new tokens after the first: (generate(new) - generate(1)) over (new - 1) steps of every
row, for every side. `limit_tok_s` is the weights-only limit (one read of every
weight per step); `limit_with_cache_tok_s` adds the cache a step must read (its filled part, averaged over
the run); `jax3d_step_ms` splits jax3d's step as profile_decode does (weights, the cache it reads, the rest),
without a trace. jax3d also reports how often prefill and decode were compiled (decode stays at 1 for any count)
and which of its decode kernels ran (`jax3d_decode_kernel_ran`: the attention; `jax3d_fused_blocks_ran`: row_gemv's
blocks at batch 1).
Beside the peers, transformers' own logits judge jax3d's tokens teacher-forced (`hf_judges`): the share it ranks
first and the largest gap to its top logit, which stay within bf16's rounding where the free-running
`same_tokens_frac_*` part at the first near-tie.

    python -m benchmarks.generate_speed                      # gpt-1.3b, bf16, GPU: batch 1 and 32
    python -m benchmarks.generate_speed --trace              # and profile_decode's trace of jax3d's decode
    python -m benchmarks.generate_speed --batch 1 --off row_gemv  # XLA's blocks at batch 1, not the fused ones
    python -m benchmarks.generate_speed --small --batch 1 4  # a tiny model on CPU
    python -m benchmarks.generate_speed --batch 32 --kv-cache-dtype fp8  # jax3d's cache in fp8, the peers' bf16
    python -m benchmarks.generate_speed --batch 1 32 --quantization fp8  # jax3d's GEMM weights in fp8, the peers' bf16
    python -m benchmarks.generate_speed --shape llama3.2-1b --batch 1 32  # Llama-3.2-1B's shape
    python -m benchmarks.generate_speed --shape llama-tiny --prompt-len 16 --new 16 --batch 1 2  # on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from benchmarks.harness import add_decode_kernel_flags, decode_kernel_flags, error_line
from benchmarks.profile_decode import (PRESET_SHAPES, best_time, breakdown, copy_rate, decode_config,
                                       decode_kernel_runs, fused_blocks_run, slots_read, step_bytes)
from jax3d.cli.common import add_decode_dtype_flags

SHAPES = {"gpt-1.3b": dict(n_layer=24, n_embd=2048, n_head=16), "small": dict(n_layer=2, n_embd=64, n_head=4)}


def hf_config(shape: str):
    """The transformers config of `shape`: a GPT-2 of SHAPES' size (GPT-2's vocabulary; 2048 positions at
    gpt-1.3b, 64 for the small shape), or the Llama that computes what the jax3d preset computes."""
    import transformers

    if shape in SHAPES:
        return transformers.GPT2Config(vocab_size=50257, n_positions=2048 if shape == "gpt-1.3b" else 64,
                                       **SHAPES[shape])
    from jax3d.hf.mapping import hf_config_from_model

    fields = hf_config_from_model(decode_config(shape))
    fields.pop("architectures")
    return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)


def hf_model(shape: str, path: str, device: str, dtype, config=None):
    """A random model of `shape` (hf_config, or `config`, that config changed), saved to `path` in `dtype` (the
    weights both sides then use)."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):  # initialising 1.3B parameters is much faster on the GPU
        # built in `dtype`, as from_pretrained(dtype=...) builds it: a Llama's rotary frequencies stay fp32 (a
        # bf16 model's `.to(bf16)` would round them, and its rotary positions drift from the model's with length)
        model = transformers.AutoModelForCausalLM.from_config(config or hf_config(shape), dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # always the full number of new tokens
    model.save_pretrained(path)
    return model


def hf_judges(model, prompts: np.ndarray, tokens: np.ndarray, device: str) -> dict:
    """transformers' own logits over jax3d's tokens, teacher-forced (one forward pass of prompt and tokens a
    row): how often each jax3d token is transformers' top pick there, and by how much transformers' top logit
    beats it at most. Free-running agreement ends at the first near-tie that bf16 flips; this does not: a
    jax3d that computed the model right picks, at every step, a token transformers ranks first or within
    rounding of it, where a wrong one picks tokens far below (about the logits' spread)."""
    import torch

    top1, gap = [], 0.0
    with torch.no_grad():
        for p, t in zip(prompts, tokens):  # a row at a time: a batch's logits over a 128k vocabulary are GBs
            ids = torch.tensor(np.concatenate([p, t])[None], dtype=torch.long, device=device)
            logits = model(ids).logits[0, len(p) - 1:-1].float()  # the logits that picked each token
            picked = logits.gather(1, torch.tensor(t, dtype=torch.long, device=device)[:, None])[:, 0]
            best = logits.max(dim=1).values
            top1.append((picked == best).float().mean().item())
            gap = max(gap, (best - picked).max().item())
    return {"hf_top1_of_jax3d_frac": round(float(np.mean(top1)), 3), "hf_max_logit_gap_of_jax3d": round(gap, 4)}


def time_hf(model, prompts: np.ndarray, new: int, device: str, static: bool, repeats: int) -> dict:
    """transformers' greedy generate: eager with its dynamic cache, or with `cache_implementation="static"`,
    whose decode step transformers compiles (torch.compile, CUDA graphs on a GPU). The first call sizes the
    static cache for prompt + `new` tokens, and transformers reuses it (the same buffers, so the same CUDA
    graphs) for the shorter calls after it."""
    import torch
    import transformers

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(ids)
    kw = {}
    if static:
        compile_config = transformers.CompileConfig()
        compile_config._compile_all_devices = device == "cpu"  # transformers compiles on accelerators only
        kw = dict(cache_implementation="static", compile_config=compile_config)

    def run(n):
        if device == "cuda":
            torch.cuda.synchronize()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, use_cache=True, **kw)
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    run(new), run(1)  # warm-up: compiles, and records CUDA graphs, at the lengths timed
    t_one, _ = best_time(lambda: run(1), repeats)  # prefill and the first token
    t_all, out = best_time(lambda: run(new), repeats)
    b = prompts.shape[0]
    rec = {"decode_tok_s": decode_rate(b, new, t_one, t_all), "total_s": t_all,
           "tokens": out[:, prompts.shape[1]:].cpu().numpy()}
    if static:
        rec["compiled"] = hasattr(model, "_compiled_call")
    return rec


def time_jax3d(cfg, params, prompts: np.ndarray, new: int, dtype, repeats: int, trace: bool = False,
               cache_dtype=None, weight_dtype=None, kernels=None) -> dict:
    import jax

    from jax3d.inference import Generator
    from jax3d.parallel.mesh import MeshConfig

    b = prompts.shape[0]
    gen = Generator(cfg, params, MeshConfig(1, 1, 1).build(jax.devices()[:1]), batch=b,
                    max_len=prompts.shape[1] + new, dtype=dtype, cache_dtype=cache_dtype, weight_dtype=weight_dtype,
                    kernels=kernels)
    rows = [list(map(int, r)) for r in prompts]
    t0 = time.perf_counter()
    gen.generate(rows, new)  # warm-up: prefill and decode compile here, for these shapes
    warmup_s = time.perf_counter() - t0
    t_one, _ = best_time(lambda: gen.generate(rows, 1), repeats)
    t_all, toks = best_time(lambda: gen.generate(rows, new), repeats)
    rec = {"decode_tok_s": decode_rate(b, new, t_one, t_all), "total_s": t_all,
           "compiles": gen.compile_counts(), "warmup_s": warmup_s, "tokens": np.asarray(toks),
           "slots_read": slots_read(cfg, gen.kernels, b, prompts.shape[1], new),
           # which of jax3d's decode kernels this decode ran (profile_decode's fields of the same names)
           "decode_kernel_ran": decode_kernel_runs(cfg, gen.kernels, b, gen.max_len),
           "fused_blocks_ran": fused_blocks_run(gen, b)}
    if trace:  # profile_decode's kernel classes, from the same compiled programs
        from benchmarks.profile_decode import profile
        rec["trace"] = profile(gen, rows, new)
    return rec


def decode_rate(batch: int, new: int, t_one: float, t_all: float) -> float:
    """Tokens/s of the steps after the first: generate(new) less generate(1), the same way for every side
    (nan where the difference is lost in the noise, as for tiny models on a CPU)."""
    return batch * (new - 1) / (t_all - t_one) if t_all > t_one else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, *PRESET_SHAPES], default="gpt-1.3b")
    p.add_argument("--small", action="store_true", help="the small shape in fp32 on CPU, short prompts")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--peers", nargs="*", choices=("static", "eager"), default=["static", "eager"],
                   help="transformers' generate beside jax3d: with its compiled static cache, eager (none: only jax3d)")
    p.add_argument("--eager-new", type=int, default=64, help="new tokens for the eager peer (its rate is steady, and "
                   "256 of them take it a while)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per side; the fastest counts")
    p.add_argument("--trace", action="store_true", help="also trace jax3d's decode as profile_decode does (kernel "
                   "time by class, kernels per step, device busy), without compiling it again")
    add_decode_kernel_flags(p)
    add_decode_dtype_flags(p)
    a = p.parse_args(argv)
    tuned, off = decode_kernel_flags(p, a)
    if a.small:
        a.shape, a.prompt_len, a.new, a.eager_new = "small", 16, 16, 16
    import jax
    import jax.numpy as jnp
    import torch

    from jax3d.hf import load_hf_params
    from jax3d.kernels.policy import KernelPolicy
    from jax3d.config import PrecisionConfig
    from jax3d.parallel.precision import PrecisionPolicy, dtype_of_flags

    on_gpu = jax.default_backend() == "gpu"
    device = "cuda" if on_gpu and torch.cuda.is_available() else "cpu"
    bf16 = on_gpu and not a.small
    precision = PrecisionPolicy.of(PrecisionConfig(dtype=dtype_of_flags(bf16)), kv_cache_dtype=a.kv_cache_dtype,
                                   quantization=a.quantization)
    dtype = precision.compute_dtype
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        model = hf_model(a.shape, d, device, torch.bfloat16 if bf16 else torch.float32)
        cfg, params = load_hf_params(d)
        convert_s = time.perf_counter() - t0
    item = jnp.dtype(dtype).itemsize
    cache_dtype, weights = precision.cache_dtype, precision.weight_dtype
    cache_item = cache_dtype.itemsize
    weight_bytes = step_bytes(cfg, params, 1, 0, item, quantized_itemsize=jnp.dtype(weights or dtype).itemsize)[0]
    rate = copy_rate(dtype, 2.0 if on_gpu else 0.125)
    print(json.dumps({"shape": a.shape, "device": jax.devices()[0].device_kind, "dtype": jnp.dtype(dtype).name,
                      "prompt_len": a.prompt_len, "new_tokens": a.new, "save_and_import_s": round(convert_s, 1),
                      "kv_cache_dtype": cache_dtype.name, "quantization": a.quantization,
                      "weight_gb": round(weight_bytes / 1e9, 3),
                      "copy_tb_s": round(rate / 1e12, 3), **({"tune": a.tune} if a.tune else {}),
                      **({"off": a.off} if a.off else {})}), flush=True)
    rs = np.random.RandomState(0)
    for b in a.batch:
        prompts = rs.randint(0, model.config.vocab_size, (b, a.prompt_len)).astype(np.int32)
        kernels = KernelPolicy.resolve(jax.devices()[0].platform, 1, tunings=tuned, off=off)
        ours = time_jax3d(cfg, params, prompts, a.new, dtype, a.repeats, a.trace, cache_dtype, weights, kernels)
        filled = step_bytes(cfg, params, b, a.prompt_len + a.new // 2, item, cache_item)[1]  # the cache's filled part, on average
        limit = b * rate / weight_bytes
        rec = {"batch": b, "jax3d_decode_tok_s": round(ours["decode_tok_s"], 1),
               "limit_tok_s": round(limit, 1), "limit_with_cache_tok_s": round(b * rate / (weight_bytes + filled), 1),
               "jax3d_of_limit": round(ours["decode_tok_s"] / limit, 3),
               # jax3d's step against the bytes it reads: the weights, the cache (profile_decode.slots_read), the rest
               "jax3d_step_ms": breakdown(weight_bytes,
                                          step_bytes(cfg, params, b, ours["slots_read"], item, cache_item)[1],
                                          rate, b * 1e3 / ours["decode_tok_s"]),
               **({"jax3d_trace": ours["trace"]} if a.trace else {}),
               "jax3d_decode_kernel_ran": ours["decode_kernel_ran"], "jax3d_fused_blocks_ran": ours["fused_blocks_ran"],
               "jax3d_total_s": round(ours["total_s"], 3), "jax3d_compiles": ours["compiles"],
               "jax3d_warmup_s": round(ours["warmup_s"], 1)}
        for peer in a.peers:
            new = a.eager_new if peer == "eager" else a.new
            try:
                hf = time_hf(model, prompts, new, device, peer == "static", a.repeats)
            except Exception as e:  # noqa: BLE001 (a peer that can't run here is reported, not fatal)
                rec[f"hf_{peer}_error"] = error_line(e)
                print(f"note: transformers' {peer} generate failed here ({rec[f'hf_{peer}_error']}); skipped",
                      flush=True)
                continue
            rec[f"hf_{peer}_decode_tok_s"] = round(hf["decode_tok_s"], 1)
            rec[f"jax3d_over_hf_{peer}"] = round(ours["decode_tok_s"] / hf["decode_tok_s"], 2)
            if peer == "static":
                rec["hf_static_compiled"] = hf["compiled"]
            # in bf16 near-ties can flip a greedy pick, so agreement is reported, not asserted
            n = min(new, ours["tokens"].shape[1])
            rec[f"same_tokens_frac_{peer}"] = round(float(np.mean(ours["tokens"][:, :n] == hf["tokens"][:, :n])), 3)
        if a.peers:
            try:
                rec.update(hf_judges(model, prompts, ours["tokens"], device))
            except Exception as e:  # noqa: BLE001 (as for a peer: reported, and the timings are kept)
                rec["hf_judges_error"] = error_line(e)
        print(json.dumps(rec), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    raise SystemExit(main())
