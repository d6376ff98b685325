"""`launch/generate.py`: continue prompts with a trained GPT checkpoint, streaming text to stdout, or from one
JSONL file to another."""
from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    from jax3d.cli.common import (HelpFormatter, OneLineParser, add_device_flags, add_decode_dtype_flags,
                                  add_model_parallel_flags)

    p = OneLineParser(prog="launch/generate.py", description="Continue prompts with a jax3d GPT checkpoint (KV cache; "
                      "tensor parallel with --tensor-model-parallel-size).",
                      formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (a --save of train.py, or convert_hf.py import)")
    p.add_argument("--ckpt-step", type=int, default=-1, help="step to load (default: the latest)")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt; repeat for a batch (default: none; give --prompt, --prompt-file or --input-jsonl)")
    p.add_argument("--prompt-file", default="", help="a UTF-8 file of prompts, one a line, after any --prompt "
                   "(default: none)")
    p.add_argument("--input-jsonl", default="", help='a file of JSON objects, one a line, each {"prompt": TEXT} '
                   'with optional "max_new_tokens" and "stop" (a string or a list); after any other prompts (default: none)')
    p.add_argument("--output-jsonl", default="", help='write {"prompt", "completion", "finish_reason"} (eod, stop or '
                   "length) per prompt, in order, to this file instead of printing the text (default: none)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (at most)")
    p.add_argument("--stop", action="append", default=[], help="end a continuation at this text, which is left "
                   "out; repeat for several (default: none)")
    p.add_argument("--batch-size", type=int, default=32, help="prompts generated together")
    p.add_argument("--greedy", action="store_true", help="always the most likely token")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 for all of them")
    p.add_argument("--top-p", type=float, default=1.0, help="sample from the most likely tokens that hold this much probability; 1.0 for all")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16")
    add_decode_dtype_flags(p)
    p.add_argument("--ignore-eod", action="store_true", help="keep going past the end-of-document token")
    add_model_parallel_flags(p, pipeline=False)
    add_device_flags(p)
    return p


def _bad_input() -> tuple:
    from jax3d.config import ConfigError
    from jax3d.data.indexed import DataError
    return ConfigError, DataError


def main(argv=None) -> int:
    from jax3d.cli.common import run_command
    return run_command(_main, argv, _bad_input)


def _read(path: str, flag: str) -> list[str]:
    from jax3d.config import ConfigError
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{flag} {path} is unreadable ({e.strerror}); pass a text file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{flag} {path} is not UTF-8 text; pass a text file") from None


def read_jsonl(path: str, max_new_tokens: int) -> list[dict]:
    """The prompts of an --input-jsonl file: {"prompt", "max_new_tokens", "stop": [...]} per non-blank line;
    ConfigError naming the line for anything else."""
    from jax3d.config import ConfigError
    out = []
    for n, line in enumerate(_read(path, "--input-jsonl"), 1):
        if not line.strip():
            continue
        where = f"--input-jsonl {path} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON ({e.msg}); write one JSON object per line") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ConfigError(f'{where} has no "prompt" text; write {{"prompt": "..."}} on each line')
        new = obj.get("max_new_tokens", max_new_tokens)
        if not isinstance(new, int) or isinstance(new, bool) or not 1 <= new <= max_new_tokens:
            raise ConfigError(f'{where}: "max_new_tokens" {new!r} must be a whole number from 1 to --max-new-tokens '
                              f"{max_new_tokens}")
        stop = obj.get("stop", [])
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ConfigError(f'{where}: "stop" must be a string or a list of strings')
        out.append({"prompt": obj["prompt"], "max_new_tokens": new, "stop": stop})
    return out


