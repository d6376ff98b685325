"""How close generation in bf16 comes to the model, at a real shape: jax3d's greedy decode (bf16 and fp32) and
transformers' greedy generate (bf16 and fp32), each judged teacher-forced by transformers in fp32 on the same
weights (generate_speed.hf_judges: the share of the tokens it ranks first, and the largest gap to its top
logit). A model of a generate_speed shape with random weights, built in bf16 (saved, and read back in fp32 for
the fp32 sides, so both dtypes hold the same values), with `--layers` blocks (the shape's count by default), so
it runs on a CPU too. fp32 decode should give transformers' fp32 tokens exactly; a bf16 side that computed
the model right stays within bf16's rounding of the top pick, as transformers' own bf16 does.

    python -m benchmarks.decode_judge --shape llama3.2-1b --layers 4   # on a CPU: about a minute
    python -m benchmarks.decode_judge --shape gpt-1.3b --layers 4
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from benchmarks.generate_speed import SHAPES, hf_config, hf_judges, hf_model
from benchmarks.profile_decode import PRESET_SHAPES


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=[*SHAPES, *PRESET_SHAPES], default="llama3.2-1b")
    p.add_argument("--layers", type=int, default=0, help="blocks (default: the shape's count)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--new", type=int, default=24)
    a = p.parse_args(argv)
    for flag in ("batch", "prompt_len", "new"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)}: give a positive number")
    cfg_hf = hf_config(a.shape)  # GPT-2's config reads num_hidden_layers and max_position_embeddings too
    if not 0 <= a.layers <= cfg_hf.num_hidden_layers:
        p.error(f"--layers {a.layers}: give 0 (all) or up to {a.shape}'s {cfg_hf.num_hidden_layers} blocks")
    if a.prompt_len + a.new > cfg_hf.max_position_embeddings:
        p.error(f"--prompt-len {a.prompt_len} plus --new {a.new} is longer than {a.shape}'s "
                f"{cfg_hf.max_position_embeddings} positions; ask for fewer")
    cfg_hf.num_hidden_layers = a.layers or cfg_hf.num_hidden_layers
    import jax
    import torch
    import transformers

    from jax3d.hf import load_hf_params
    from jax3d.inference import Generator
    from jax3d.parallel.mesh import MeshConfig

    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    prompts = np.random.RandomState(0).randint(0, cfg_hf.vocab_size, (a.batch, a.prompt_len)).astype(np.int32)
    with tempfile.TemporaryDirectory() as d:
        bf16 = hf_model(a.shape, d, device, torch.bfloat16, config=cfg_hf)
        cfg, params = load_hf_params(d)
        fp32 = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()  # the judge
    fp32.generation_config.eos_token_id = None
    mesh = MeshConfig(1, 1, 1).build(jax.devices()[:1])
    tokens = {}
    for dtype in ("bfloat16", "float32"):
        gen = Generator(cfg, params, mesh, batch=a.batch, max_len=a.prompt_len + a.new, dtype=dtype)
        tokens[f"jax3d_{dtype}"] = np.asarray(gen.generate([list(map(int, r)) for r in prompts], a.new))
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    with torch.no_grad():
        for dtype, model in (("bfloat16", bf16), ("float32", fp32)):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new,
                                 min_new_tokens=a.new, do_sample=False, pad_token_id=0)
            tokens[f"transformers_{dtype}"] = out[:, a.prompt_len:].cpu().numpy()
    print(json.dumps({"shape": a.shape, "layers": cfg_hf.num_hidden_layers, "device": device,
                      "batch": a.batch, "prompt_len": a.prompt_len, "new": a.new}), flush=True)
    want = tokens["transformers_float32"]
    for side, toks in tokens.items():
        judged = hf_judges(fp32, prompts, toks, device)
        print(json.dumps({"side": side, "same_tokens_as_transformers_fp32": round(float(np.mean(toks == want)), 3),
                          "fp32_top1_frac": judged["hf_top1_of_jax3d_frac"],
                          "fp32_max_logit_gap": judged["hf_max_logit_gap_of_jax3d"]}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    raise SystemExit(main())
