"""Megatron-DeepSpeed's flags that jax3d's own train flags don't already cover, decided in one table.

Each flag a Megatron-DeepSpeed launch script passes either acts as it does there (ACT), is accepted and named
once in the run header with why it changes nothing under JAX and XLA (ACCEPTED), or names a feature jax3d does not
build, and then the run stops in one sentence, exit 2, before anything compiles (REFUSED). `add_megatron_flags`
puts the table's flags on the train parser; `megatron_config` turns their values into config changes, header
notes and refusals. docs/megatron-deepspeed.md is generated from the table (`doc_table`).
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from jax3d.cli.deepspeed import apply_deepspeed_json, check_accumulation, deepspeed_dests, read_deepspeed_json
from jax3d.config import Config, ConfigError

ACT, ACCEPTED, REFUSED = "ACT", "ACCEPTED-MEANINGLESS", "REFUSED-FEATURE"


@dataclass(frozen=True)
class Flag:
    """One row: the flag (and its aliases), its decision, the help text, what jax3d does with it (ACT) or why it
    changes nothing (ACCEPTED), argparse's keywords, and for the values jax3d does not build (a REFUSED row's, or
    some of an ACT row's): `asks(value, args)`, true for those values (None: any value given), `when` they are in
    words, the `feature` they ask for and the `fix` the refusal suggests."""

    names: tuple[str, ...]
    decision: str
    help: str
    what: str
    group: str
    kw: dict = field(default_factory=dict)
    asks: Callable | None = None
    when: str = ""
    feature: str = ""
    fix: str = ""

    @property
    def dest(self) -> str:
        return self.kw.get("dest") or self.names[0].lstrip("-").replace("-", "_")


def _act(names, help, what, group, **kw) -> Flag:
    return Flag(tuple(names.split()), ACT, help, what, group, kw)


def _accepted(names, help, why, group, **kw) -> Flag:
    return Flag(tuple(names.split()), ACCEPTED, help, why, group, kw)


def _refused(names, help, group, feature, fix, asks=None, when="given", otherwise="", decision=REFUSED, **kw) -> Flag:
    return Flag(tuple(names.split()), decision, help, otherwise, group, kw, asks, when, feature, fix)


_ON = {"action": "store_true"}
_RUN, _LOG, _DS, _DATA, _TORCH, _MOE_G = (
    "run length and schedule", "logging", "DeepSpeed", "data", "PyTorch and CUDA switches", "mixture of experts")
_MOE, _MOE_FIX = "a mixture of experts", "pass --num-experts 1 (a dense model) or leave it out"
_FP8 = "FP8 (Transformer Engine's recipe)"
_MATH = "model math"


def _more_than_one_expert(_, a) -> bool:
    return max(a.num_experts) > 1


FLAGS: tuple[Flag, ...] = (
    # Run length and learning-rate schedule, counted as Megatron counts them (jax3d.train.counts).
    _act("--train-samples", "train on this many samples, in whole global batches (instead of --train-iters) "
         "(default: none)", "run length in samples: steps = samples / global batch, the ramp's steps counted one by "
         "one", _RUN, type=int, default=None, metavar="N"),
    _act("--train-tokens", "stop before the first step that would start with this many tokens consumed, as well as "
         "at --train-iters / --train-samples (default: none)", "a second stop, in tokens; the schedule's length stays "
         "that of --train-iters / --train-samples", _RUN, type=int, default=None, metavar="N"),
    _act("--lr-warmup-samples", "linear warm-up over this many samples (runs counted with --train-samples)",
         "warm-up counted in samples", _RUN, type=int, default=0, metavar="N"),
    _act("--lr-decay-samples", "decay over this many samples (default: --train-samples)", "decay counted in samples",
         _RUN, type=int, default=None, metavar="N"),
    _act("--lr-warmup-tokens", "linear warm-up over this many tokens, replacing the warm-up in steps or samples "
         "(default: none)", "warm-up counted in tokens consumed", _RUN, type=int, default=None, metavar="N"),
    _act("--lr-decay-tokens", "decay over this many tokens, replacing the decay in steps or samples (default: none)",
         "decay counted in tokens consumed", _RUN, type=int, default=None, metavar="N"),
    _act("--rampup-batch-size", "grow the global batch from START by INCREMENT over the first SAMPLES samples, up to "
         "--global-batch-size (runs counted with --train-samples) (default: none)", "the batch of each step follows "
         "Megatron's ramp; each size compiles its own step", _RUN, type=int, nargs=3, default=None,
         metavar=("START", "INCREMENT", "SAMPLES")),
    _act("--exit-duration-in-mins", "save a checkpoint and stop, exit 0, before this many minutes of training have "
         "passed (default: none)", "checked after every step: it saves and stops when one more step and a save would "
         "pass the limit", _RUN, type=float, default=None, metavar="MINUTES"),
    _act("--override-opt_param-scheduler", "on resume, take the learning-rate schedule (--lr, --min-lr, warm-up, "
         "decay and style, their defaults included) from the command line, not the checkpoint", "a resumed run's "
         "schedule is the command line's, defaults included", _RUN, **_ON),
    _refused("--optimizer", "adam: AdamW (Megatron's Adam with decoupled weight decay); sgd is not built", _RUN,
             "SGD", "pass --optimizer adam (AdamW)", asks=lambda v, a: v != "adam", when="sgd",
             otherwise="adam is AdamW, jax3d's optimizer", decision=ACT, choices=["adam", "sgd"], default="adam"),
    # Logging.
    _act("--tensorboard-dir", "write TensorBoard events here, with Megatron's choice of scalars (default: --log-dir, "
         "with every metric)", "TensorBoard events go there: losses, rate, loss scale, gradient norm and consumed "
         "samples, and what the --log-*-to-tensorboard flags add", _LOG, default=None, metavar="DIR"),
    _act("--log-timers-to-tensorboard", "write step time, throughput and MFU to TensorBoard",
         "adds step_time_s, tokens_per_s, tflops_per_device, mfu", _LOG, **_ON),
    _act("--log-batch-size-to-tensorboard", "write each step's global batch size to TensorBoard",
         "adds batch_size (it changes under --rampup-batch-size)", _LOG, **_ON),
    _act("--log-validation-ppl-to-tensorboard", "write validation perplexity to TensorBoard", "adds val_ppl", _LOG,
         **_ON),
    _act("--log-optimizer-states-to-tensorboard", "write norms of Adam's moments and of the weights to TensorBoard",
         "adds optimizer/{momentum,variance,variance_sqrt,weight}_{l1,l2,abs_max}, computed at log steps", _LOG, **_ON),
    _act("--log-memory-to-tensorboard", "write peak device memory to TensorBoard", "adds mem_gb", _LOG, **_ON),
    _accepted("--tensorboard-queue-size", "events buffered before a write (default: none, Megatron's is 1000)",
              "events are written and flushed at every log step", _LOG, type=int, default=None, metavar="N"),
    _accepted("--timing-log-level", "Megatron's timer detail (default: none, Megatron's is 0)",
              "XLA runs a step as one program; its time is the step time", _LOG, type=int, choices=[0, 1, 2],
              default=None),
    # DeepSpeed.
    _act("--deepspeed", "run as Megatron-DeepSpeed does under DeepSpeed: --deepspeed_config's JSON sets batch sizes, "
         "ZeRO stage, precision, loss scaling, clipping and Adam's betas and epsilon", "reads --deepspeed_config "
         "(jax3d/cli/deepspeed.py)", _DS, **_ON),
    _act("--deepspeed_config --deepspeed-config", "DeepSpeed's JSON, read with --deepspeed (default: none)",
         "checked against the command line; conflicts stop the run, replaced and unused keys are named in the header",
         _DS, default=None, metavar="FILE", dest="deepspeed_config"),
    _act("--no-pipeline-parallel", "run without DeepSpeed's pipeline engine: --pipeline-model-parallel-size 1",
         "pipeline size 1 (a larger --pipeline-model-parallel-size is refused, as in Megatron)", _DS, **_ON),
    _act("--enable-zbh1-pipeline", "the zero-bubble ZB-H1 pipeline schedule: --pipeline-schedule zb-h1",
         "--pipeline-schedule zb-h1", _DS, **_ON),
    _accepted("--enable-zbh1-exact-semantics", "ZB-H1 with exact optimizer-step semantics", "jax3d's zb-h1 applies the "
              "update after the whole batch's gradients, exact always", _DS, **_ON),
    _accepted("--deepspeed-activation-checkpointing", "DeepSpeed's implementation of activation recompute",
              "recompute is jax.checkpoint, chosen by --checkpoint-activations / --recompute-granularity", _DS, **_ON),
    _accepted("--universal-checkpoint", "load a DeepSpeed universal checkpoint", "every jax3d checkpoint restores onto "
              "any layout; there is no separate universal format", _DS, **_ON),
    _refused("--ds-sequence-parallel-size", "DeepSpeed-Ulysses sequence parallelism over this many devices", _DS,
             "DeepSpeed-Ulysses sequence parallelism", "pass 1 (--sequence-parallel shards activations over tensor "
             "parallelism instead)", asks=lambda v, a: v > 1, when="above 1", otherwise="1 changes nothing",
             type=int, default=1, metavar="N"),
    _refused("--cpu-optimizer", "run the optimizer on the CPU (ZeRO-Offload)", _DS, "the optimizer on the CPU "
             "(ZeRO-Offload)", "drop it (ZeRO stages 1 to 3 shard the optimizer state over the data-parallel devices "
             "instead)", **_ON),
    _refused("--recompute-method", "uniform: recompute the input of every --recompute-num-layers layers; block: only "
             "the first --recompute-num-layers of each stage (default: none)", _DS, "block recompute",
             "pass --recompute-method uniform (jax3d's full recompute)", asks=lambda v, a: v == "block", when="block",
             otherwise="uniform over 1 layer is what jax3d's full recompute does", decision=ACT,
             choices=["uniform", "block"], default=None),
    _refused("--recompute-num-layers", "layers per recompute unit (--recompute-method)", _DS,
             "recompute units of more than one layer", "pass --recompute-num-layers 1 (jax3d's full recompute)",
             asks=lambda v, a: v != 1, when="above 1", otherwise="1 is what jax3d's full recompute does",
             decision=ACT, type=int, default=1, metavar="N"),
    # Data.
    _accepted("--data-impl", "indexed-dataset format (default: none, Megatron's is infer)", "jax3d reads Megatron's "
              "mmap .bin/.idx, the only format; infer finds the same", _DATA, choices=["mmap", "infer"], default=None),
    _accepted("--num-workers", "data-loader worker processes (default: none, Megatron's is 2)", "jax3d's loader "
              "gathers samples from the memory-mapped files in a background thread", _DATA, type=int, default=None,
              metavar="N"),
    _act("--tokenizer-model", "a SentencePiece model (tokenizer.model) for --tokenizer-type GPTSentencePieceTokenizer "
         "(default: none, or the checkpoint's with --load)", "the SentencePiece model, kept and fingerprinted in "
         "checkpoints like the other tokenizer files", _DATA, default="", metavar="FILE"),
    # PyTorch and CUDA switches.
    _accepted("--no-async-tensor-model-parallel-allreduce", "Megatron's overlap of a tensor-parallel all-reduce with "
              "a weight gradient", "XLA schedules the collectives and their overlap itself", _TORCH, **_ON),
    _accepted("--distributed-backend", "torch.distributed's backend (default: none, Megatron's is nccl)",
              "JAX's runtime picks NCCL on GPUs and gloo on CPUs itself", _TORCH,
              choices=["nccl", "gloo", "ccl", "hccl"], default=None),
    _accepted("--no-query-key-layer-scaling", "Megatron's fp16 rescaling of attention scores by the layer number",
              "jax3d takes the attention softmax in fp32, where that rescaling (which leaves the result unchanged) "
              "is never needed", _TORCH, **_ON),
    _accepted("--use-flash-attn --use-flash-attn-v1 --use-flash-attn-v2 --use-flash-attn-triton",
              "FlashAttention kernels", "--attention-impl auto already runs cuDNN's flash attention on GPUs in bf16 "
              "and fp16", _TORCH, **_ON),
    # FP8: jax3d.models.fp8 (the GEMMs) and jax3d.train.fp8 (delayed scaling), on GPUs of compute capability 8.9+.
    _act("--fp8-hybrid", "FP8 GEMMs in the transformer blocks: e4m3 forward, e5m2 gradients (Ada or Hopper GPUs)",
         "QKV, attention-out and MLP GEMMs (SwiGLU's too) in FP8 with per-tensor delayed scaling, both backward "
         "GEMMs too; master weights, optimizer, LM head and attention itself stay as they were", _FP8, **_ON),
    _act("--fp8-e4m3", "FP8 GEMMs in the transformer blocks, e4m3 forward and backward", "as --fp8-hybrid, with "
         "the gradients in e4m3", _FP8, **_ON),
    _act("--fp8-margin", "FP8 scales leave 2**margin of headroom (default: 0)", "scale = amax x 2**margin / the "
         "format's largest value", _FP8, type=int, default=0, metavar="N"),
    _refused("--fp8-interval", "steps between FP8 scale updates (default: 1)", _FP8, "FP8 scales updated less often "
             "than every step", "pass 1 or leave it out (Transformer Engine has dropped the interval too)",
             asks=lambda v, a: v != 1, when="other than 1", otherwise="1: the scales follow every step",
             decision=ACT, type=int, default=1, metavar="N"),
    _act("--fp8-amax-history-len", "steps of amax history kept per FP8 tensor (default: 1)", "the history is part "
         "of the train state and its checkpoints", _FP8, type=int, default=1, metavar="N"),
    _act("--fp8-amax-compute-algo", "the amax a scale comes from: the most recent, or the max of the history "
         "(default: most_recent)", "most_recent or max over the history", _FP8, choices=["most_recent", "max"],
         default="most_recent"),
    _refused("--no-fp8-wgrad", "weight-gradient GEMMs in higher precision under FP8", _FP8, "weight-gradient GEMMs "
             "in bf16 under FP8", "drop it (the weight-gradient GEMMs run in FP8)", action="store_false",
             dest="fp8_wgrad"),
    _accepted("--transformer-impl", "local or transformer_engine layers (default: none, Megatron's is local)",
              "jax3d's layers are one implementation; FP8 comes from --fp8-hybrid / --fp8-e4m3", _FP8,
              choices=["local", "transformer_engine"], default=None),
    # Mixture of experts: refused with more than one expert; with one they change nothing, as in Megatron.
    _refused("--num-experts", "experts per MoE layer, one number or one per layer", _MOE_G, _MOE, _MOE_FIX,
             asks=lambda v, a: max(v) > 1, when="above 1", otherwise="1 is a dense model", type=int, nargs="+",
             default=[1], metavar="N"),
    *(_refused(name, f"MoE: {what}", _MOE_G, _MOE, _MOE_FIX, asks=_more_than_one_expert,
               when="with --num-experts above 1", otherwise="with one expert it changes nothing", **kw)
      for name, what, kw in (
        ("--moe-expert-parallel-size", "devices experts are spread over", {"type": int, "default": 1, "metavar": "N"}),
        ("--moe-loss-coeff", "weight of the load-balancing loss", {"type": float, "default": 0.1}),
        ("--moe-train-capacity-factor", "expert capacity in training", {"type": float, "default": 1.0}),
        ("--moe-eval-capacity-factor", "expert capacity in evaluation", {"type": float, "default": 1.0}),
        ("--moe-min-capacity", "least tokens an expert takes", {"type": int, "default": 4}),
        ("--create-moe-param-group", "a parameter group for the experts", _ON),
        ("--disable-moe-token-dropping", "keep tokens past an expert's capacity", _ON),
        ("--mlp-type", "standard or residual (PR-MoE) experts", {"choices": ["standard", "residual"],
                                                                 "default": "standard"}),
        ("--topk", "experts per token", {"type": int, "default": 1}),
        ("--expert-interval", "layers between MoE layers", {"type": int, "default": 2}))),
    # ---- Optimizer schedules, logged norms and per-split data (issue 54; jax3d.train.optimizer, jax3d.train.step,
    # jax3d.train.inputs): the rows below are one block, and `_schedules_and_splits` maps them.
    _act("--start-weight-decay", "weight decay at the start of a linear or cosine --weight-decay-incr-style "
         "(default: none)", "the schedule's start value", _RUN, type=float, default=None, metavar="WD"),
    _act("--end-weight-decay", "weight decay at the end of the run under a linear or cosine "
         "--weight-decay-incr-style (default: none)", "the schedule's end value", _RUN, type=float, default=None,
         metavar="WD"),
    _act("--weight-decay-incr-style", "constant: --weight-decay throughout; linear or cosine: from "
         "--start-weight-decay to --end-weight-decay over the run's iterations (or samples) (default: constant)",
         "AdamW's decoupled decay follows Megatron's schedule over --train-iters (--train-samples); a resumed run "
         "keeps its checkpoint's length", _RUN, choices=["constant", "linear", "cosine"], default="constant"),
    _act("--lr-warmup-fraction", "warm up over this share of the decay (--lr-decay-iters or -samples), instead of "
         "--lr-warmup-iters / --lr-warmup-samples (default: none)", "warm-up = fraction x the decay's iterations "
         "or samples, which may end between two steps as in Megatron", _RUN, type=float, default=None, metavar="F"),
    _act("--log-params-norm", "log the L2 norm of all parameters after each update", "adds params_norm (fp32 "
         "master weights, computed in the train step only when asked)", _LOG, **_ON),
    _act("--log-num-zeros-in-grad", "log how many gradient entries are exactly zero", "adds num_zeros_in_grad "
         "(of the unscaled gradients; Megatron counts after clipping, which scales every entry by one positive "
         "factor; computed in the train step only when asked)", _LOG, **_ON),
    *(_act(f"--{which}-data-path", f"the {what} dataset, read whole: a prefix, or weights and prefixes 0.3 A 0.7 B, "
           f"instead of --data-path and --split (default: none)", f"{use}; checkpoints record it by fingerprint as "
           "they do --data-path", _DATA, nargs="+", default=None, metavar="PATH")
      for which, what, use in (("train", "training", "the run trains on it"),
                               ("valid", "validation", "validation reads it"),
                               ("test", "test", "launch/evaluate.py --split-name test reads it"))),
    # Model math: flags that change what a GPT, BERT or Llama computes, each onto a ModelConfig field (_model_math).
    _act("--kv-channels", "each attention head's query/key/value width (default: --hidden-size / "
         "--num-attention-heads)", "q, k and v project to heads x kv-channels, the output projection from it "
         "(ModelConfig.kv_channels)", _MATH, type=int, default=None, metavar="N"),
    _act("--openai-gelu", "the tanh approximation of GELU (OpenAI's) in the MLP and BERT's head", "activation "
         "gelu_tanh, which is also jax3d's default for GPT and BERT presets (Megatron's default is the erf GELU)",
         _MATH, **_ON),
    _act("--squared-relu", "relu(x)^2 as the MLP's activation instead of GELU", "activation squared_relu; with "
         "--swiglu or --openai-gelu, which set the activation too, the run stops", _MATH, **_ON),
    _act("--apply-layernorm-1p", "store the layer norms' scales as offsets from 1, initialised to 0 (weight decay "
         "pulls them towards 1)", "the blocks' and the final layer norm compute with 1 + w; RMSNorm, and BERT's head "
         "norm, keep a plain scale as in Megatron-DeepSpeed; HF export writes 1 + w", _MATH, **_ON),
    _act("--eod-mask-loss", "no loss on predictions made from an end-of-document token (GPT)", "loss weight 0 where "
         "the input token is the tokenizer's end-of-document token", _MATH, **_ON),
    _act("--reset-position-ids", "learned positions restart at 0 after each end-of-document token (GPT)",
         "learned positions counted within each document; rotary positions are not reset, as in Megatron-DeepSpeed",
         _MATH, **_ON),
    _act("--reset-attention-mask", "no attention across an end-of-document token inside a sample (GPT)",
         "a document mask: each token attends only to earlier tokens of its own document", _MATH, **_ON),
)


def add_megatron_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the table's flags to the train parser, in one group per concern. A row whose flag the parser already
    has (jax3d built it since) is left out, and so are its decisions: `rows(args)` lists the rows in use."""
    groups, used = {}, []
    for f in FLAGS:
        if any(n in parser._option_string_actions for n in f.names):
            continue
        used.append(f.dest)
        if f.group not in groups:
            groups[f.group] = parser.add_argument_group(f"Megatron-DeepSpeed: {f.group} (docs/megatron-deepspeed.md)")
        tag = {ACT: "", ACCEPTED: " [accepted; changes nothing in jax3d]",
               REFUSED: f" [{'refused' if f.when == 'given' else f.when + ': refused'}: jax3d does not build it]"}[f.decision]
        groups[f.group].add_argument(*f.names, help=f.help + tag, **f.kw)
    parser.set_defaults(megatron_rows=tuple(used))


