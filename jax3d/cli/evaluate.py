"""`launch/evaluate.py`: loss and perplexity of a checkpoint over a data set (jax3d.train.evaluate does the work)."""
from __future__ import annotations

import json

from jax3d.cli.common import HelpFormatter, OneLineParser, add_device_flags, add_model_parallel_flags, run_command
from jax3d.config import ConfigError
from jax3d.data.indexed import DataError
from jax3d.parallel.precision import dtype_of_flags
from jax3d.train.evaluate import SPLITS, evaluate_checkpoint


def main(argv=None) -> int:
    """`launch/evaluate.py`: one JSON line of figures; bad input is one sentence and exit 2."""
    return run_command(_main, argv, lambda: (ConfigError, DataError))


def build_parser():
    p = OneLineParser(prog="launch/evaluate.py", description="Loss and perplexity of a checkpoint over a data set.",
                      formatter_class=HelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory")
    p.add_argument("--ckpt-step", type=int, default=-1, help="the step to evaluate (default: the latest)")
    p.add_argument("--data-path", nargs="+", default=[], help="Megatron .bin/.idx prefix (or weights and prefixes) (default: the data the checkpoint was "
                   "trained on, found by its fingerprint, unless --text-file is given)")
    p.add_argument("--text-file", default="", help="a UTF-8 text file (GPT), cut into windows of the model's sequence length "
                   "(default: none)")
    p.add_argument("--split", default=None, help="as in training (default: the checkpoint's run)")
    p.add_argument("--split-name", choices=SPLITS, default="valid", help="which part of --split to evaluate (default: valid)")
    p.add_argument("--num-samples", type=int, default=0, help="the first N samples (default: all, one epoch)")
    p.add_argument("--seed", type=int, default=None, help="sample order seed (default: the checkpoint's run)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per device per forward pass")
    add_model_parallel_flags(p)
    p.add_argument("--bf16", action="store_true", help="compute in bfloat16 (default: float32)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="evaluate the weights as launch/generate.py --quantization fp8 keeps them (e4m3, a scale per "
                        "output column): what fp8 generation costs the model on this data (default: none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_device_flags(p)
    return p


def _main(argv) -> int:
    a = build_parser().parse_args(argv)
    for flag, v in [("--micro-batch-size", a.micro_batch_size), ("--tensor-model-parallel-size",
                    a.tensor_model_parallel_size), ("--pipeline-model-parallel-size", a.pipeline_model_parallel_size)]:
        if v < 1:
            raise ConfigError(f"{flag} {v} must be at least 1")
    if a.num_samples < 0:
        raise ConfigError(f"--num-samples {a.num_samples} must not be negative")
    from jax3d.cli.train import setup_devices
    setup_devices(a)
    if not a.data_path and not a.text_file:  # the checkpoint's own data, where it is now
        from jax3d.train.resume import checkpoint_data_path
        a.data_path, whole = checkpoint_data_path(a.load, a.ckpt_step, a.split_name)
        if whole and a.split is None:  # a split trained on data of its own: all of it
            a.split = whole
    out = evaluate_checkpoint(a.load, step=a.ckpt_step, data_paths=a.data_path, text_file=a.text_file,
                              split=a.split, which=a.split_name, num_samples=a.num_samples,
                              micro_batch_size=a.micro_batch_size, tp=a.tensor_model_parallel_size,
                              pp=a.pipeline_model_parallel_size, dtype=dtype_of_flags(a.bf16),
                              seed=a.seed, progress=not a.no_progress, quantization=a.quantization)
    print(json.dumps(out))
    return 0
