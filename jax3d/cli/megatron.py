"""Megatron-DeepSpeed's flags that jax3d's own train flags don't already cover, decided in one table
(jax3d/cli/megatron_flags.py: every flag of Megatron-DeepSpeed's arguments.py is there or is train.py's own).

Each flag a Megatron-DeepSpeed launch script passes either acts as it does there (ACT), is accepted and named
once in the run header with why it changes nothing under JAX and XLA (ACCEPTED), or names a feature jax3d does not
build, and then the run stops in one sentence, exit 2, before anything compiles (REFUSED). `add_megatron_flags`
puts the table's flags on the train parser; `megatron_config` turns their values into config changes, header
notes and refusals. docs/megatron-deepspeed.md is generated from the table (`doc_table`).
"""
from __future__ import annotations

import argparse
import re

from jax3d.cli.deepspeed import apply_deepspeed_json, check_accumulation, deepspeed_dests, read_deepspeed_json
from jax3d.cli.megatron_flags import ACCEPTED, ACT, FLAGS, MOE_GROUP, REFUSED, Flag
from jax3d.config import Config, ConfigError, is_number


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
              for f in rows(a) if f.group == MOE_GROUP and _given(f, a) and not _asks(f, a) and f.dest != "num_experts"]
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
    if a.use_distributed_optimizer:
        if cfg.parallel.zero_stage == 0:
            stage = "--zero-stage 0" if a.zero_stage == 0 else "--deepspeed_config's ZeRO stage 0"
            raise ConfigError(f"--use-distributed-optimizer shards the optimizer state over data parallelism and "
                              f"{stage} keeps it whole; drop one")
        if cfg.parallel.zero_stage is None:  # a stage of 1 to 3 shards the optimizer state already
            par["zero_stage"] = 1
    if a.no_pipeline_parallel:
        par["pipeline_parallel"] = 1
    if a.enable_zbh1_pipeline:
        par["pipeline_schedule"] = "zb-h1"
    logs = tuple(k for k in ("timers", "batch_size", "validation_ppl", "optimizer_states", "memory")
                 if getattr(a, f"log_{k}_to_tensorboard"))
    logs += tuple(f"no_{k}" for k in ("learning_rate", "loss_scale") if not getattr(a, f"log_{k}_to_tensorboard"))
    cfg = cfg.replace(precision={"fp8": "hybrid" if a.fp8_hybrid else "e4m3" if a.fp8_e4m3 else "",
                                 "fp8_margin": a.fp8_margin, "fp8_interval": a.fp8_interval,
                                 "fp8_amax_history_len": a.fp8_amax_history_len,
                                 "fp8_amax_compute_algo": a.fp8_amax_compute_algo})
    cfg, math_notes = _model_math(a, cfg)
    notes += math_notes
    cfg = cfg.replace(parallel=par, data={"tokenizer_model": a.tokenizer_model, "mask_prob": a.mask_prob,
                                          "short_seq_prob": a.short_seq_prob},
                      train={"exit_duration_in_mins": a.exit_duration_in_mins or 0.0,
                             "tensorboard_dir": a.tensorboard_dir or "", "tensorboard_log": logs,
                             "profile_steps": _profile_steps(a), "profile_ranks": tuple(a.profile_ranks or ()),
                             "kill_switch_file": a.kill_switch_file or ""})
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
    if not 0 < a.mask_prob <= 1:
        raise ConfigError(f"--mask-prob {a.mask_prob} must be above 0 and at most 1 (a share of the tokens)")
    if not 0 <= a.short_seq_prob <= 1:
        raise ConfigError(f"--short-seq-prob {a.short_seq_prob} must be between 0 and 1 (a share of the samples)")
    if a.exit_signal_handler and not a.save:
        raise ConfigError("--exit-signal-handler saves a checkpoint to --save on SIGTERM, and --save is not given; "
                          "add --save (jax3d then saves on SIGTERM with or without the flag)")
    if a.use_checkpoint_args and not a.load:
        raise ConfigError("--use-checkpoint-args reads the model's arguments from --load, which is not given; add "
                          "--load or drop it (Megatron refuses it without --load too)")
    schedule = [f for f, on in (("--override-opt_param-scheduler", a.override_opt_param_scheduler),
                                ("--no-load-lr-state", a.no_load_lr_state),
                                ("--use-checkpoint-opt_param-scheduler", a.use_checkpoint_opt_param_scheduler)) if on]
    if a.use_checkpoint_opt_param_scheduler and len(schedule) > 1:
        raise ConfigError(f"{' and '.join(schedule)} take the learning-rate schedule from different places; pass one")
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


# Megatron's other names for train.py's flags: the row's dest, and the flag and dest it sets.
ALIASES = {"encoder_num_layers": ("--num-layers", "num_layers"), "encoder_seq_length": ("--seq-length", "seq_length"),
           "load_tag": ("--ckpt-step", "ckpt_step")}


