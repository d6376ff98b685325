"""Run configuration: nested frozen dataclasses, grouped by concern.

Command-line flags map onto these in one place (`jax3d.cli`). Library users build them directly.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration that can't run; the message is one sentence naming the flag and the fix."""


@dataclass(frozen=True)
class ModelConfig:
    """Transformer shape and regularisation. `ffn_hidden_size` defaults to Megatron's (`default_ffn_hidden_size`)."""

    model_type: str = "gpt"  # gpt | bert
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    ffn_hidden_size: int = 0
    vocab_size: int = 4096  # 0: the tokenizer's, padded (jax3d.parallel.plan.resolve)
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 128
    max_position_embeddings: int = 0
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    num_tokentypes: int = 2  # BERT only
    recompute: str = "none"  # none | selective | full
    scan_layers: bool | None = None  # None: from jax3d.parallel.plan.SCAN_LAYERS_FROM layers up on CPUs (plan.resolve)
    attention_impl: str = "auto"  # auto (the run's kernel policy: cuDNN on GPUs) | xla | cudnn
    # Architecture variants that reproduce imported models exactly (jax3d.hf); defaults are GPT-2 / Megatron.
    activation: str = "gelu_tanh"  # gelu_tanh | gelu_erf | squared_relu (relu(x)^2, Megatron's --squared-relu)
    post_layernorm: bool = False  # layer norm after each residual add and no final norm (original BERT)
    embedding_layernorm: bool = False  # layer norm on the embedding sum (original BERT)
    unpadded_vocab_size: int = 0  # the tokenizer's vocabulary; rows past it are padding (0: vocab_size)
    # Llama-family variants, by Megatron-DeepSpeed's argument names; the defaults are GPT-2's.
    normalization: str = "layernorm"  # layernorm | rmsnorm
    swiglu: bool = False  # gated SiLU MLP (then `activation` is unused)
    num_key_value_heads: int = 0  # grouped-query attention; 0: as many as heads (`kv_heads`), 1: multi-query
    add_bias_linear: bool = True
    add_position_embedding: bool = True  # learned positions; off with rotary embeddings
    use_rotary_position_embeddings: bool = False
    rope_theta: float = 10000.0
    rotary_percent: float = 1.0  # the share of each head's dims that rotates
    rope_scaling: str = ""  # "" | linear | llama3, with Hugging Face's meanings of the four fields below
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    untie_embeddings_and_output_weights: bool = False
    # Megatron-DeepSpeed's --kv-channels, --apply-layernorm-1p and the three end-of-document switches of
    # get_ltor_masks_and_position_ids (GPT only); eod_token_id is the tokenizer's (-1: unknown), set with them.
    kv_channels: int = 0  # each head's q/k/v width; 0: hidden_size / num_attention_heads
    apply_layernorm_1p: bool = False  # layer-norm scales stored as an offset from 1 (init 0); not RMSNorm's
    eod_mask_loss: bool = False  # no loss where the input token is the end-of-document token
    reset_position_ids: bool = False  # learned positions restart after each end-of-document token
    reset_attention_mask: bool = False  # no attention across an end-of-document token (a document mask)
    eod_token_id: int = -1

    def __post_init__(self):
        if self.activation not in ("gelu_tanh", "gelu_erf", "squared_relu"):
            raise ConfigError(f"activation {self.activation!r} must be gelu_tanh, gelu_erf or squared_relu")
        if self.activation == "squared_relu" and self.swiglu:
            raise ConfigError("--squared-relu and --swiglu each replace the MLP's activation; pass one of them")
        if self.normalization not in ("layernorm", "rmsnorm"):
            raise ConfigError(f"--normalization {self.normalization!r} must be layernorm or rmsnorm")
        if self.rope_scaling not in ("", "linear", "llama3"):
            raise ConfigError(f"rope scaling {self.rope_scaling!r} must be linear or llama3 (or none)")
        if self.untie_embeddings_and_output_weights and self.model_type == "bert":
            raise ConfigError("--untie-embeddings-and-output-weights is for GPT models; BERT's masked-LM head "
                              "decodes with the word embedding, so drop it or pass --model gpt")
        if self.model_type == "bert" and self.uses_eod:
            raise ConfigError("--eod-mask-loss, --reset-position-ids and --reset-attention-mask act on GPT samples, "
                              "which hold several documents; BERT's samples do not (Megatron's BERT ignores them), "
                              "so drop them or pass --model gpt")
        if not self.ffn_hidden_size:
            object.__setattr__(self, "ffn_hidden_size", default_ffn_hidden_size(self.hidden_size, self.swiglu))
        if self.use_rotary_position_embeddings:  # Megatron-DeepSpeed's rule: rotary replaces learned positions
            object.__setattr__(self, "add_position_embedding", False)
        if not self.max_position_embeddings:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        # Here, not only in the command line's checks: a library caller's num_layers=0 reached a division by
        # zero, and a checkpoint's hand-edited "num_layers": "two" a TypeError.
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):  # numpy's integers are whole too
                raise ConfigError(f"--{name.replace('_', '-')} {v!r} must be a whole number")
            if v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {v} must be at least 1")
        kvc = self.kv_channels
        if isinstance(kvc, bool) or not isinstance(kvc, numbers.Integral) or kvc < 0:
            raise ConfigError(f"--kv-channels {kvc!r} must be a whole number of at least 1 (or 0: hidden / heads)")
        kv = self.num_key_value_heads
        if isinstance(kv, bool) or not isinstance(kv, numbers.Integral) or kv < 0:
            raise ConfigError(f"--num-key-value-heads {kv!r} must be a whole number of at least 1")
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                              f"--num-key-value-heads {self.kv_heads}")
        if self.use_rotary_position_embeddings and (not 0 < self.rotary_percent <= 1 or self.rotary_dim < 2):
            raise ConfigError(f"--rotary-percent {self.rotary_percent} must be in (0, 1] and rotate at least two of "
                              f"the {self.head_dim} dims of each head")

    @property
    def deterministic(self) -> bool:
        """True when no dropout is configured, so no random keys are needed."""
        return self.hidden_dropout == 0 and self.attention_dropout == 0

    @property
    def head_dim(self) -> int:
        """Each head's width: `kv_channels`, or hidden_size / num_attention_heads when that is 0 (Megatron's)."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def one_plus_norms(self) -> bool:
        """Whether the blocks' and the final layer norm store their scales as offsets from 1 (--apply-layernorm-1p;
        RMSNorm keeps a plain scale, as Megatron-DeepSpeed's does)."""
        return self.apply_layernorm_1p and self.normalization == "layernorm"

    @property
    def uses_eod(self) -> bool:
        """Whether the model reads the end-of-document token out of its input (`eod_token_id`)."""
        return self.eod_mask_loss or self.reset_position_ids or self.reset_attention_mask

    @property
    def kv_heads(self) -> int:
        """Key/value heads: `num_key_value_heads`, or one per attention head when that is 0 (left unset, so
        that a checkpoint from before the field, whose heads --load adopts, keeps one per head)."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary embeddings rotate (an even number, as Megatron rounds)."""
        return int(self.head_dim * self.rotary_percent) // 2 * 2


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """Megatron's MLP width when --ffn-hidden-size is not given: 4 x hidden, or with SwiGLU's three matrices
    two thirds of that, rounded down to a multiple of 64 (about the same parameter count)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64 if swiglu else 4 * hidden_size


@dataclass(frozen=True)
class ParallelConfig:
    """The (data, stage, model) layout and how the optimizer state is spread over `data`."""

    # None in both: the most parallel layout that fits (jax3d.parallel.plan.resolve); None in one: 1.
    tensor_parallel: int | None = 1
    pipeline_parallel: int | None = 1
    data_parallel: int = 0  # 0: devices / (tp * pp)
    zero_stage: int | None = 0  # None: ZeRO-1 when there is data parallelism, else 0
    sequence_parallel: bool = False
    pipeline_schedule: str | None = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1; None: resolve picks
    virtual_stages: int = 1
    layers_per_virtual_stage: int = 0  # when set, resolve derives virtual_stages from it
    pipeline_layout: tuple[int, ...] = ()  # layers per stage, when they don't divide evenly


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and the learning-rate schedule, with Megatron's names and defaults."""

    lr: float = 6e-4
    min_lr: float = 6e-5
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 0  # 0: train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    lr_warmup_fraction: float = 0.0  # where set, the warm-up is this share of the decay (Megatron's, 0: unused)
    weight_decay: float = 0.1
    # Megatron's weight-decay schedule: constant keeps `weight_decay`; linear and cosine go from the start to the
    # end value over the run's steps (`weight_decay_incr_iters`, 0: train_iters), or its samples where the run is
    # counted in them (`weight_decay_incr_samples`, 0: those steps' batches).
    weight_decay_incr_style: str = "constant"  # constant | linear | cosine
    start_weight_decay: float = 0.0
    end_weight_decay: float = 0.0
    weight_decay_incr_iters: int = 0
    weight_decay_incr_samples: int = 0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    # Megatron's schedule counted in samples or tokens (0: not used); where set they replace the step counts.
    lr_warmup_samples: int = 0
    lr_decay_samples: int = 0
    lr_warmup_tokens: int = 0
    lr_decay_tokens: int = 0
    # What one update counts for such a schedule: (global batch, sequence length[, ramp start, increment, ramp
    # samples]), from the train and model config (jax3d.counts.settle).
    counted_batch: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute dtype; fp32 master weights always. fp16 adds dynamic loss scaling. The flags as given: what they
    decide (dtypes, loss-scale rule, FP8 recipe) is jax3d.parallel.precision.PrecisionPolicy's."""

    dtype: str = "float32"  # float32 | bfloat16 | float16
    loss_scale: float = 0.0  # 0: dynamic (fp16 only)
    initial_loss_scale: float = 2.0**32
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    hysteresis: int = 2
    # FP8 GEMMs with delayed scaling (jax3d.parallel.precision.Recipe), Megatron-DeepSpeed's flags and defaults.
    fp8: str = ""  # "" (off) | hybrid (e4m3 forward, e5m2 gradients) | e4m3
    fp8_margin: int = 0  # scales leave 2**margin of headroom
    fp8_interval: int = 1  # steps between scale updates (only 1 is built)
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"  # most_recent | max (of the history)

    def __post_init__(self):
        if not self.fp8:
            return
        if self.fp8 not in ("hybrid", "e4m3"):
            raise ConfigError(f"FP8 format {self.fp8!r} is not built; pass --fp8-hybrid or --fp8-e4m3")
        if self.dtype == "float16":
            raise ConfigError("FP8 GEMMs run here inside --bf16 (or fp32) compute, not --fp16 and its loss scaling; "
                              "pass --bf16 instead of --fp16")
        if self.fp8_interval != 1:
            raise ConfigError(f"--fp8-interval {self.fp8_interval} is not built: scales are updated every step "
                              "(Transformer Engine has dropped the interval too); pass 1 or leave it out")
        if self.fp8_amax_history_len < 1:
            raise ConfigError(f"--fp8-amax-history-len {self.fp8_amax_history_len} must be at least 1")
        if self.fp8_amax_compute_algo not in ("most_recent", "max"):
            raise ConfigError(f"--fp8-amax-compute-algo {self.fp8_amax_compute_algo!r} must be most_recent or max")
        if self.fp8_margin < 0:
            raise ConfigError(f"--fp8-margin {self.fp8_margin} must not be negative")