def rows(a) -> list[Flag]:
    """The table's rows whose flags the parsed command line `a` has."""
    return [f for f in FLAGS if f.dest in a.megatron_rows]


def _given(f: Flag, a) -> bool:
    """Whether flag `f` was set to anything but its default."""
    return getattr(a, f.dest) != f.kw.get("default", True if f.kw.get("action") == "store_false" else
                                         False if f.kw.get("action") == "store_true" else None)


def _asks(f: Flag, a) -> bool:
    """Whether `f` is given and its value asks for what its row is about (a REFUSED or ACCEPTED row), or for a
    value an ACT row refuses."""
    if f.decision == ACT and f.asks is None:
        return False
    return _given(f, a) and (f.asks is None or f.asks(getattr(a, f.dest), a))


def _shown(f: Flag, a) -> str:
    v = getattr(a, f.dest)
    return f.names[0] if f.kw.get("action") in ("store_true", "store_false") else \
        f"{f.names[0]} {' '.join(map(str, v)) if isinstance(v, list) else v}"


def refuse_features(a) -> None:
    """ConfigError, one sentence, when a flag asks for a feature jax3d does not build (the first such flag)."""
    asked = [f for f in rows(a) if f.decision != ACCEPTED and _asks(f, a)]
    for f in asked:
        raise ConfigError(f"{_shown(f, a)} asks for {f.feature}, which jax3d does not build; {f.fix}")


