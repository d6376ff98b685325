"""Command-line flags (Megatron-DeepSpeed's names) mapped onto the config dataclasses, in one place."""
from __future__ import annotations

import argparse
import dataclasses

from jax3d.argparse_util import OneLineParser
from jax3d.config import (Config, ConfigError, DataConfig, OptimConfig, ParallelConfig, PrecisionConfig,
                          TrainConfig)
from jax3d.models.presets import get_preset, preset_names


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="launch/train.py", description=(
        "Train a GPT or BERT model with tensor, pipeline and ZeRO data parallelism. Flags follow "
        "Megatron-DeepSpeed; shape flags override the --preset."), formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=["gpt", "bert"], default=None, help="model family (default: the preset's)")
    g.add_argument("--preset", default=None, help=f"named shape: {', '.join(preset_names())} (default gpt-tiny / bert-tiny)")
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--seq-length",
                 "--max-position-embeddings"):
        g.add_argument(flag, type=int, default=None, help="overrides the preset")
    g.add_argument("--vocab-size", type=int, default=0, help="force the model vocabulary (default: tokenizer's, padded)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                   help="activation recompute policy")
    g.add_argument("--recompute-granularity", choices=["selective", "full"], default=None,
                   help="Megatron's spelling of --recompute")
    g.add_argument("--checkpoint-activations", action="store_true", help="same as --recompute full")
    g.add_argument("--scan-layers", action="store_true", help="lax.scan over blocks (faster compiles of deep models)")
    g.add_argument("--attention-impl", choices=["auto", "xla", "cudnn"], default="auto")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None, help="mesh axis `model` (default: auto)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None, help="mesh axis `stage` (default: auto)")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--zero-stage", type=int, default=None, help="0-3: shard optimizer state / grads / params over `data`")
    g.add_argument("--pipeline-schedule", choices=["gpipe", "1f1b", "interleaved", "zb-h1"], default="1f1b")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--pipeline-model-parallel-layout", default="", help="layers per stage, e.g. 3,5,5,3")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--exit-interval", type=int, default=0, help="stop at the next multiple of this many iterations")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100)
    g.add_argument("--eval-iters", type=int, default=4)
    g.add_argument("--log-dir", default="runs/latest", help="metrics.jsonl and TensorBoard events go here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar; print one line per log interval instead")
    g.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (default: by device kind)")
    g.add_argument("--dry-run", action="store_true", help="compile the step from abstract shapes and report memory")

    g = p.add_argument_group("optimizer")
    g.add_argument("--lr", type=float, default=6e-4)
    g.add_argument("--min-lr", type=float, default=6e-5)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=0, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=0.0, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--min-loss-scale", type=float, default=1.0)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], help="prefix, or weights and prefixes: 0.3 A 0.7 B")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--tokenizer-type", default="")
    g.add_argument("--vocab-file", default="")
    g.add_argument("--merge-file", default="")
    g.add_argument("--tokenizer-file", default="")
    g.add_argument("--data-cache-path", default="")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default="")
    g.add_argument("--save-interval", type=int, default=0)
    g.add_argument("--load", default="")
    g.add_argument("--ckpt-step", type=int, default=-1)
    g.add_argument("--keep-checkpoints", type=int, default=0)

    g = p.add_argument_group("devices")
    g.add_argument("--cpu-devices", type=int, default=None,
                   help="emulate N CPU devices (default: 8 when no accelerator is present)")
    g.add_argument("--coordinator-address", default="")
    g.add_argument("--num-processes", type=int, default=0)
    g.add_argument("--process-id", type=int, default=-1)
    return p


