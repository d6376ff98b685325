"""`launch/export.py`: a checkpoint's parameters as one unsharded file (jax3d.checkpoint.export does the work)."""
from __future__ import annotations

import json

from jax3d.checkpoint.export import FORMATS, export
from jax3d.cli.common import HelpFormatter, OneLineParser, run_command
from jax3d.config import ConfigError


def main(argv=None) -> int:
    """`launch/export.py`: one JSON line; bad input is one sentence and exit 2."""
    from jax3d.data.indexed import DataError
    return run_command(_main, argv, lambda: (ConfigError, DataError))


def build_parser():
    p = OneLineParser(prog="launch/export.py", formatter_class=HelpFormatter,
                      description="Export a jax3d checkpoint's parameters as one unsharded fp32 tree (no optimizer "
                                  "state), for one device. For a Hugging Face folder, use launch/convert_hf.py export.")
    p.add_argument("--load", required=True, help="checkpoint directory (the --save of a training run)")
    p.add_argument("--ckpt-step", type=int, default=-1, help="step to export (default: the latest complete)")
    p.add_argument("--output", required=True, help="a new .safetensors file, or a new directory for --format orbax")
    p.add_argument("--format", default="safetensors", choices=FORMATS,
                   help="safetensors: one file of tensors named by their parameter paths (blocks.attn.qkv_kernel), "
                        "any framework reads it, the model config and tokenizer in its metadata; orbax: a directory "
                        "with params/ (an orbax StandardCheckpointer tree, for JAX code) and jax3d.json")
    p.add_argument("--split-layers", action="store_true",
                   help="safetensors: one tensor per layer (blocks.<i>.*) instead of the stacked blocks")
    return p


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    summary = export(a.load, a.output, step=a.ckpt_step, fmt=a.format, split_layers=a.split_layers)
    print(json.dumps(summary))
    return 0