def megatron_config(a, cfg: Config) -> Config:
    """`cfg` with the table's flags applied; ConfigError, one sentence, for a refused feature or a combination
    Megatron refuses. `header_notes` says what the run header prints about them."""
    return _translate(a, cfg)[0]


def header_notes(a, cfg: Config) -> list[str]:
    """The run header's lines on the table's flags: each accepted flag that changes nothing here, with why, and
    what --deepspeed_config set, replaced and left unused."""
    return _translate(a, cfg)[1]


def _translate(a, cfg: Config) -> tuple[Config, list[str]]:
    refuse_features(a)
    _refuse_combinations(a)
    notes = [f"{_shown(f, a)} changes nothing here: {f.what}" for f in rows(a)
             if f.decision == ACCEPTED and _asks(f, a)]
    notes += [f"{_shown(f, a)} changes nothing here: it sets up experts, and each layer has one (--num-experts 1)"
              for f in rows(a) if f.group == _MOE_G and _given(f, a) and not _asks(f, a) and f.dest != "num_experts"]
    if a.deepspeed_config and not a.deepspeed:
        notes.append(f"--deepspeed_config {a.deepspeed_config} is read only with --deepspeed, as in "
                     "Megatron-DeepSpeed; this run does without it")
    elif a.deepspeed:
        if not a.deepspeed_config:
            raise ConfigError("--deepspeed reads its settings from --deepspeed_config FILE, which is not given; "
                              "add it or drop --deepspeed")
        cfg, ds_notes = apply_deepspeed_json(read_deepspeed_json(a.deepspeed_config), a, cfg)
        notes += ds_notes
    cfg = _schedules_and_splits(a, _counted(a, cfg))
    par = {}
    if a.no_pipeline_parallel:
        par["pipeline_parallel"] = 1
    if a.enable_zbh1_pipeline:
        par["pipeline_schedule"] = "zb-h1"
    logs = tuple(k for k in ("timers", "batch_size", "validation_ppl", "optimizer_states", "memory")
                 if getattr(a, f"log_{k}_to_tensorboard"))
    cfg = cfg.replace(precision={"fp8": "hybrid" if a.fp8_hybrid else "e4m3" if a.fp8_e4m3 else "",
                                 "fp8_margin": a.fp8_margin, "fp8_interval": a.fp8_interval,
                                 "fp8_amax_history_len": a.fp8_amax_history_len,
                                 "fp8_amax_compute_algo": a.fp8_amax_compute_algo})
    cfg, math_notes = _model_math(a, cfg)
    notes += math_notes
    cfg = cfg.replace(parallel=par, data={"tokenizer_model": a.tokenizer_model},
                      train={"exit_duration_in_mins": a.exit_duration_in_mins or 0.0,
                             "tensorboard_dir": a.tensorboard_dir or "", "tensorboard_log": logs})
    return cfg, [f"jax3d: {n}" for n in notes]


