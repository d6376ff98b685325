"""`launch/generate.py`: continue prompts with a trained GPT checkpoint, streaming text to stdout."""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from jax3d.cli.common import HelpFormatter, OneLineParser, add_device_flags, add_model_parallel_flags

    p = OneLineParser(prog="launch/generate.py", description="Continue prompts with a jax3d GPT checkpoint (KV cache; "
                      "tensor parallel with --tensor-model-parallel-size).",
                      formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (a --save of train.py, or convert_hf.py import)")
    p.add_argument("--ckpt-step", type=int, default=-1, help="step to load (default: the latest)")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt; repeat for a batch (default: none; give --prompt or --prompt-file)")
    p.add_argument("--prompt-file", default="", help="a UTF-8 file of prompts, one a line, after any --prompt "
                   "(default: none)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 for all of them")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens that hold this much probability; 1.0 for all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16")
    p.add_argument("--ignore-eod", action="store_true", help="keep going past the end-of-document token")
    add_model_parallel_flags(p, pipeline=False)
    add_device_flags(p)
    return p


def _prompt_shown(prompt: str, printed: str | None) -> str:
    """What of the continuation is printed so far: "" once the prompt is printed (None: not yet)."""
    if printed is None:
        sys.stdout.write(prompt)
        return ""
    return printed


def _bad_input() -> tuple:
    from jax3d.config import ConfigError
    from jax3d.data.indexed import DataError
    return ConfigError, DataError


def main(argv=None) -> int:
    from jax3d.cli.common import run_command
    return run_command(_main, argv, _bad_input)


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    from jax3d.config import ConfigError
    prompts = list(a.prompt)
    if a.prompt_file:
        try:
            with open(a.prompt_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"--prompt-file {a.prompt_file} is unreadable ({e.strerror}); pass a text file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"--prompt-file {a.prompt_file} is not UTF-8 text; pass a text file") from None
    if not prompts:
        if a.prompt_file:
            raise ConfigError(f"--prompt-file {a.prompt_file} holds no prompt; put one prompt on each line")
        raise ConfigError("no prompt given; pass --prompt TEXT or --prompt-file FILE")
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {a.max_new_tokens} must be at least 1")
    if a.tensor_model_parallel_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} must be at least 1")
    from jax3d.inference.generate import Sampling
    sampling = Sampling(greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    sampling.validate()

    from jax3d.cli.train import setup_devices
    setup_devices(a)
    import jax.numpy as jnp

    from jax3d.inference.generate import generator_for, load_gpt_checkpoint

    cfg, params, tok = load_gpt_checkpoint(a.load, a.ckpt_step)
    ids = [tok.tokenize(p) for p in prompts]
    gen = generator_for(cfg, params, tok, ids, a.max_new_tokens, tp=a.tensor_model_parallel_size,
                        dtype=jnp.bfloat16 if a.bf16 else jnp.float32, checkpoint=a.load)
    eod = None if a.ignore_eod else gen.eod
    outs = [[] for _ in ids]
    printed = None
    for step_tokens in gen.stream(ids, a.max_new_tokens, sampling, a.seed, stop_at_eod=eod is not None):
        for row, t in zip(outs, step_tokens):
            if not (row and row[-1] == eod):
                row.append(int(t))
        if len(ids) == 1:  # the prompt, then its continuation as it grows (a token may not end on a character)
            # the prompt once the first token is in, so that bad input prints nothing
            printed = _prompt_shown(prompts[0], printed)
            text = tok.detokenize([t for t in outs[0] if t != eod])
            if text.startswith(printed) and not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    if len(ids) == 1:  # whatever was held back waiting for the rest of a character
        printed = _prompt_shown(prompts[0], printed)
        text = tok.detokenize([t for t in outs[0] if t != eod])
        print(text[len(printed):] if text.startswith(printed) else "\n" + text)
    else:
        for p, row in zip(prompts, outs):
            print(p + tok.detokenize([t for t in row if t != eod]))
            print()
    counts = gen.compile_counts()
    print(f"jax3d: {len(ids)} prompt(s), compiled prefill {counts['prefill']}x and decode {counts['decode']}x",
          file=sys.stderr)
    return 0