def _requests(a) -> list[dict]:
    from jax3d.config import ConfigError
    reqs = [{"prompt": p, "max_new_tokens": a.max_new_tokens, "stop": []} for p in a.prompt]
    if a.prompt_file:
        lines = [line for line in _read(a.prompt_file, "--prompt-file") if line.strip()]
        if not lines:
            raise ConfigError(f"--prompt-file {a.prompt_file} holds no prompt; put one prompt on each line")
        reqs += [{"prompt": p, "max_new_tokens": a.max_new_tokens, "stop": []} for p in lines]
    if a.input_jsonl:
        rows = read_jsonl(a.input_jsonl, a.max_new_tokens)
        if not rows:
            raise ConfigError(f'--input-jsonl {a.input_jsonl} holds no prompt; write {{"prompt": "..."}} on each line')
        reqs += rows
    if not reqs:
        raise ConfigError("no prompt given; pass --prompt TEXT, --prompt-file FILE or --input-jsonl FILE")
    for r in reqs:
        r["stop"] = list(a.stop) + r["stop"]
    return reqs


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    from jax3d.config import ConfigError
    if a.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {a.max_new_tokens} must be at least 1")
    if a.batch_size < 1:
        raise ConfigError(f"--batch-size {a.batch_size} must be at least 1")
    if a.tensor_model_parallel_size < 1:
        raise ConfigError(f"--tensor-model-parallel-size {a.tensor_model_parallel_size} must be at least 1")
    if any(not s for s in a.stop):
        raise ConfigError("--stop was given an empty string; pass the text to stop at")
    reqs = _requests(a)
    from jax3d.inference.generate import Sampling
    sampling = Sampling(greedy=a.greedy, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    sampling.validate()

    from jax3d.cli.train import setup_devices
    setup_devices(a)
    from jax3d.config import PrecisionConfig
    from jax3d.inference.generate import generator_for, load_gpt_checkpoint
    from jax3d.inference.text import Completions
    from jax3d.parallel.precision import PrecisionPolicy, dtype_of_flags

    cfg, params, tok = load_gpt_checkpoint(a.load, a.ckpt_step)
    ids = [tok.tokenize(r["prompt"]) for r in reqs]
    precision = PrecisionPolicy.of(PrecisionConfig(dtype=dtype_of_flags(a.bf16)), kv_cache_dtype=a.kv_cache_dtype,
                                   quantization=a.quantization)
    gen = generator_for(cfg, params, tok, ids, a.max_new_tokens, tp=a.tensor_model_parallel_size,
                        dtype=precision.compute_dtype, checkpoint=a.load, batch=a.batch_size,
                        cache_dtype=precision.cache_dtype, weight_dtype=precision.weight_dtype)
    eod = None if a.ignore_eod else gen.eod
    streaming = len(reqs) == 1 and not a.output_jsonl
    out = open(a.output_jsonl, "w", encoding="utf-8") if a.output_jsonl else None  # noqa: SIM115 (closed below)
    made, t0 = 0, time.perf_counter()
    try:
        for first in range(0, len(reqs), gen.batch):
            group = range(first, min(first + gen.batch, len(reqs)))
            done = Completions(tok, [reqs[i]["stop"] for i in group], eod)
            printed = None
            for chunk in gen.stream([ids[i] for i in group], [reqs[i]["max_new_tokens"] for i in group], sampling,
                                    a.seed + first, stop_at_eod=eod is not None, halt=done.halt):
                done.add(chunk)
                if streaming:  # the prompt once the first token is in (bad input prints nothing), then the text
                    printed = _print_more(reqs[0]["prompt"], printed, done.settled(0))
            done.close()
            made += sum(len(t) for t in done.tokens)
            for j, i in enumerate(group):
                if streaming:
                    _print_more(reqs[0]["prompt"], printed, done.text(0))
                    print()
                elif out is not None:
                    out.write(json.dumps({"prompt": reqs[i]["prompt"], "completion": done.text(j),
                                          "finish_reason": done.finish[j]}) + "\n")
                else:
                    print(reqs[i]["prompt"] + done.text(j))
                    print()
    finally:
        if out is not None:
            out.close()
    counts = gen.compile_counts()
    print(f"jax3d: {len(reqs)} prompt(s), {made} tokens in {time.perf_counter() - t0:.1f} s, compiled prefill "
          f"{counts['prefill']}x and decode {counts['decode']}x", file=sys.stderr)
    return 0


def _print_more(prompt: str, printed: str | None, text: str) -> str:
    """Prints what of `text` is new since `printed` (None: not even the prompt yet), and returns what is
    printed now. Text that changed under what was printed (a token that rewrites the end of the text) is
    started again on a new line."""
    if printed is None:
        sys.stdout.write(prompt)
        printed = ""
    if text.startswith(printed):
        sys.stdout.write(text[len(printed):])
    else:
        sys.stdout.write("\n" + text)
    sys.stdout.flush()
    return text