def _refuse_combinations(a) -> None:
    """What Megatron's argument checks refuse, each as one sentence."""
    if a.train_samples is not None and a.train_iters is not None:
        raise ConfigError("--train-iters and --train-samples both set the run's length; pass one (Megatron refuses "
                          "both too)")
    if a.train_samples is not None:
        for flag, v in (("--lr-warmup-iters", a.lr_warmup_iters), ("--lr-decay-iters", a.lr_decay_iters)):
            if v:
                raise ConfigError(f"{flag} {v} counts steps and this run is counted in samples (--train-samples); "
                                  f"pass {flag.replace('iters', 'samples')} instead")
    else:
        for flag, v in (("--lr-warmup-samples", a.lr_warmup_samples), ("--lr-decay-samples", a.lr_decay_samples),
                        ("--rampup-batch-size", a.rampup_batch_size)):
            if v:
                raise ConfigError(f"{flag} {' '.join(map(str, v)) if isinstance(v, list) else v} needs a run counted "
                                  "in samples; pass --train-samples instead of --train-iters, as Megatron asks")
    if a.fp8_hybrid and a.fp8_e4m3:
        raise ConfigError("--fp8-hybrid and --fp8-e4m3 ask for two FP8 formats; pass one (Megatron refuses both too)")
    if a.no_pipeline_parallel and (a.pipeline_model_parallel_size or 1) > 1:
        raise ConfigError(f"--no-pipeline-parallel and --pipeline-model-parallel-size "
                          f"{a.pipeline_model_parallel_size} disagree; drop one")
    if a.enable_zbh1_pipeline and a.pipeline_schedule not in (None, "zb-h1"):
        raise ConfigError(f"--enable-zbh1-pipeline and --pipeline-schedule {a.pipeline_schedule} disagree; drop one")
    if a.enable_zbh1_exact_semantics and not a.enable_zbh1_pipeline:
        raise ConfigError("--enable-zbh1-exact-semantics refines --enable-zbh1-pipeline, which is not given; add "
                          "it or drop --enable-zbh1-exact-semantics")
    for flag, v in (("--train-samples", a.train_samples), ("--train-tokens", a.train_tokens),
                    ("--lr-warmup-samples", a.lr_warmup_samples), ("--lr-decay-samples", a.lr_decay_samples),
                    ("--lr-warmup-tokens", a.lr_warmup_tokens), ("--lr-decay-tokens", a.lr_decay_tokens),
                    ("--exit-duration-in-mins", a.exit_duration_in_mins)):
        if v is not None and v < 0:
            raise ConfigError(f"{flag} {v} must not be negative")


