"""The table of Megatron-DeepSpeed's flags that jax3d's own train flags don't already cover: one row per
`add_argument` of Megatron-DeepSpeed's megatron/arguments.py (aliases in one row), each with its decision.
jax3d.cli.megatron puts the rows on the train parser and applies them; tests/cli/test_megatron_flags.py checks that
every flag upstream has a decision here or is one of train.py's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

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
_RUN, _LOG, _DS, _DATA, _TORCH, MOE_GROUP = (
    "run length and schedule", "logging", "DeepSpeed", "data", "PyTorch and CUDA switches", "mixture of experts")
_MOE, _MOE_FIX = "a mixture of experts", "pass --num-experts 1 (a dense model) or leave it out"
_FP8 = "FP8 (Transformer Engine's recipe)"
_MATH = "model math"
_MODEL, _CKPT, _PAR, _INFER = ("model shape and numerics", "checkpoints and resuming",
                               "parallel layout, communication and memory", "inference")
_RETRO, _ICT, _VISION, _KD = ("RETRO", "ICT, biencoder and REALM", "vision (ViT, Swin, DINO, inpainting)",
                              "knowledge distillation")
_T5 = "an encoder-decoder model (T5)"
_XLA_FUSES = "XLA decides which operations to fuse, in every step it compiles"
_XLA_COMMS = "XLA's SPMD partitioner chooses and schedules the collectives the shardings need"
_SCHEDULE = "the learning-rate schedule"


def _more_than_one_expert(_, a) -> bool:
    return max(a.num_experts) > 1


def _family(feature, fix, group, flags) -> tuple[Flag, ...]:
    """REFUSED rows for the flags of one feature, each (name, help, argparse keywords): a flag left at Megatron's
    default, or given that default, asks for nothing and is accepted."""
    rows = []
    for name, help, kw in flags:
        default = kw.get("default")
        if default in (None, []) or kw.get("action"):
            rows.append(_refused(name, help, group, feature, fix, **kw))
        else:
            shown = " ".join(map(str, default)) if isinstance(default, list) else default
            rows.append(_refused(name, help, group, feature, fix, when=f"other than {shown}",
                                 otherwise=f"{shown}, Megatron's default, asks for nothing", **kw))
    return tuple(rows)


def _int(default, metavar="N"):
    return {"type": int, "default": default, "metavar": metavar}


def _float(default):
    return {"type": float, "default": default}


def _path():
    return {"default": None, "metavar": "PATH"}


FLAGS: tuple[Flag, ...] = (
    # Run length and learning-rate schedule, counted as Megatron counts them (jax3d.counts).
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
    *(_accepted(name, help, _XLA_FUSES, _TORCH, action="store_false", dest=dest) for name, help, dest in (
        ("--no-masked-softmax-fusion", "no fused scale, mask and softmax kernel", "masked_softmax_fusion"),
        ("--no-bias-gelu-fusion", "no fused bias and GELU kernel", "bias_gelu_fusion"),
        ("--no-bias-dropout-fusion", "no fused bias, dropout and residual kernel", "bias_dropout_fusion"))),
    _accepted("--distributed-backend", "torch.distributed's backend (default: none, Megatron's is nccl)",
              "JAX's runtime picks NCCL on GPUs and gloo on CPUs itself", _TORCH,
              choices=["nccl", "gloo", "ccl", "hccl"], default=None),
    _accepted("--no-query-key-layer-scaling", "Megatron's fp16 rescaling of attention scores by the layer number",
              "jax3d takes the attention softmax in fp32, where that rescaling (which leaves the result unchanged) "
              "is never needed", _TORCH, **_ON),
    _accepted("--use-flash-attn --use-flash-attn-v1 --use-flash-attn-v2 --use-flash-attn-triton "
              "--use-flash-attn-builder",
              "FlashAttention kernels", "--attention-impl auto already runs cuDNN's flash attention on GPUs in bf16 "
              "and fp16", _TORCH, **_ON),
    # FP8: jax3d.models.fp8 (the GEMMs) and jax3d.parallel.precision.Recipe (delayed scaling), on GPUs of compute capability 8.9+.
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
    _refused("--num-experts", "experts per MoE layer, one number or one per layer", MOE_GROUP, _MOE, _MOE_FIX,
             asks=lambda v, a: max(v) > 1, when="above 1", otherwise="1 is a dense model", type=int, nargs="+",
             default=[1], metavar="N"),
    _refused("--num-experts-switch", "experts of a Switch Transformer layer (default: none)", MOE_GROUP, _MOE,
             "leave it out (a dense model)", asks=lambda v, a: v > 1, when="above 1", otherwise="1 is a dense model",
             type=int, default=None, metavar="N"),
    *(_refused(name, f"MoE: {what}", MOE_GROUP, _MOE, _MOE_FIX, asks=_more_than_one_expert,
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
        ("--expert-interval", "layers between MoE layers", {"type": int, "default": 2}),
        ("--enable-expert-tensor-parallelism", "tensor parallelism inside the experts", _ON),
        ("--disable-moe-top2-2nd-expert-sampling", "top-2 gating takes the second expert by argmax",
         {"action": "store_false", "dest": "moe_top2_2nd_expert_sampling"}),
        ("--use-tutel", "Tutel's MoE kernels", _ON))),
    # Model shape and numerics.
    _act("--encoder-num-layers", "Megatron's other name for --num-layers (default: none)", "sets --num-layers; both "
         "at once are refused, as in Megatron", _MODEL, type=int, default=None, metavar="N"),
    _act("--encoder-seq-length", "Megatron's other name for --seq-length (default: none)", "sets --seq-length; both "
         "at once are refused, as in Megatron", _MODEL, type=int, default=None, metavar="N"),
    *_family(_T5, "drop it (jax3d builds GPT, Llama and BERT, which have no decoder stack)", _MODEL, (
        ("--decoder-num-layers", "T5: decoder layers (default: none)", _int(None)),
        ("--decoder-seq-length", "T5: decoder sequence length (default: none)", _int(None)),
        ("--vocab-extra-ids", "T5: sentinel tokens added to the vocabulary", _int(0)),
        ("--pipeline-model-parallel-split-rank", "T5: the pipeline rank where the decoder starts (default: none)",
         _int(None)))),
    _refused("--apply-residual-connection-post-layernorm", "the original BERT's ordering: the residual taken after "
             "the layer norm", _MODEL, "the post-layer-norm residual ordering", "drop it (jax3d's blocks are "
             "pre-layer-norm, as Megatron's default)", **_ON),
    _refused("--fp32-residual-connection", "keep the residual stream in fp32 under --bf16 / --fp16", _MODEL,
             "an fp32 residual stream under bf16 or fp16", "drop it (the residual stream is in the compute dtype)",
             **_ON),
    _refused("--fp16-lm-cross-entropy", "the LM head's cross entropy in fp16", _MODEL, "the cross entropy in fp16",
             "drop it (jax3d sums the loss in fp32)", **_ON),
    _refused("--init-method-xavier-uniform", "Xavier-uniform weight init instead of the normal one", _MODEL,
             "Xavier-uniform weight init", "drop it (weights are drawn from a normal of --init-method-std)", **_ON),
    _refused("--bert-no-binary-head", "BERT without its sentence-order head", _MODEL, "BERT without its binary "
             "(sentence-order) head", "drop it (jax3d's BERT trains both heads, as Megatron's default)",
             action="store_false", dest="bert_binary_head"),
    _accepted("--attention-softmax-in-fp32", "attention masking and softmax in fp32", "jax3d always takes the "
              "attention softmax in fp32", _MODEL, **_ON),
    _accepted("--accumulate-allreduce-grads-in-fp32", "accumulate and all-reduce gradients in fp32", "gradients are "
              "taken of the fp32 master weights, so they are accumulated and reduced in fp32 already", _MODEL, **_ON),
    _accepted("--embedding-weights-in-fp32", "look the word embeddings up in fp32", "the embedding's master copy "
              "is fp32; a lookup only selects its rows, which the step casts to the compute dtype", _MODEL, **_ON),
    _accepted("--disable-mem-efficient-ln", "apex's fused layer norm without its memory-efficient variant",
              "jax3d's layer norm is its own (a Pallas kernel on GPUs, XLA elsewhere)", _MODEL,
              action="store_false", dest="mem_efficient_ln"),
    _accepted("--no-persist-layer-norm", "apex's layer norm without its persistent kernel", "jax3d's layer norm "
              "is its own (a Pallas kernel on GPUs, XLA elsewhere)", _MODEL, **_ON),
    _accepted("--onnx-safe", "workarounds for PyTorch's ONNX exporter (default: none)", "jax3d exports no ONNX",
              _MODEL, default=None, metavar="BOOL"),
    _accepted("--use-cpu-initialization", "compute the initial weights on the CPU", "jax3d draws the initial "
              "weights already sharded on the devices, from --seed alone", _MODEL, **_ON),
    _refused("--data-parallel-random-init", "different initial weights on each data-parallel replica", _MODEL,
             "different initial weights on each data-parallel replica", "drop it (the weights are one array, "
             "replicated or sharded over data parallelism)", **_ON),
    # Run length, stopping and the schedule.
    _refused("--batch-size", "Megatron's retired name for --micro-batch-size (default: none)", _RUN,
             "Megatron's retired --batch-size", "pass --micro-batch-size (Megatron-DeepSpeed refuses --batch-size "
             "too)", **_int(None)),
    _refused("--warmup", "Megatron's retired warm-up flag (default: none)", _RUN, "Megatron's retired --warmup",
             "pass --lr-warmup-iters or --lr-warmup-samples (Megatron-DeepSpeed refuses --warmup too)",
             **_int(None)),
    _act("--exit-signal-handler", "on SIGTERM, save a checkpoint to --save and stop", "jax3d does this on every run "
         "with --save (SIGINT too); without --save there is nothing to save to, so the flag is refused", _RUN,
         **_ON),
    _act("--kill-switch-file", "stop the run, without a save, once this file exists (default: none)", "checked "
         "before each step, as Megatron does; the run stops at once, exit 0, and what it saved before stays",
         _RUN, **_path()),
    _refused("--skip-train", "evaluate a checkpoint without training", _RUN, "evaluation without training in the "
             "train command", "run launch/evaluate.py --load CHECKPOINT instead", **_ON),
    _refused("--random-ltd", "random layer-token drop (random-LTD)", _RUN, "random layer-token drop (random-LTD)",
             "drop it", **_ON),
    _refused("--adlr-autoresume", "NVIDIA's ADLR cluster autoresume", _RUN, "NVIDIA's ADLR cluster autoresume",
             "drop it (jax3d saves a checkpoint and stops on SIGTERM, and --load resumes)", **_ON),
    _accepted("--adlr-autoresume-interval", "steps between ADLR autoresume checks (default: none, Megatron's is "
              "1000)", "read only with --adlr-autoresume, which is refused", _RUN, **_int(None)),
    _refused("--sgd-momentum", "SGD's momentum (default: 0.9)", _RUN, "SGD", "drop it (jax3d's optimizer is AdamW)",
             asks=lambda v, a: a.optimizer == "sgd", when="with --optimizer sgd",
             otherwise="read only by --optimizer sgd, which is refused", type=float, default=0.9),
    _act("--use-checkpoint-opt_param-scheduler", "on resume, take the learning-rate schedule from the checkpoint, "
         "whatever the command line says", "a resumed run's schedule (--lr, --min-lr, warm-up, decay and style) is "
         "the checkpoint's even where flags set it", _RUN, **_ON),
    # Checkpoints and resuming.
    _act("--no-load-lr-state", "on resume, take the learning-rate schedule from the command line, not the "
         "checkpoint", "as --override-opt_param-scheduler (Megatron-DeepSpeed parses it and reads it nowhere; "
         "jax3d does what its help says)", _CKPT, **_ON),
    _act("--use-checkpoint-args", "take the model's shape and architecture from --load's checkpoint",
         "jax3d does this on every --load: the checkpoint's model, tokenizer and run settings, except what a flag "
         "sets (a shape flag must match); without --load it is refused, as in Megatron", _CKPT, **_ON),
    _act("--load-tag", "the checkpoint to load, as DeepSpeed names it: global_stepN, or N (default: the latest)",
         "sets --ckpt-step N", _CKPT, default=None, metavar="TAG"),
    _act("--exit-on-missing-checkpoint", "stop when --load holds no checkpoint, rather than start from random "
         "weights", "one sentence and exit 2 when --load holds no checkpoint", _CKPT, **_ON),
    _accepted("--no-initialization", "skip initialising weights that --load replaces", "a run that restores a "
              "checkpoint does not initialise the weights first", _CKPT, action="store_false",
              dest="perform_initialization"),
    _refused("--reset-iteration", "restart a loaded run's step count at 0, keeping its optimizer state", _CKPT,
             "a resumed run restarted at step 0 with the checkpoint's optimizer state", "pass --finetune (step 0, "
             "a fresh optimizer)", **_ON),
    # Parallel layout, communication and memory.
    _act("--use-distributed-optimizer", "shard the optimizer state over data parallelism (Megatron's distributed "
         "optimizer)", "ZeRO-1 where neither --zero-stage nor --deepspeed_config sets a stage; with a stage of 1 to "
         "3 the optimizer state is sharded already, and with stage 0 the two disagree and the run stops", _PAR,
         **_ON),
    _act("--recompute-activations", "Megatron's switch for --recompute-granularity selective", "--recompute "
         "selective (attention recomputed in the backward pass); another recompute flag asking for full stops the run",
         _PAR, **_ON),
    _refused("--model-parallel-size", "Megatron's retired name for --tensor-model-parallel-size (default: none)",
             _PAR, "Megatron's retired --model-parallel-size", "pass --tensor-model-parallel-size "
             "(Megatron-DeepSpeed refuses --model-parallel-size too)", **_int(None)),
    _refused("--standalone-embedding-stage", "the input embedding on a pipeline stage of its own", _PAR,
             "a pipeline stage holding only the input embedding", "drop it (--pipeline-model-parallel-layout gives "
             "the first stage fewer layers instead)", **_ON),
    _refused("--DDP-impl", "Megatron's data-parallel implementation (default: local)", _PAR, "PyTorch FSDP",
             "pass --zero-stage 3 (parameters, gradients and optimizer state sharded over data parallelism)",
             asks=lambda v, a: v == "FSDP", when="FSDP", otherwise="local and torch change nothing: "
             + _XLA_COMMS, choices=["local", "torch", "FSDP"], default="local"),
    *(_accepted(name, help, why, _PAR, **kw) for name, help, why, kw in (
        ("--no-contiguous-buffers-in-local-ddp", "no contiguous gradient buffer in Megatron's DDP",
         "XLA allocates the gradients' buffers",
         {"action": "store_false", "dest": "use_contiguous_buffers_in_local_ddp"}),
        ("--no-gradient-accumulation-fusion", "no fused weight-gradient accumulation in the linear layers",
         _XLA_FUSES, {"action": "store_false", "dest": "gradient_accumulation_fusion"}),
        ("--overlap-p2p-communication", "overlap the pipeline's sends and receives with compute",
         "XLA schedules the pipeline's transfers beside the compute",
         {"action": "store_true", "dest": "overlap_p2p_comm"}),
        ("--no-scatter-gather-tensors-in-pipeline", "no scatter/gather of activations sent between stages",
         _XLA_COMMS, {"action": "store_false", "dest": "scatter_gather_tensors_in_pipeline"}),
        ("--use-ring-exchange-p2p", "a custom ring exchange for the pipeline's sends and receives", _XLA_COMMS, _ON),
        ("--distributed-timeout-minutes", "torch.distributed's collective timeout (default: none, Megatron's is 10)",
         "JAX's runtime has its own timeouts", _int(None, "MINUTES")),
        ("--local-rank --local_rank", "the local rank torch's launchers pass (default: none)", "a JAX process finds "
         "its devices itself; several processes take --process-id (or their cluster's environment)",
         {**_int(None), "dest": "local_rank"}),
        ("--lazy-mpu-init", "leave the process groups to an outside data-parallel manager (default: none)",
         "JAX sets up its runtime itself (jax.distributed)", {"default": None, "metavar": "BOOL"}),
        ("--empty-unused-memory-level", "call torch.cuda.empty_cache() after steps (default: none, Megatron's is 0)",
         "XLA's allocator keeps its pool; there is no cache to empty", {"type": int, "choices": [0, 1, 2],
                                                                        "default": None}),
        ("--distribute-saved-activations", "spread recomputed layers' saved inputs over tensor parallelism",
         "XLA places saved activations by their sharding (over tensor parallelism with --sequence-parallel)", _ON),
        ("--distribute-checkpointed-activations", "spread checkpointed activations over tensor parallelism",
         "XLA places saved activations by their sharding (over tensor parallelism with --sequence-parallel)", _ON),
        ("--partition-activations", "DeepSpeed: partition checkpointed activations over tensor parallelism",
         "XLA places saved activations by their sharding (over tensor parallelism with --sequence-parallel)", _ON),
        ("--contigious-checkpointing", "DeepSpeed: checkpointed activations in one contiguous buffer",
         "XLA allocates the activations' buffers", _ON),
        ("--synchronize-each-layer", "DeepSpeed: a CUDA synchronize around each checkpointed layer",
         "XLA runs the whole step as one program", _ON),
        ("--profile-backward", "DeepSpeed: time the backward pass of checkpointed layers", "--profile traces "
         "every operation of the chosen steps", _ON),
        ("--scattered-embeddings", "DeepSpeed: scatter the embedding's activations", "Megatron-DeepSpeed reads it "
         "nowhere; jax3d shards activations by their logical axes", _ON),
        ("--split-transformers", "DeepSpeed: checkpoint each layer in two parts", "recompute is chosen by "
         "--recompute-granularity (selective recomputes the attention part)", _ON),
        ("--zero-reduce-scatter", "ZeRO: reduce-scatter gradients", _XLA_COMMS, _ON),
        ("--zero-contigious-gradients", "ZeRO: gradients in one contiguous buffer", "XLA allocates the gradients' "
         "buffers", _ON),
        ("--zero-reduce-bucket-size", "ZeRO: elements reduced at a time (default: none)", _XLA_COMMS, _int(None)),
        ("--zero-allgather-bucket-size", "ZeRO: elements gathered at a time (default: none)", _XLA_COMMS,
         _int(None)),
        ("--use-pin-memory", "ZeRO-3: pinned CPU memory for parameters initialised there", "read only with "
         "--remote-device cpu, which is refused", _ON))),
    _refused("--checkpoint-num-layers", "layers per checkpointed chunk (--checkpoint-activations)", _PAR,
             "recompute units of more than one layer", "pass --checkpoint-num-layers 1 (jax3d's full recompute)",
             asks=lambda v, a: v != 1, when="above 1", otherwise="1 is what jax3d's full recompute does",
             decision=ACT, type=int, default=1, metavar="N"),
    _refused("--checkpoint-in-cpu", "DeepSpeed: keep checkpointed activations in CPU memory", _PAR,
             "activations offloaded to CPU memory", "drop it (--recompute full keeps the least on the devices)",
             **_ON),
    _refused("--remote-device", "ZeRO-3: where parameters are initialised", _PAR, "ZeRO-Infinity (parameters in CPU "
             "or NVMe memory)", "pass --remote-device none or leave it out", asks=lambda v, a: v != "none",
             when="cpu or nvme", otherwise="none: parameters live on the devices", choices=["none", "cpu", "nvme"],
             default="none"),
    *_family("DeepSpeed-Ulysses sequence parallelism", "drop it (--sequence-parallel shards activations over "
             "tensor parallelism instead)", _DS, (
                 ("--force-ds-sequence-parallel", "DeepSpeed-Ulysses whatever its size", _ON),)),
    *_family("FPDT (DeepSpeed's fully pipelined distributed transformer)", "drop it", _DS, (
        ("--ds-sequence-parallel-fpdt", "DeepSpeed-Ulysses with FPDT", _ON),
        ("--ds-sequence-parallel-fpdt-chunk-size", "FPDT attention chunk", _int(65536)),
        ("--ds-sequence-parallel-fpdt-offloading", "FPDT with offloading", _ON))),
    *(_accepted(name, help, why, _DS, **_ON) for name, help, why in (
        ("--cpu_torch_adam", "PyTorch's Adam on the CPU, with --cpu-optimizer", "read only with --cpu-optimizer, "
         "which is refused"),
        ("--ds_fused_adam", "DeepSpeed's fused Adam kernel", "a fused kernel of the same update; XLA fuses jax3d's "
         "AdamW itself"))),
    _accepted("--memory-centric-tiled-linear", "DeepSpeed: tile linear layers (ZeRO-3's TiledLinear)",
              "Megatron-DeepSpeed reads it nowhere: its linear layers are never tiled either", _DS, **_ON),
    _accepted("--tile-factor", "tiles per linear dimension with --memory-centric-tiled-linear (default: none, "
              "Megatron's is 1)", "Megatron-DeepSpeed reads it nowhere", _DS, **_int(None)),
    # Data.
    _refused("--dataloader-type", "single: one pass over the shuffled samples in order; cyclic: reshuffled every "
             "epoch (default: single)", _DATA, "the cyclic sampler (samples reshuffled every epoch)", "pass "
             "--dataloader-type single or leave it out (the datasets already shuffle their samples)",
             asks=lambda v, a: v == "cyclic", when="cyclic", otherwise="single is jax3d's order: the dataset's "
             "shuffled samples read in order, once each per epoch, as Megatron's single sampler",
             decision=ACT, choices=["single", "cyclic"], default="single"),
    _act("--aml-data-download-path", "a folder every --data-path prefix is under (default: none)", "each --data-path "
         "prefix is read under it (Megatron prefixes a weighted list's weights too; jax3d only the paths)", _DATA,
         **_path()),
    _act("--mask-prob", "BERT: share of tokens masked (default: 0.15)", "the share of tokens jax3d's BERT masks",
         _DATA, type=float, default=0.15, metavar="P"),
    _act("--short-seq-prob", "BERT: share of samples given a shorter target length (default: 0.1)", "the share "
         "of samples jax3d's BERT draws short, as Megatron draws them", _DATA, type=float, default=0.1, metavar="P"),
    _accepted("--mmap-warmup", "read the data files through once at start", "pages of the memory-mapped files are "
              "read as the loader needs them; the samples are the same", _DATA, **_ON),
    _accepted("--trust-remote-code", "let HFTokenizer run code from its folder", "jax3d's HFTokenizer reads "
              "tokenizer.json with the tokenizers library and runs no code", _DATA, **_ON),
    _accepted("--repeated-dataloader", "restart the data loader after its last batch", "jax3d's sample index spans "
              "as many epochs as the run needs", _DATA, **_ON),
    _accepted("--return-data-index", "add each sample's index to the batch", "for DeepSpeed's data-efficiency "
              "analysis, which jax3d does not run; training is the same", _DATA, **_ON),
    _accepted("--no-data-sharding", "the cyclic sampler without sharding", "read only by --dataloader-type cyclic, "
              "which is refused", _DATA, action="store_false", dest="data_sharding"),
    _accepted("--use-dataset-only", "only Megatron's datasets, for a trainer outside Megatron (default: none)",
              "jax3d's trainer is its own", _DATA, default=None, metavar="BOOL"),
    _refused("--sample-rate", "ORQA: share of the data used (default: 1.0)", _ICT, "ICT, biencoder and REALM "
             "retrieval models", "drop it", type=float, default=1.0),
    _refused("--train-data-exact-num-epochs", "build the train set from exactly this many epochs (default: none)",
             _DATA, "a train set of an exact number of epochs", "drop it (jax3d's train set spans the epochs the "
             "run needs)", **_int(None)),
    _refused("--data-efficiency-curriculum-learning", "DeepSpeed's data-efficiency curriculum learning", _DATA,
             "curriculum learning (DeepSpeed's data efficiency)", "drop it", **_ON),
    *_family("index files given by hand", "drop it (jax3d builds its sample index in --data-cache-path)", _DATA, (
        (f"--train-{kind}-path", f"use this {what} of the train set (default: none)", _path())
        for kind, what in (("idx", "index"), ("desc", "index description"), ("doc-idx", "document index"),
                           ("sample-idx", "sample index"), ("shuffle-idx", "shuffle index")))),
    # Logging.
    _act("--no-log-learnig-rate-to-tensorboard", "leave the learning rate out of --tensorboard-dir's events",
         "drops lr (without --tensorboard-dir every metric goes to --log-dir)", _LOG, action="store_false",
         dest="log_learning_rate_to_tensorboard"),
    _act("--no-log-loss-scale-to-tensorboard", "leave the loss scale out of --tensorboard-dir's events",
         "drops loss_scale (without --tensorboard-dir every metric goes to --log-dir)", _LOG, action="store_false",
         dest="log_loss_scale_to_tensorboard"),
    _accepted("--log-world-size-to-tensorboard", "write the world size to TensorBoard", "the run header names the "
              "device count, which a run does not change", _LOG, **_ON),
    _accepted("--tensorboard-log-interval", "steps between TensorBoard writes (default: none, Megatron's is 1)",
              "jax3d writes the events at every --log-interval step, with the losses averaged over the interval "
              "as on the console", _LOG, **_int(None)),
    _accepted("--no-barrier-with-level-1-timing", "no barrier around Megatron's level-1 timers", "XLA runs a step "
              "as one program; its time is the step time", _LOG, action="store_false", dest="barrier_with_L1_time"),
    _accepted("--timing-log-option", "which ranks' timers Megatron prints (default: none, Megatron's is minmax)",
              "XLA runs a step as one program; its time is the step time", _LOG, choices=["max", "minmax", "all"],
              default=None),
    *(_accepted(name, f"Weights & Biases: {what} (default: none)", "jax3d does not write to Weights & Biases; "
                "the metrics go to --log-dir's metrics.jsonl and TensorBoard events (--tensorboard-dir)", _LOG,
                default=None, metavar=metavar)
      for name, what, metavar in (("--wandb-project", "the project", "NAME"), ("--wandb-exp-name", "the run's name",
                                                                            "NAME"),
                                  ("--wandb-save-dir", "a local folder for its files", "DIR"))),
    _act("--profile", "trace the --profile_steps steps with jax.profiler (pt and pt-full alike) into "
         "--tensorboard-dir, or --log-dir without it (default: none)", "a jax.profiler trace (XLA's device and host "
         "activity) of those steps, under plugins/profile/ where TensorBoard's profile plugin finds it", _LOG,
         choices=["pt", "pt-full"], default=None),
    _act("--profile_steps", "FIRST,LAST: the steps --profile traces, counted from 1 at this process's first step",
         "as Megatron counts them: a resumed run's first step is 1", _LOG, default="2,3", metavar="FIRST,LAST"),
    _act("--profile-ranks", "the processes that trace with --profile (default: every one)", "process indices "
         "(jax.process_index()); Megatron's are GPU ranks", _LOG, type=int, nargs="+", default=None, metavar="N"),
    # Inference.
    _accepted("--inference-batch-times-seqlen-threshold", "Megatron's text generation: pipeline above this batch x "
              "length (default: none, Megatron's is 512)", "read by Megatron's text generation, not by training",
              _INFER, **_int(None)),
    _accepted("--max-tokens-to-oom", "Megatron's text generation: the most prompt and generated tokens (default: "
              "none, Megatron's is 12000)", "read by Megatron's text generation, not by training", _INFER,
              **_int(None)),
    _accepted("--bert-embedder-type", "RETRO's tools: megatron or huggingface BERT embedder (default: none, "
              "Megatron's is megatron)", "read by Megatron's RETRO tools, not by training", _INFER,
              choices=["megatron", "huggingface"], default=None),
    *_family("Megatron's inference mode in the train command", "use launch/generate.py or launch/evaluate.py with "
             "--load", _INFER, (
                 ("--inference", "build the model without an optimizer, for inference", _ON),
                 ("--ds-inference", "DeepSpeed's inference engine", _ON),
                 ("--output-bert-embeddings", "BERT outputs its pooled embeddings instead of its heads", _ON))),
    # Features of their own.
    *_family("RETRO (retrieval-augmented pretraining)", "drop it", _RETRO, (
        ("--retro-workdir", "RETRO's preprocessed data (default: none)", _path()),
        ("--retro-add-retriever", "add RETRO's retriever to the model", _ON),
        ("--retro-cyclic-train-iters", "steps of cyclic RETRO training (default: none)", _int(None)),
        ("--retro-encoder-layers", "layers of RETRO's retrieval encoder", _int(2)),
        ("--retro-encoder-hidden-dropout", "RETRO encoder's hidden dropout", _float(0.1)),
        ("--retro-encoder-attention-dropout", "RETRO encoder's attention dropout", _float(0.1)),
        ("--retro-num-neighbors", "neighbours retrieved in pretraining", _int(2)),
        ("--retro-num-retrieved-chunks", "chunks retrieved from the database", _int(2)),
        ("--retro-return-doc-ids", "return document ids (RETRO preprocessing)", _ON))),
    *_family("ICT, biencoder and REALM retrieval models", "drop it", _ICT, (
        ("--ict-head-size", "ICT/REALM block-embedding size (default: none)", _int(None)),
        ("--biencoder-projection-dim", "biencoder projection head", _int(0)),
        ("--biencoder-shared-query-context-model", "one model for queries and contexts", _ON),
        ("--ict-load", "an ICT checkpoint (default: none)", _path()),
        ("--bert-load", "a BERT checkpoint to start ICT or REALM from (default: none)", _path()),
        ("--titles-data-path", "ICT titles dataset (default: none)", _path()),
        ("--query-in-block-prob", "ICT: chance a query stays in its block", _float(0.1)),
        ("--use-one-sent-docs", "ICT: one-sentence documents", _ON),
        ("--evidence-data-path", "DPR's Wikipedia evidence (default: none)", _path()),
        ("--retriever-report-topk-accuracies", "top-k accuracies to report (default: none)",
         {"type": int, "nargs": "+", "default": [], "metavar": "K"}),
        ("--retriever-score-scaling", "scale retriever scores by 1/sqrt(hidden)", _ON),
        ("--retriever-seq-length", "biencoder sequence length", _int(256)),
        ("--block-data-path", "where BlockData is saved (default: none)", _path()),
        ("--embedding-path", "where retrieval embeddings are saved (default: none)", _path()),
        ("--indexer-batch-size", "indexing batch", _int(128)),
        ("--indexer-log-interval", "indexing batches between progress lines", _int(1000)))),
    *_family("vision models (ViT, Swin, DINO, inpainting)", "drop it", _VISION, (
        ("--num-classes", "image classes", _int(1000)),
        ("--img-h", "image height", _int(224)),
        ("--img-w", "image width", _int(224)),
        ("--num-channels", "image channels", _int(3)),
        ("--patch-dim", "patch size", _int(16)),
        ("--classes-fraction", "share of the classes trained on", _float(1.0)),
        ("--data-per-class-fraction", "share of each class's data trained on", _float(1.0)),
        ("--head-lr-mult", "learning-rate multiplier of the head", _float(1.0)),
        ("--vision-pretraining", "vision pretraining", _ON),
        ("--vision-pretraining-type", "classify, inpaint or dino", {"choices": ["classify", "inpaint", "dino"],
                                                                   "default": "classify"}),
        ("--vision-backbone-type", "vit, mit or swin", {"choices": ["vit", "mit", "swin"], "default": "vit"}),
        ("--swin-backbone-type", "Swin size", {"choices": ["tiny", "base", "h3"], "default": "tiny"}),
        ("--mask-type", "inpainting masks: random or row", {"choices": ["random", "row"], "default": "random"}),
        ("--mask-factor", "inpainting mask size", _float(1.0)),
        ("--iter-per-epoch", "DINO: steps per epoch", _int(1250)),
        ("--dino-local-img-size", "DINO: local crop size", _int(96)),
        ("--dino-local-crops-number", "DINO: local crops", _int(10)),
        ("--dino-head-hidden-size", "DINO: head width", _int(2048)),
        ("--dino-bottleneck-size", "DINO: head bottleneck", _int(256)),
        ("--dino-freeze-last-layer", "DINO: epochs the last layer stays frozen", _float(1)),
        ("--dino-norm-last-layer", "DINO: no norm in the last layer", _ON),
        ("--dino-warmup-teacher-temp", "DINO: teacher temperature at the start", _float(0.04)),
        ("--dino-teacher-temp", "DINO: teacher temperature", _float(0.07)),
        ("--dino-warmup-teacher-temp-epochs", "DINO: epochs of teacher-temperature warm-up", _int(30)))),
    *_family("knowledge distillation", "drop it", _KD, (
        ("--kd", "knowledge distillation from a teacher", _ON),
        ("--mos", "Mixture-of-Students, by knowledge distillation", _ON),
        ("--load-teacher", "the teacher's checkpoint (default: none)", _path()),
        ("--num-layers-teacher", "the teacher's layers (default: none)", _int(None)),
        ("--hidden-size-teacher", "the teacher's width (default: none)", _int(None)),
        ("--num-attention-heads-teacher", "the teacher's heads (default: none)", _int(None)),
        ("--num-experts-teacher", "the teacher's experts per layer", {"type": int, "nargs": "+", "default": [1],
                                                                      "metavar": "N"}),
        ("--kd-alpha-ce", "weight of the distillation loss", _float(1.0)),
        ("--kd-beta-ce", "weight of the hard-label loss", _float(1.0)),
        ("--kd-temp", "distillation temperature", _float(1.0)))),
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
