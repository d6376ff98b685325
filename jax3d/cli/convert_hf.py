"""`launch/convert_hf.py import|export`: Hugging Face folders <-> jax3d checkpoints (jax3d.hf does the work)."""
from __future__ import annotations

import json
import re

from jax3d.cli.common import HelpFormatter, OneLineParser, run_command
from jax3d.config import ConfigError
from jax3d.hf.convert import export_hf, import_hf


def main(argv=None) -> int:
    """`launch/convert_hf.py import|export`: one-sentence errors with exit 2."""
    from jax3d.data.indexed import DataError
    return run_command(_main, argv, lambda: (ConfigError, DataError))


def build_parser():
    p = OneLineParser(prog="launch/convert_hf.py", formatter_class=HelpFormatter,
                      description="Convert between Hugging Face GPT-2 / BERT / Llama folders and jax3d checkpoints.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    i = sub.add_parser("import", formatter_class=HelpFormatter,
                       help="HF folder -> jax3d checkpoint (step 0, fresh optimizer state)",
                       description="Write a Hugging Face GPT-2, BERT or Llama folder (GPT2LMHeadModel, "
                                   "BertForPreTraining, BertForMaskedLM, MegatronBertForPreTraining, LlamaForCausalLM, "
                                   "MistralForCausalLM without a sliding window; weights in safetensors, one file or "
                                   "shards, fp32, fp16 or bf16) as a jax3d checkpoint at step 0 with a fresh optimizer "
                                   "state; its tokenizer files go to SAVE/tokenizer/.")
    i.add_argument("--hf-dir", required=True, help="folder with config.json and model.safetensors")
    i.add_argument("--save", required=True, help="new checkpoint directory (pass it to train.py --load)")
    i.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (tensor parallelism shards it)")
    e = sub.add_parser("export", formatter_class=HelpFormatter,
                       help="jax3d checkpoint -> HF folder (weights, config, tokenizer and generation files)",
                       description="Write a jax3d GPT, Llama or BERT checkpoint as a Hugging Face folder "
                                   "(GPT2LMHeadModel, LlamaForCausalLM, BertForPreTraining or MegatronBertForPreTraining): "
                                   "config.json, the weights (the vocabulary cut to the tokenizer's size), the run's "
                                   "tokenizer files with tokenizer_config.json and special_tokens_map.json, and a "
                                   "GPT's generation_config.json.")
    e.add_argument("--load", required=True, help="checkpoint directory (a --save of train.py)")
    e.add_argument("--ckpt-step", type=int, default=-1, help="step to export (default: the latest)")
    e.add_argument("--hf-dir", required=True, help="new folder to write")
    e.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the written weights (default: float32, the checkpoint's exact values)")
    e.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="largest weights file, as 500MB or 5GB (KB, MB, GB are powers of 1000, KiB, MiB, GiB of 1024); "
                        "larger weights go to shards with model.safetensors.index.json (default: 5GB)")
    return p


def shard_bytes(size: str) -> int:
    """Bytes of a size written as transformers writes max_shard_size (5GB, 500MB, 2GiB); ConfigError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B)\s*", size, re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {size} must be a positive size such as 500MB or 5GB")
    unit = m.group(2).upper()
    scale = {"K": 1, "M": 2, "G": 3}[unit[0]]
    return int(float(m.group(1)) * (1024 if "I" in unit else 1000) ** scale)


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    if a.command == "import":
        if a.make_vocab_size_divisible_by < 1:
            raise ConfigError(f"--make-vocab-size-divisible-by {a.make_vocab_size_divisible_by} must be at least 1")
        summary = import_hf(a.hf_dir, a.save, divisible_by=a.make_vocab_size_divisible_by)
    else:
        summary = export_hf(a.load, a.hf_dir, step=a.ckpt_step, dtype=a.dtype, max_shard_bytes=shard_bytes(a.max_shard_size))
    print(json.dumps(summary))
    return 0