def _schedules_and_splits(a, cfg: Config) -> Config:
    """The weight-decay schedule, the fractional warm-up, the logged norms and the per-split datasets, after
    Megatron's checks on them (each one sentence)."""
    if a.weight_decay_incr_style == "constant":
        given = [f for f, v in (("--start-weight-decay", a.start_weight_decay),
                                ("--end-weight-decay", a.end_weight_decay)) if v is not None]
        if given:
            raise ConfigError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} a weight-decay schedule, and --weight-decay-incr-style is "
                              "constant (--weight-decay throughout); add --weight-decay-incr-style linear or cosine, "
                              "or drop them (Megatron refuses them too)")
        wd = {}
    else:
        if a.start_weight_decay is None or a.end_weight_decay is None:
            raise ConfigError(f"--weight-decay-incr-style {a.weight_decay_incr_style} needs both "
                              "--start-weight-decay and --end-weight-decay; add them (Megatron asks for both)")
        wd = {"weight_decay_incr_style": a.weight_decay_incr_style, "start_weight_decay": a.start_weight_decay,
              "end_weight_decay": a.end_weight_decay, "weight_decay_incr_samples": a.train_samples or 0}
    if a.lr_warmup_fraction is not None:
        for flag, v in (("--lr-warmup-iters", a.lr_warmup_iters), ("--lr-warmup-samples", a.lr_warmup_samples)):
            if v:
                raise ConfigError(f"--lr-warmup-fraction {a.lr_warmup_fraction} and {flag} {v} both set the warm-up; "
                                  "pass one (Megatron refuses both too)")
        if not 0 <= a.lr_warmup_fraction < 1:
            raise ConfigError(f"--lr-warmup-fraction {a.lr_warmup_fraction} must be at least 0 and below 1 (a share "
                              "of the decay)")
        wd["lr_warmup_fraction"] = a.lr_warmup_fraction
    split = {f"{k}_data_path": tuple(getattr(a, f"{k}_data_path") or ()) for k in ("train", "valid", "test")}
    given = [f"--{k.replace('_', '-')}" for k, v in split.items() if v]
    if given and a.data_path:
        raise ConfigError(f"--data-path and {' / '.join(given)} both name the data; pass --data-path (with --split) "
                          "or a dataset per split (Megatron keeps them exclusive too)")
    if given and not split["train_data_path"]:
        raise ConfigError(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} --train-data-path to train "
                          "on; add it, or pass --data-path with --split")
    cfg = cfg.replace(optim=wd, data=split, train={"log_params_norm": a.log_params_norm,
                                                   "log_num_zeros_in_grad": a.log_num_zeros_in_grad})
    from jax3d.train.optimizer import weight_decay_schedule
    weight_decay_schedule(cfg.optim, cfg.train.train_iters)  # its values' checks, said before anything compiles
    return cfg