def given_flags(argv) -> set[str]:
    """The argparse dests that `argv` sets explicitly (not left at their defaults)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return set(vars(p.parse_args(argv)))


def _override(base, **kw):
    return dataclasses.replace(base, **{k: v for k, v in kw.items() if v is not None})


def config_from_args(a: argparse.Namespace) -> tuple[Config, dict]:
    """The Config a parsed command line describes, plus launcher-only settings."""
    preset = a.preset or ("bert-tiny" if a.model == "bert" else "gpt-tiny")
    model, batch = get_preset(preset)
    if a.model and a.model != model.model_type:
        raise ConfigError(f"--model {a.model} does not match --preset {preset}; pick a {a.model}-* preset")
    if a.bf16 and a.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    recompute = a.recompute or a.recompute_granularity or ("full" if a.checkpoint_activations else None)
    model = _override(model, num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_attention_heads=a.num_attention_heads, seq_length=a.seq_length, recompute=recompute,
                      hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
                      init_method_std=a.init_method_std, layernorm_epsilon=a.layernorm_epsilon,
                      scan_layers=a.scan_layers, attention_impl=a.attention_impl)
    model = dataclasses.replace(model, ffn_hidden_size=a.ffn_hidden_size or 4 * model.hidden_size,
                                max_position_embeddings=a.max_position_embeddings or model.seq_length)
    if a.vocab_size:
        model = dataclasses.replace(model, vocab_size=a.vocab_size)
    try:
        layout = tuple(int(x) for x in a.pipeline_model_parallel_layout.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--pipeline-model-parallel-layout {a.pipeline_model_parallel_layout!r} must be "
                          "comma-separated layer counts, e.g. 3,5,5,3") from None
    pp = a.pipeline_model_parallel_size or 1
    virtual = 1
    if a.num_layers_per_virtual_pipeline_stage:
        if a.pipeline_model_parallel_size is None:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs an explicit "
                              "--pipeline-model-parallel-size")
        per_stage = model.num_layers // max(pp, 1)
        if per_stage % a.num_layers_per_virtual_pipeline_stage:
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} "
                              f"does not divide the {per_stage} layers of each stage")
        virtual = per_stage // a.num_layers_per_virtual_pipeline_stage
    parallel = ParallelConfig(tensor_parallel=a.tensor_model_parallel_size or 1, pipeline_parallel=pp,
                              zero_stage=a.zero_stage or 0, sequence_parallel=a.sequence_parallel,
                              pipeline_schedule=a.pipeline_schedule, virtual_stages=virtual,
                              pipeline_layout=layout)
    optim = OptimConfig(lr=a.lr, min_lr=a.min_lr, lr_warmup_iters=a.lr_warmup_iters,
                        lr_decay_iters=a.lr_decay_iters, lr_decay_style=a.lr_decay_style,
                        weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
                        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps)
    precision = PrecisionConfig(dtype="bfloat16" if a.bf16 else "float16" if a.fp16 else "float32",
                                loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
                                loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
                                min_loss_scale=a.min_loss_scale)
    data = DataConfig(data_path=tuple(a.data_path), split=a.split, tokenizer_type=a.tokenizer_type,
                      vocab_file=a.vocab_file, merge_file=a.merge_file, tokenizer_file=a.tokenizer_file,
                      cache_dir=a.data_cache_path)
    train = TrainConfig(micro_batch_size=a.micro_batch_size or batch["micro_batch_size"],
                        global_batch_size=a.global_batch_size or batch["global_batch_size"],
                        train_iters=a.train_iters, exit_interval=a.exit_interval, seed=a.seed,
                        log_interval=a.log_interval, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
                        log_dir=a.log_dir, save=a.save, save_interval=a.save_interval, load=a.load,
                        ckpt_step=a.ckpt_step, keep_checkpoints=a.keep_checkpoints, peak_tflops=a.peak_tflops)
    for flag, v in [("--train-iters", a.train_iters), ("--log-interval", a.log_interval),
                    ("--micro-batch-size", train.micro_batch_size), ("--global-batch-size", train.global_batch_size),
                    ("--num-layers", model.num_layers), ("--hidden-size", model.hidden_size),
                    ("--num-attention-heads", model.num_attention_heads), ("--seq-length", model.seq_length),
                    ("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by)]:
        if v < 1:
            raise ConfigError(f"{flag} {v} must be at least 1")
    for flag, v in [("--hidden-dropout", a.hidden_dropout), ("--attention-dropout", a.attention_dropout)]:
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{flag} {v} must be in [0, 1)")
    cfg = Config(model=model, parallel=parallel, optim=optim, precision=precision, data=data, train=train)
    launcher = {"auto_tp": a.tensor_model_parallel_size is None, "auto_pp": a.pipeline_model_parallel_size is None,
                "auto_zero": a.zero_stage is None, "forced_vocab": a.vocab_size,
                "divisible_by": a.make_vocab_size_divisible_by}
    return cfg, launcher