# DataConfig's tokenizer files, as Megatron's flags name them; a checkpoint's tokenizer record uses the same keys.
TOKENIZER_FILE_KEYS = ("vocab_file", "merge_file", "tokenizer_file", "tokenizer_model")


@dataclass(frozen=True)
class DataConfig:
    """Where samples come from; empty `data_path` means the bundled default corpus."""

    data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    tokenizer_type: str = ""
    vocab_file: str = ""
    merge_file: str = ""
    tokenizer_file: str = ""
    tokenizer_model: str = ""  # a SentencePiece model (GPTSentencePieceTokenizer)
    cache_dir: str = ""
    # Megatron's separate datasets, each read whole (a path or a blend `w1 p1 w2 p2`), instead of `data_path` and
    # `split`: train, and where given valid (validation) and test (launch/evaluate.py --split-name test).
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    mask_prob: float = 0.15  # BERT: share of tokens masked
    short_seq_prob: float = 0.1  # BERT: share of samples given a shorter target length

    @property
    def split_paths(self) -> dict[str, tuple[str, ...]]:
        """{"train" | "valid" | "test": that split's own --*-data-path}, the ones given (empty with `data_path`)."""
        return {k: v for k, v in (("train", self.train_data_path), ("valid", self.valid_data_path),
                                  ("test", self.test_data_path)) if v}

    @property
    def all_paths(self) -> list[tuple[str, ...]]:
        """Every --data-path / --*-data-path given: the data the tokenizer must fit."""
        return [p for p in (self.data_path, *self.split_paths.values()) if p]