def _model_math(a, cfg: Config) -> tuple[Config, list[str]]:
    """`cfg` with the model-math rows' fields, and the header's notes on them. Fields a flag does not give keep
    the preset's (or, with --load, the checkpoint's)."""
    if a.squared_relu and (a.swiglu or a.openai_gelu):
        other = "--swiglu" if a.swiglu else "--openai-gelu"
        raise ConfigError(f"--squared-relu and {other} each set the MLP's activation; pass one of them")
    if a.openai_gelu and (a.swiglu or (a.swiglu is None and cfg.model.swiglu)):
        raise ConfigError("--openai-gelu sets a GELU MLP and this model's is SwiGLU (--swiglu or its preset); "
                          "drop --openai-gelu or pick a GELU preset")
    model = {k: True for k in ("apply_layernorm_1p", "eod_mask_loss", "reset_position_ids", "reset_attention_mask")
             if getattr(a, k)}
    if a.kv_channels is not None:
        if a.kv_channels < 1:
            raise ConfigError(f"--kv-channels {a.kv_channels} must be at least 1 (leave it out for --hidden-size / "
                              "--num-attention-heads)")
        model["kv_channels"] = a.kv_channels
    if a.openai_gelu or a.squared_relu:
        model["activation"] = "squared_relu" if a.squared_relu else "gelu_tanh"
    notes = []
    if a.apply_layernorm_1p and cfg.model.normalization == "rmsnorm":
        notes.append("--apply-layernorm-1p changes nothing with --normalization rmsnorm: Megatron-DeepSpeed's RMSNorm "
                     "keeps a plain scale, and so does jax3d's")
    return cfg.replace(model=model), notes