def apply_aliases(a) -> None:
    """Moves what Megatron's other names for train.py's flags give onto those flags, in `a` itself and once:
    --encoder-num-layers, --encoder-seq-length, --load-tag (a step), and --aml-data-download-path (a folder that
    each --data-path prefix is under). Both names of one flag are refused, as Megatron refuses them."""
    for src, (flag, dst) in ALIASES.items():
        v = getattr(a, src)
        if v is None:
            continue
        name = f"--{src.replace('_', '-')} {v}"
        if src == "load_tag":
            step = re.fullmatch(r"(?:global_step)?(\d+)", v)
            if step is None:
                raise ConfigError(f"{name} names no step; jax3d's checkpoints are numbered by step: pass "
                                  "global_stepN, N or --ckpt-step N")
            v = int(step.group(1))
        if getattr(a, dst) not in (None, -1):
            raise ConfigError(f"{name} and {flag} {getattr(a, dst)} set the same thing; pass one")
        setattr(a, dst, v)
        setattr(a, src, None)
    if a.aml_data_download_path:
        a.data_path = [p if is_number(p) else f"{a.aml_data_download_path}/{p}" for p in a.data_path]
        a.aml_data_download_path = None


def _profile_steps(a) -> tuple[int, ...]:
    """(first, last) of --profile_steps under --profile, else ()."""
    if a.profile is None:
        return ()
    steps = re.fullmatch(r"\s*(\d+)\s*,\s*(\d+)\s*", a.profile_steps)
    if steps is None or not 1 <= int(steps.group(1)) <= int(steps.group(2)):
        raise ConfigError(f"--profile_steps {a.profile_steps} must be FIRST,LAST with 1 <= FIRST <= LAST, e.g. 2,3")
    return int(steps.group(1)), int(steps.group(2))


def _counted(a, cfg: Config) -> Config:
    """The run counted in samples and tokens (jax3d.counts; the plan settles them into steps): Megatron decays a
    sample-counted run over its --train-samples unless --lr-decay-samples says otherwise."""
    return cfg.replace(
        train={"train_samples": a.train_samples or 0, "train_tokens": a.train_tokens or 0,
               "rampup_batch_size": tuple(a.rampup_batch_size or ())},
        optim={"lr_warmup_samples": a.lr_warmup_samples, "lr_warmup_tokens": a.lr_warmup_tokens or 0,
               "lr_decay_samples": a.lr_decay_samples or a.train_samples or 0, "lr_decay_tokens": a.lr_decay_tokens or 0})


def after_plan(a, cfg: Config, data_parallel: int) -> Config:
    """`cfg` (a plan's, settled on the run's final batch and sequence sizes), with DeepSpeed's batch rule checked
    against the data-parallel size."""
    if a.deepspeed and a.deepspeed_config:
        check_accumulation(read_deepspeed_json(a.deepspeed_config), cfg, data_parallel)
    return cfg


_SCHEDULE_DESTS = ("lr", "min_lr", "lr_warmup_iters", "lr_decay_iters", "lr_decay_style", "lr_warmup_samples",
                   "lr_decay_samples", "lr_warmup_tokens", "lr_decay_tokens", "lr_warmup_fraction", "weight_decay",
                   "weight_decay_incr_style", "start_weight_decay", "end_weight_decay", "weight_decay_incr_iters",
                   "weight_decay_incr_samples")


def implied_given(ns: argparse.Namespace) -> set[str]:
    """Dests a command line sets without naming them (`ns` holds only the flags given): the whole schedule under
    --override-opt_param-scheduler or --no-load-lr-state, the flags Megatron's other names set (`ALIASES`), and
    what --deepspeed_config's JSON sets under --deepspeed. A resumed run keeps these from the command line, not
    from its checkpoint (`counted_batch` too, which the run's own batch and sequence sizes give)."""
    out = {"counted_batch"} | {dst for src, (_, dst) in ALIASES.items() if src in vars(ns)}
    if getattr(ns, "override_opt_param_scheduler", False) or getattr(ns, "no_load_lr_state", False):
        out |= set(_SCHEDULE_DESTS)
    if getattr(ns, "deepspeed", False) and getattr(ns, "deepspeed_config", None):
        out |= deepspeed_dests(read_deepspeed_json(ns.deepspeed_config))
    return out


def kept_from_checkpoint(ns: argparse.Namespace) -> set[str]:
    """Dests a resumed run takes from its checkpoint even where the command line `ns` gives them: the schedule
    under --use-checkpoint-opt_param-scheduler."""
    return set(_SCHEDULE_DESTS) if getattr(ns, "use_checkpoint_opt_param_scheduler", False) else set()


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
