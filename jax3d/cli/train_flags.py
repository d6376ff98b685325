"""Command-line flags (Megatron-DeepSpeed's names) mapped onto the config dataclasses, in one place."""
from __future__ import annotations

import argparse
import dataclasses
import os

from jax3d.file_util import dir_problem
from jax3d.cli.common import HelpFormatter, OneLineParser, add_device_flags, layer_counts
from jax3d.cli.megatron import (add_megatron_flags, apply_aliases, implied_given, kept_from_checkpoint,
                               megatron_config)
from jax3d.config import (Config, ConfigError, DataConfig, OptimConfig, ParallelConfig, PrecisionConfig,
                          TrainConfig, default_ffn_hidden_size)
from jax3d.data.tokenizers import TOKENIZER_TYPES
from jax3d.models.families import FAMILIES, flags as family_flags, model_types
from jax3d.models.presets import get_preset, preset_names
from jax3d.parallel.plan import AUTO_LAYOUTS, SCAN_LAYERS_FROM
from jax3d.parallel.precision import LossScaling, dtype_of_flags
from jax3d.pipeline.schedules import SCHEDULES


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="launch/train.py", description=(
        "Train a GPT (Llama included) or BERT model with tensor, pipeline and ZeRO data parallelism. Flags follow "
        "Megatron-DeepSpeed; shape flags override the --preset."), formatter_class=HelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=model_types(), default=None,
                   help="model family (default: the preset's, gpt without one)")
    g.add_argument("--preset", default=None, metavar="NAME",
                   help=f"named shape, one of: {', '.join(preset_names())} (default: {_default_presets()})")
    for flag, what in (("--num-layers", "transformer blocks"), ("--hidden-size", "model width d"),
                       ("--num-attention-heads", "attention heads"),
                       ("--ffn-hidden-size", "MLP width (default: the preset's; with --hidden-size or --swiglu "
                        "given, Megatron's: 4 x --hidden-size, or with --swiglu int(8 x hidden / 3 / 64) x 64)"),
                       ("--seq-length", "tokens per sample"),
                       ("--max-position-embeddings", "learned positions, or the longest sequence without them "
                        "(default: --seq-length; without learned positions the larger of it and the preset's context)")):
        g.add_argument(flag, type=int, default=None, help=what if "default" in what else f"{what} (default: the preset's)")
    g.add_argument("--vocab-size", type=int, default=0,
                   help="model vocabulary (default: the tokenizer's, padded to --make-vocab-size-divisible-by)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="pad the vocabulary to a multiple of this")
    g.add_argument("--hidden-dropout", type=float, default=None,
                   help="dropout on the residual stream (default: the preset's, 0.1 for GPT and BERT, 0 for Llama)")
    g.add_argument("--attention-dropout", type=float, default=None,
                   help="dropout on attention probabilities (default: the preset's, 0.1 for GPT and BERT, 0 for Llama)")
    g.add_argument("--init-method-std", type=float, default=0.02, help="std of the normal weight init")
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5, help="layer-norm epsilon")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default=None,
                   help="activation recompute in the backward pass (default: none)")
    g.add_argument("--recompute-granularity", choices=["selective", "full"], default=None,
                   help="Megatron's spelling of --recompute (default: none)")
    g.add_argument("--checkpoint-activations", action="store_true", help="same as --recompute full")
    g.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="lax.scan over the blocks, which compiles a deep stack in seconds rather than minutes "
                        f"(default: on from {SCAN_LAYERS_FROM} layers on CPU devices, off on GPUs where it runs slower)")
    g.add_argument("--attention-impl", choices=["auto", "xla", "cudnn"], default="auto",
                   help="attention kernel; auto is cuDNN flash attention on GPUs in bf16/fp16, else XLA")
    _add_family_flags(p)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="mesh axis `model` (default: when neither this nor --pipeline-model-parallel-size is "
                        "given, the first (tensor, pipeline) pair of "
                        f"{', '.join(f'({tp}, {pp})' for tp, pp in AUTO_LAYOUTS)} that divides the devices and "
                        "passes every layout rule, as jax3d.parallel.plan.resolve picks it; 1 when only the pipeline "
                        "size is given)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=None,
                   help="mesh axis `stage` (default: chosen with the tensor size, see "
                        "--tensor-model-parallel-size; 1 when only the tensor size is given)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard layer-norm and dropout activations over sequence")
    g.add_argument("--zero-stage", type=int, default=None, choices=[0, 1, 2, 3],
                   help="shard optimizer state (1), also grads (2), also params (3) over `data` "
                        "(default: 1 with data parallelism, else 0)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help="pipeline schedule (default: interleaved with --num-layers-per-virtual-pipeline-stage, "
                        "as in Megatron, else 1f1b)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk, for the interleaved schedule (default: none, one chunk per stage)")
    g.add_argument("--pipeline-model-parallel-layout", default="", metavar="N,N,...",
                   help="layers per (virtual) stage when they don't divide evenly, e.g. 3,5,5,3 (default: an even split)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None, help="samples per micro-batch per data-parallel rank "
                   "(default: the preset's)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step = micro x accumulation x data (default: the preset's)")
    g.add_argument("--train-iters", type=int, default=None, help="train steps (default: 200, unless --train-samples "
                   "counts the run)")
    g.add_argument("--exit-interval", type=int, default=0, help="stop at the next multiple of this many iterations")
    g.add_argument("--seed", type=int, default=1234, help="seed of the init, data order and dropout")
    g.add_argument("--log-interval", type=int, default=10, help="steps between metric lines")
    g.add_argument("--eval-interval", type=int, default=100, help="steps between validations (0: none)")
    g.add_argument("--eval-iters", type=int, default=4, help="global batches per validation (0: none, as Megatron)")
    g.add_argument("--log-dir", default="runs/latest", help="metrics.jsonl and TensorBoard events go here")
    g.add_argument("--no-progress", action="store_true", help="no progress bar; print one line per log interval instead")
    g.add_argument("--peak-tflops", type=float, default=0.0, help="per-device peak for MFU (default: by device kind)")
    g.add_argument("--dry-run", action="store_true", help="compile the step from abstract shapes and report memory")
    g.add_argument("--no-memory-check", action="store_true",
                   help="start even when the compiled step's memory exceeds what the devices have")

    g = p.add_argument_group("optimizer (AdamW)")
    g.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=None,
                   help="learning rate at the end of the decay (default: 6e-5, or --lr / 10 below that)")
    g.add_argument("--lr-warmup-iters", type=int, default=0, help="linear warm-up steps")
    g.add_argument("--lr-decay-iters", type=int, default=0, help="decay steps (default: --train-iters)")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine",
                   help="learning-rate decay")
    g.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: none)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="Adam beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon")

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true", help="compute in bfloat16 (fp32 master weights)")
    g.add_argument("--fp16", action="store_true", help="compute in float16 with loss scaling (fp32 master weights)")
    g.add_argument("--loss-scale", type=float, default=0.0, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="first dynamic fp16 loss scale")
    g.add_argument("--loss-scale-window", type=int, default=1000, help="good steps before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflows tolerated before the scale halves")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="smallest dynamic fp16 loss scale")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=[], metavar="PATH",
                   help="Megatron .bin/.idx prefix, or weights and prefixes: 0.3 A 0.7 B (default: the bundled corpus, or "
                        "the checkpoint's with --load)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--tokenizer-type", default="", choices=["", *TOKENIZER_TYPES], metavar="TYPE",
                   help=f"one of: {', '.join(TOKENIZER_TYPES)} (default: the checkpoint's with --load; else what "
                        "the files given imply, --vocab-file Megatron's GPT2BPETokenizer for GPT and Llama and "
                        "BertWordPieceLowerCase for BERT, --tokenizer-model GPTSentencePieceTokenizer, "
                        "--tokenizer-file HFTokenizer; the bundled corpus's without --data-path)")
    g.add_argument("--vocab-file", default="", help="GPT-2 vocab.json or BERT vocab.txt (default: none, or the checkpoint's with --load)")
    g.add_argument("--merge-file", default="", help="GPT-2 merges.txt (default: none, or the checkpoint's with --load)")
    g.add_argument("--tokenizer-file", default="", help="a Hugging Face tokenizer.json (HFTokenizer) (default: none, or the checkpoint's with --load)")
    g.add_argument("--data-cache-path", default="", help="where sample indices are cached (default: beside the data)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", default="", help="checkpoint directory to write (default: none, nothing is saved)")
    g.add_argument("--save-interval", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    g.add_argument("--load", default="", help="checkpoint directory to resume or fine-tune from; a resumed run keeps its data, tokenizer, "
                        "optimizer settings, global batch size, precision and seed unless flags set them (default: none)")
    g.add_argument("--ckpt-step", type=int, default=-1, help="step to load (default: the latest)")
    g.add_argument("--keep-checkpoints", type=int, default=0, help="keep only the newest N (0: all)")
    g.add_argument("--exit-after-skipped-iters", type=int, default=None, metavar="N",
                   help="stop (exit 3) once the last N steps were all skipped for non-finite gradients, before a "
                        "save could rotate good checkpoints away; 0: never (default: 50, or more where an --fp16 "
                        "loss scale needs more overflows to come down)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the weights of --load and start a new run at step 0: a fresh optimizer, "
                        "learning-rate schedule, data position and RNG, on this command line's data")
    g.add_argument("--override-data", action="store_true",
                   help="resume --load (its step, optimizer and data position) on other data or another "
                        "tokenizer than it was trained on; without it a resumed run keeps the checkpoint's")
    g.add_argument("--no-load-optim", action="store_true",
                   help="resume at the checkpoint's step with fresh Adam moments (the schedule goes on)")
    g.add_argument("--no-load-rng", action="store_true",
                   help="resume with the RNG of --seed instead of the checkpoint's (dropout masks)")
    g.add_argument("--no-save-optim", action="store_true",
                   help="leave the optimizer state out of saved checkpoints (a third of their size in fp32 "
                        "Adam); loading one starts fresh moments")
    g.add_argument("--no-save-rng", action="store_true", help="leave the RNG out of saved checkpoints")

    add_device_flags(p.add_argument_group("devices"))
    add_megatron_flags(p)
    return p


def _default_presets() -> str:
    """"gpt-tiny, or bert-tiny with --model bert": each model type's default preset."""
    first, *others = model_types()
    return ", or ".join([FAMILIES[first].default_preset, *(f"{FAMILIES[t].default_preset} with --model {t}"
                                                           for t in others)])


def _add_family_flags(p) -> None:
    """Each model family's group of flags (jax3d.models.families; Llama's are Megatron-DeepSpeed's LLaMA flags)."""
    for family in FAMILIES.values():
        if family.flags:
            g = p.add_argument_group(family.flag_group)
            for flag in family.flags:
                g.add_argument(*flag.names, **flag.kwargs)


def given_flags(argv) -> set[str]:
    """The argparse dests that `argv` sets explicitly (not left at their defaults)."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    given = p.parse_args(argv)
    return (set(vars(given)) | implied_given(given)) - kept_from_checkpoint(given)


def _given(value, default):
    """A flag's value where given (0 included, for the range checks to refuse), else the default."""
    return default if value is None else value


def _override(base, **kw):
    return dataclasses.replace(base, **{k: v for k, v in kw.items() if v is not None})


def config_from_args(a: argparse.Namespace) -> Config:
    """The Config a parsed command line describes; fields it leaves to `jax3d.parallel.plan.resolve` are None or 0."""
    apply_aliases(a)  # Megatron's other names for flags below, e.g. --encoder-num-layers
    preset = a.preset or FAMILIES[a.model or "gpt"].default_preset
    model, batch = get_preset(preset)
    if a.model and a.model != model.model_type:
        raise ConfigError(f"--model {a.model} does not match --preset {preset}; pick a {a.model}-* preset")
    if a.bf16 and a.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    asked = {f"{flag} {v}" if flag != "--checkpoint-activations" else flag: v for flag, v in
             (("--recompute", a.recompute), ("--recompute-granularity", a.recompute_granularity),
              ("--checkpoint-activations", "full" if a.checkpoint_activations else None),
              ("--recompute-activations", "selective" if a.recompute_activations else None)) if v}
    if len(set(asked.values())) > 1:
        raise ConfigError(f"{' and '.join(asked)} ask for different recomputation; pass one of them")
    recompute = next(iter(asked.values()), None)
    if a.loss_scale and not a.fp16 and not a.deepspeed:  # under --deepspeed its JSON scales (jax3d.cli.deepspeed)
        raise ConfigError(f"--loss-scale {a.loss_scale} scales fp16 gradients and this run is not --fp16; drop it "
                          "or add --fp16")
    model = _override(model, num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_attention_heads=a.num_attention_heads, seq_length=a.seq_length, recompute=recompute,
                      hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout,
                      init_method_std=a.init_method_std, layernorm_epsilon=a.layernorm_epsilon,
                      scan_layers=a.scan_layers, attention_impl=a.attention_impl,
                      # Megatron's default: as many KV heads as heads (0)
                      num_key_value_heads=0 if a.num_key_value_heads is None and a.num_attention_heads else
                      a.num_key_value_heads,
                      **{f.dest: getattr(a, f.dest) for f in family_flags() if f.field})
    reshaped = a.hidden_size is not None or a.swiglu is not None  # the preset's MLP width no longer applies
    model = dataclasses.replace(model, ffn_hidden_size=a.ffn_hidden_size or (
        default_ffn_hidden_size(model.hidden_size, model.swiglu) if reshaped else model.ffn_hidden_size),
        max_position_embeddings=a.max_position_embeddings or (
            model.seq_length if model.add_position_embedding else max(model.seq_length, model.max_position_embeddings)))
    # 0: the tokenizer's vocabulary, padded (jax3d.parallel.plan.resolve)
    model = dataclasses.replace(model, vocab_size=a.vocab_size, make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    try:
        layout = layer_counts(a.pipeline_model_parallel_layout, "--pipeline-model-parallel-layout")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    schedule = a.pipeline_schedule  # None: the plan picks (jax3d.parallel.pipeline_spec.default_schedule)
    parallel = ParallelConfig(tensor_parallel=a.tensor_model_parallel_size,
                              pipeline_parallel=a.pipeline_model_parallel_size, zero_stage=a.zero_stage,
                              sequence_parallel=a.sequence_parallel, pipeline_schedule=schedule,
                              layers_per_virtual_stage=a.num_layers_per_virtual_pipeline_stage or 0,
                              pipeline_layout=layout)
    min_lr = a.min_lr
    if min_lr is None:  # 6e-5, or a tenth of --lr where 6e-5 would be above it (the decay would raise the rate)
        min_lr = OptimConfig.min_lr if a.lr >= OptimConfig.min_lr else a.lr / 10
    optim = OptimConfig(lr=a.lr, min_lr=min_lr, lr_warmup_iters=a.lr_warmup_iters,
                        lr_decay_iters=a.lr_decay_iters, lr_decay_style=a.lr_decay_style,
                        weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
                        adam_beta2=a.adam_beta2, adam_eps=a.adam_eps)
    precision = PrecisionConfig(dtype=dtype_of_flags(a.bf16, a.fp16),
                                loss_scale=a.loss_scale, initial_loss_scale=a.initial_loss_scale,
                                loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis,
                                min_loss_scale=a.min_loss_scale)
    data = DataConfig(data_path=tuple(a.data_path), split=a.split, tokenizer_type=a.tokenizer_type,
                      vocab_file=a.vocab_file, merge_file=a.merge_file, tokenizer_file=a.tokenizer_file,
                      cache_dir=a.data_cache_path)
    train = TrainConfig(micro_batch_size=_given(a.micro_batch_size, batch["micro_batch_size"]),
                        global_batch_size=_given(a.global_batch_size, batch["global_batch_size"]),
                        train_iters=_given(a.train_iters, 200), exit_interval=a.exit_interval, seed=a.seed,
                        log_interval=a.log_interval, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
                        log_dir=a.log_dir, save=a.save, save_interval=a.save_interval, load=a.load,
                        ckpt_step=a.ckpt_step, keep_checkpoints=a.keep_checkpoints, peak_tflops=a.peak_tflops,
                        exit_after_skipped_iters=_given(a.exit_after_skipped_iters, -1),
                        finetune=a.finetune, override_data=a.override_data, no_load_optim=a.no_load_optim,
                        no_load_rng=a.no_load_rng, no_save_optim=a.no_save_optim, no_save_rng=a.no_save_rng)
    _refuse_bad_values(a, model, optim, train)
    if a.exit_after_skipped_iters:
        from jax3d.train.skipped import check_limit
        check_limit(a.exit_after_skipped_iters, LossScaling.of(precision))
    tok_flags = [f for f, v in (("--tokenizer-type", a.tokenizer_type), ("--vocab-file", a.vocab_file),
                                ("--merge-file", a.merge_file), ("--tokenizer-file", a.tokenizer_file),
                                ("--tokenizer-model", a.tokenizer_model)) if v]
    loading = [f"--{k.replace('_', '-')}" for k in ("finetune", "override_data", "no_load_optim", "no_load_rng")
               if getattr(a, k)]
    if loading and not a.load:
        raise ConfigError(f"{' and '.join(loading)} {'say' if len(loading) > 1 else 'says'} how to read --load, "
                          "which is not given; add --load or drop them")
    if a.finetune and a.save and os.path.abspath(a.save) == os.path.abspath(a.load):
        raise ConfigError(f"--finetune starts a new run at step 0, whose saves would replace the checkpoints in "
                          f"--load {a.load}; pass another --save")
    if a.ckpt_step != -1 and not a.load:
        raise ConfigError(f"--ckpt-step {a.ckpt_step} picks a step of --load, which is not given; add --load or drop it")
    if tok_flags and not (a.data_path or a.train_data_path or a.valid_data_path or a.test_data_path):
        raise ConfigError(f"--data-path is not given, so {', '.join(tok_flags)} would go unused (the bundled "
                          "corpus has its own tokenizer); add --data-path or drop them")
    return megatron_config(a, Config(model=model, parallel=parallel, optim=optim, precision=precision, data=data,
                                     train=train))


def _refuse_bad_values(a: argparse.Namespace, model, optim, train) -> None:
    """Range and directory checks, each failure one ConfigError sentence naming the flag."""
    at_least_1 = [("--train-iters", train.train_iters), ("--num-key-value-heads", _given(a.num_key_value_heads, 1)), ("--log-interval", a.log_interval),
                  ("--micro-batch-size", train.micro_batch_size), ("--global-batch-size", train.global_batch_size),
                  ("--make-vocab-size-divisible-by", a.make_vocab_size_divisible_by),
                  ("--loss-scale-window", a.loss_scale_window), ("--hysteresis", a.hysteresis)]
    positive = [("--layernorm-epsilon", a.layernorm_epsilon), ("--adam-eps", a.adam_eps),
                ("--initial-loss-scale", a.initial_loss_scale), ("--min-loss-scale", a.min_loss_scale)]
    not_negative = [("--lr", a.lr), ("--min-lr", optim.min_lr), ("--lr-warmup-iters", a.lr_warmup_iters),
                    ("--lr-decay-iters", a.lr_decay_iters), ("--weight-decay", a.weight_decay),
                    ("--clip-grad", a.clip_grad), ("--exit-interval", a.exit_interval),
                    ("--eval-interval", a.eval_interval), ("--eval-iters", a.eval_iters),
                    ("--save-interval", a.save_interval), ("--keep-checkpoints", a.keep_checkpoints),
                    ("--exit-after-skipped-iters", _given(a.exit_after_skipped_iters, 0)),
                    ("--vocab-size", a.vocab_size), ("--init-method-std", a.init_method_std),
                    ("--loss-scale", a.loss_scale)]
    fractions = [("--hidden-dropout", model.hidden_dropout), ("--attention-dropout", model.attention_dropout),
                 ("--adam-beta1", a.adam_beta1), ("--adam-beta2", a.adam_beta2)]
    for flags, ok, rule in [(at_least_1, lambda v: v >= 1, "must be at least 1"),
                            (positive, lambda v: v > 0, "must be positive"),
                            (not_negative, lambda v: v >= 0, "must not be negative"),
                            (fractions, lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")]:
        for flag, v in flags:
            if not ok(v):
                raise ConfigError(f"{flag} {v} {rule}")
    if optim.min_lr > optim.lr and optim.lr_decay_style != "constant":
        raise ConfigError(f"--min-lr {optim.min_lr} is above --lr {optim.lr}, so the decay would raise the rate; "
                          "lower --min-lr")
    for flag, path in [("--save", a.save), ("--log-dir", a.log_dir)]:
        problem = dir_problem(path, probe=not a.dry_run) if path else None  # a dry run writes nothing
        if problem:
            raise ConfigError(f"{flag} {path} {problem}; pass a directory you can write")