@dataclass(frozen=True)
class TrainConfig:
    """Batch sizes, iteration counts, logging and checkpoints (Megatron semantics)."""

    micro_batch_size: int = 4
    global_batch_size: int = 32
    train_iters: int = 200
    exit_interval: int = 0
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    log_dir: str = "runs/latest"
    save: str = ""
    save_interval: int = 0
    load: str = ""
    ckpt_step: int = -1
    keep_checkpoints: int = 0  # 0: keep all
    exit_after_skipped_iters: int = -1  # stop when this many steps in a row were skipped (0: never; -1: jax3d.train.skipped's default)
    peak_tflops: float = 0.0  # 0: from the device kind
    # Megatron's fine-tuning switches (their meanings in jax3d.cli's help).
    finetune: bool = False  # --load's weights only: step 0, a fresh optimizer, schedule, data position and RNG
    override_data: bool = False  # resume on other data or tokenizer than the checkpoint's
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    # Megatron's counts of a run (jax3d.counts): its length in samples (0: train_iters counts it), a stop
    # in tokens, and the global batch's ramp (start, increment, samples).
    train_samples: int = 0
    train_tokens: int = 0
    rampup_batch_size: tuple[int, ...] = ()
    exit_duration_in_mins: float = 0.0  # save and stop before this much training time (0: no limit)
    # TensorBoard events there (not in log_dir), with Megatron's choice of scalars plus the groups named
    # (timers, batch_size, validation_ppl, optimizer_states, memory), less those named no_learning_rate, no_loss_scale.
    tensorboard_dir: str = ""
    tensorboard_log: tuple[str, ...] = ()
    # Megatron's --log-params-norm and --log-num-zeros-in-grad: the train step computes them only when asked.
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    # A jax.profiler trace of this process's steps (first, last), counted from 1 (empty: none), on these
    # processes (empty: all) (jax3d.train.profile).
    profile_steps: tuple[int, ...] = ()
    profile_ranks: tuple[int, ...] = ()
    kill_switch_file: str = ""  # stop before the next step, without a save, once this file exists


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def replace(self, **groups) -> "Config":
        """`cfg.replace(model={'hidden_size': 64})` returns a copy with those fields changed."""
        new = {k: dataclasses.replace(getattr(self, k), **v) for k, v in groups.items()}
        return dataclasses.replace(self, **new)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def config_from_dict(d: dict) -> Config:
    """Inverse of `Config.to_dict()` (JSON turns tuples into lists). Keys of no field are dropped, so a
    checkpoint that records fields since removed (the model's benchmark switches) still reads."""
    def build(cls, sub):
        names = {f.name: f for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in (sub or {}).items():
            if k in names:
                kw[k] = as_tuple(v)
        return cls(**kw)
    return Config(model=build(ModelConfig, d.get("model")), parallel=build(ParallelConfig, d.get("parallel")),
                  optim=build(OptimConfig, d.get("optim")), precision=build(PrecisionConfig, d.get("precision")),
                  data=build(DataConfig, d.get("data")), train=build(TrainConfig, d.get("train")))


def is_number(s: str) -> bool:
    """Whether a command-line word is a number (a blend weight in --data-path), not a path."""
    try:
        float(s)
    except ValueError:
        return False
    return True


def as_tuple(v):
    """A tuple field of the config as the config holds it: JSON gives tuples back as lists."""
    return tuple(v) if isinstance(v, list) else v