def _counted(a, cfg: Config) -> Config:
    """The run counted in samples and tokens (jax3d.train.counts): Megatron decays a sample-counted run over its
    --train-samples unless --lr-decay-samples says otherwise."""
    from jax3d.train.counts import settle

    cfg = cfg.replace(
        train={"train_samples": a.train_samples or 0, "train_tokens": a.train_tokens or 0,
               "rampup_batch_size": tuple(a.rampup_batch_size or ())},
        optim={"lr_warmup_samples": a.lr_warmup_samples, "lr_warmup_tokens": a.lr_warmup_tokens or 0,
               "lr_decay_samples": a.lr_decay_samples or a.train_samples or 0, "lr_decay_tokens": a.lr_decay_tokens or 0})
    return settle(cfg)


def after_plan(a, cfg: Config, data_parallel: int) -> Config:
    """`cfg` settled on the run's final batch and sequence sizes (a resumed run may take its checkpoint's), with
    DeepSpeed's batch rule checked against the data-parallel size."""
    from jax3d.train.counts import settle

    if a.deepspeed and a.deepspeed_config:
        check_accumulation(read_deepspeed_json(a.deepspeed_config), cfg, data_parallel)
    return settle(cfg, data_parallel)


_SCHEDULE_DESTS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_warmup_samples",
                   "lr_decay_samples", "lr_warmup_tokens", "lr_decay_tokens", "lr_warmup_fraction", "weight_decay",
                   "weight_decay_incr_style", "start_weight_decay", "end_weight_decay", "weight_decay_incr_iters",
                   "weight_decay_incr_samples")


def implied_given(ns: argparse.Namespace) -> set[str]:
    """Dests a command line sets without naming them (`ns` holds only the flags given): the whole schedule under
    --override-opt_param-scheduler, and what --deepspeed_config's JSON sets under --deepspeed. A resumed run keeps
    these from the command line, not from its checkpoint (`counted_batch` too, which the run's own batch and
    sequence sizes give)."""
    out = {"counted_batch"} | (set(_SCHEDULE_DESTS) if getattr(ns, "override_opt_param_scheduler", False) else set())
    if getattr(ns, "deepspeed", False) and getattr(ns, "deepspeed_config", None):
        out |= deepspeed_dests(read_deepspeed_json(ns.deepspeed_config))
    return out


def doc_table() -> str:
    """The Markdown table of docs/megatron-deepspeed.md: every flag of the table, its decision and what jax3d does."""
    rows = ["| flag | decision | what jax3d does |", "|---|---|---|"]
    for group in dict.fromkeys(f.group for f in FLAGS):
        for f in (f for f in FLAGS if f.group == group):
            names = " ".join(f"`{n}`" for n in f.names)
            refused = f"{f.when}: stops the run (exit 2), {f.feature} is not built"
            what = {ACT: f.what + (f"; {refused}" if f.feature else ""), ACCEPTED: f"accepted, changes nothing: {f.what}",
                    REFUSED: refused + (f"; {f.what}" if f.what else "")}[f.decision]
            rows.append(f"| {names} | {f.decision} | {what} |")
    return "\n".join(rows) + "\n"


_DOC = "docs/megatron-deepspeed.md"
_BEGIN, _END = "<!-- the table: python -m jax3d.cli.megatron writes it -->\n", "<!-- end of the table -->\n"


def write_doc(path: str = _DOC) -> None:
    """Writes `doc_table()` into `path` between its two table markers."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split(_BEGIN, 1)
    with open(path, "w") as f:
        f.write(head + _BEGIN + doc_table() + _END + rest.split(_END, 1)[1])


if __name__ == "__main__":
    write_doc()
