"""DeepSpeed's JSON config (`--deepspeed --deepspeed_config FILE`), read as a Megatron-DeepSpeed run reads it.

Under `--deepspeed`, DeepSpeed's engine takes the batch sizes, the ZeRO stage, the precision with its loss
scaling, gradient clipping and Adam's betas and epsilon from the JSON. Megatron's own flags for loss scaling and
clipping belong to its own optimizer, which DeepSpeed replaces, and its learning-rate scheduler sets the rate
and weight decay every step. jax3d does the same: where the JSON sets a value it governs, and the run header
names each command-line value it replaced. Batch sizes, the ZeRO stage and the precision are also Megatron's
own settings, so a JSON that disagrees with the command line about them is refused in one sentence, as is one
that asks for a DeepSpeed feature jax3d does not build. What the JSON holds that jax3d has no use for is named
in one line, with why.
"""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from dataclasses import dataclass

from jax3d.config import Config, ConfigError
from jax3d.parallel.precision import SHORT_NAMES, LossScaling, dtype_of_flags

# DeepSpeed's defaults for what a JSON leaves out (deepspeed/runtime/constants.py, fp16 section).
_FP16_DEFAULTS = {"loss_scale": 0.0, "initial_scale_power": 16, "loss_scale_window": 1000, "hysteresis": 2,
                  "min_loss_scale": 1.0}

# Keys read and deliberately left unused, with why.
_UNUSED = {
    "steps_per_print": "DeepSpeed's own progress line; --log-interval sets jax3d's",
    "wall_clock_breakdown": "DeepSpeed's per-phase timers; XLA runs a step as one program, whose time "
                            "--log-timers-to-tensorboard logs",
    "prescale_gradients": "gradients are averaged once over the global batch, in fp32",
    "gradient_predivide_factor": "gradients are averaged once over the global batch, in fp32",
    "data_types": "gradients are accumulated in fp32 always",
    "zero_optimization": "bucket sizes and communication overlap are XLA's to schedule",
    "optimizer.params.lr": "Megatron's scheduler sets the rate every step from --lr",
    "optimizer.params.weight_decay": "Megatron's scheduler sets the weight decay every step from --weight-decay",
    "scheduler": "the rate follows the command line's schedule (--lr, --lr-warmup-*, --lr-decay-*)",
    "zero_allow_untested_optimizer": "AdamW is the only optimizer",
    "activation_checkpointing": "recompute is jax.checkpoint, set by --checkpoint-activations / "
                                "--recompute-granularity",
    "fp16": "DeepSpeed's own fp16 switches",
    "bf16": "DeepSpeed's own bf16 switches",
    "communication_data_type": "XLA reduces gradients in fp32",
    "tensorboard": "DeepSpeed's own monitor; --tensorboard-dir sets jax3d's",
    "flops_profiler": "DeepSpeed's profiler; the run logs its MFU",
}
# Sections that turn on a DeepSpeed feature jax3d does not build, when enabled.
_FEATURES = {"curriculum_learning": "curriculum learning (a sequence-length warm-up)",
             "data_efficiency": "data efficiency (curriculum learning and random layer-token drop)",
             "compression_training": "compression training", "sparse_attention": "sparse attention",
             "elasticity": "elastic training"}


@dataclass(frozen=True)
class DeepSpeedJSON:
    """What a DeepSpeed JSON sets (None where it says nothing), and what it holds that jax3d does not use."""

    path: str
    train_batch_size: int | None = None
    micro_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    zero_stage: int | None = None
    dtype: str | None = None  # float16 | bfloat16 | float32 (a precision section, none enabled)
    loss_scaling: dict | None = None  # fp16: loss_scale, initial_loss_scale, loss_scale_window, hysteresis, min_loss_scale
    gradient_clipping: float = 0.0  # DeepSpeed's default: none
    adam: dict | None = None  # optimizer.params: adam_beta1, adam_beta2, adam_eps
    unused: tuple[str, ...] = ()  # "key (why)"


def read_deepspeed_json(path: str) -> DeepSpeedJSON:
    """The JSON at `path`; ConfigError, one sentence, where it can't be read, is not a DeepSpeed config or asks
    for a feature jax3d does not build."""
    flag = f"--deepspeed_config {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} does not exist; pass the DeepSpeed JSON the script writes")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{flag} could not be read ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag} holds a JSON {type(raw).__name__}, not the object of keys DeepSpeed reads")
    get = _Reader(raw, flag)
    for key, feature in _FEATURES.items():
        section = raw.get(key)
        if isinstance(section, dict) and section.get("enabled", key == "sparse_attention"):
            raise ConfigError(f"{flag} turns on {feature} ({key}), which jax3d does not build; set its "
                              "\"enabled\" to false")
    zero = get.section("zero_optimization")
    for part in ("offload_optimizer", "offload_param"):
        device = (zero.get(part) or {}).get("device", "none") if isinstance(zero.get(part), dict) else "none"
        if device not in ("none", None):
            raise ConfigError(f"{flag} offloads to the {device} (zero_optimization.{part}), which jax3d does not "
                              "build; ZeRO stages 1 to 3 shard the state over the data-parallel devices instead")
    out = {"train_batch_size": get.whole("train_batch_size"),
           "micro_batch_size": get.whole("train_micro_batch_size_per_gpu"),
           "gradient_accumulation_steps": get.whole("gradient_accumulation_steps"),
           "zero_stage": get.whole("stage", zero, "zero_optimization.stage", lowest=0),
           "gradient_clipping": get.number("gradient_clipping", lowest=0.0) or 0.0}
    if out["zero_stage"] is not None and out["zero_stage"] > 3:
        raise ConfigError(f"{flag} sets zero_optimization.stage {out['zero_stage']}; ZeRO has stages 0 to 3")
    fp16, bf16 = get.section("fp16"), get.section("bf16") or get.section("bfloat16")
    on = [name for name, s in (("fp16", fp16), ("bf16", bf16)) if get.switch("enabled", s, f"{name}.enabled")]
    if len(on) > 1:
        raise ConfigError(f"{flag} enables both fp16 and bf16; enable one")
    if on:
        out["dtype"] = dtype_of_flags(bf16=on[0] == "bf16", fp16=on[0] == "fp16")
    elif "fp16" in raw or "bf16" in raw or "bfloat16" in raw:
        out["dtype"] = "float32"
    if on == ["fp16"]:
        fp = {k: get.number(k, fp16, f"fp16.{k}", lowest=0.0) for k in _FP16_DEFAULTS}
        fp = {k: _FP16_DEFAULTS[k] if v is None else v for k, v in fp.items()}
        out["loss_scaling"] = {"loss_scale": float(fp["loss_scale"]),
                               "initial_loss_scale": 2.0 ** fp["initial_scale_power"],
                               "loss_scale_window": int(fp["loss_scale_window"]), "hysteresis": int(fp["hysteresis"]),
                               "min_loss_scale": float(fp["min_loss_scale"])}
    out["adam"] = _adam(get, flag)
    unused = [k for k in raw if k not in _READ]
    unused += [f"zero_optimization.{k}" for k in zero if k != "stage"]
    unused += [f"{name}.{k}" for name, s in (("fp16", fp16), ("bf16", bf16)) for k in s
               if k != "enabled" and not (name == "fp16" and k in _FP16_DEFAULTS)]
    unused += [f"optimizer.params.{k}" for k in (get.section("optimizer").get("params") or {})
               if k not in ("betas", "eps")]
    return DeepSpeedJSON(path=path, unused=tuple(_why(k) for k in unused), **out)


_READ = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization",
         "gradient_clipping", "fp16", "bf16", "bfloat16", "optimizer"}


def _why(key: str) -> str:
    why = _UNUSED.get(key) or _UNUSED.get(key.split(".")[0]) or "not read by jax3d"
    return f"{key} ({why})"


def _adam(get, flag: str) -> dict | None:
    opt = get.section("optimizer")
    if not opt:
        return None
    kind = str(opt.get("type", "")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"{flag} asks for the {opt.get('type')!r} optimizer, which jax3d does not build; it trains "
                          "with AdamW (optimizer type \"AdamW\", or leave the optimizer out)")
    params = get.section("params", opt, "optimizer.params")
    out = {}
    betas = params.get("betas")
    if betas is not None:
        if not (isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) for b in betas)):
            raise ConfigError(f"{flag} sets optimizer.params.betas {betas!r}; give two numbers, e.g. [0.9, 0.95]")
        out["adam_beta1"], out["adam_beta2"] = float(betas[0]), float(betas[1])
    eps = get.number("eps", params, "optimizer.params.eps", lowest=0.0)
    if eps is not None:
        out["adam_eps"] = eps
    return out


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class _Reader:
    """Typed reads of a DeepSpeed JSON's keys, each wrong value one ConfigError sentence naming the key."""

    def __init__(self, raw: dict, flag: str):
        self.raw, self.flag = raw, flag

    def _value(self, key, where, name):
        v = (self.raw if where is None else where).get(key)
        if v == "auto":
            raise ConfigError(f"{self.flag} leaves {name or key} \"auto\", which Hugging Face's Trainer fills in, not "
                              "DeepSpeed; give the value")
        return v

    def section(self, key, where=None, name=None) -> dict:
        v = self._value(key, where, name)
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise ConfigError(f"{self.flag} sets {name or key} to {v!r}; DeepSpeed reads an object of keys there")
        return v

    def number(self, key, where=None, name=None, lowest=None):
        v = self._value(key, where, name)
        if v is None:
            return None
        if not _is_number(v) or (lowest is not None and v < lowest):
            raise ConfigError(f"{self.flag} sets {name or key} to {v!r}; it must be a number of at least {lowest}")
        return float(v)

    def whole(self, key, where=None, name=None, lowest=1):
        v = self._value(key, where, name)
        if v is None:
            return None
        if not (_is_number(v) and float(v).is_integer() and v >= lowest):
            raise ConfigError(f"{self.flag} sets {name or key} to {v!r}; it must be a whole number of at least {lowest}")
        return int(v)

    def switch(self, key, where, name) -> bool:
        v = self._value(key, where, name)
        if v is not None and not isinstance(v, bool):
            raise ConfigError(f"{self.flag} sets {name} to {v!r}; it must be true or false")
        return bool(v)


def apply_deepspeed_json(ds: DeepSpeedJSON, a, cfg: Config) -> tuple[Config, list[str]]:
    """`cfg` as DeepSpeed would run the command line `a` with JSON `ds`, and the header's two lines: what the
    JSON set (with the command-line values it replaced) and what it holds unused. A disagreement about the batch
    sizes, ZeRO stage or precision is one ConfigError sentence naming both sources."""
    src = f"--deepspeed_config {ds.path}"
    for flag, given, key, value in (("--global-batch-size", a.global_batch_size, "train_batch_size", ds.train_batch_size),
                                    ("--micro-batch-size", a.micro_batch_size, "train_micro_batch_size_per_gpu",
                                     ds.micro_batch_size),
                                    ("--zero-stage", a.zero_stage, "zero_optimization.stage", ds.zero_stage)):
        if given is not None and value is not None and given != value:
            raise ConfigError(f"{flag} {given} and {src}'s {key} {value} disagree; make them the same")
    asked = dtype_of_flags(a.bf16, a.fp16) if a.bf16 or a.fp16 else None
    if asked and ds.dtype and asked != ds.dtype:
        raise ConfigError(f"--{'fp16' if a.fp16 else 'bf16'} and {src}, which "
                          f"{'runs in fp32' if ds.dtype == 'float32' else 'enables ' + SHORT_NAMES[ds.dtype]}, disagree; "
                          "make them the same")
    tr, prec, opt = cfg.train, cfg.precision, cfg.optim
    train = {k: v for k, v in (("global_batch_size", ds.train_batch_size), ("micro_batch_size", ds.micro_batch_size))
             if v is not None}
    # DeepSpeed runs ZeRO stage 0 when the JSON says nothing.
    zero = ds.zero_stage if ds.zero_stage is not None else 0 if cfg.parallel.zero_stage is None else None
    precision = {"dtype": ds.dtype} if ds.dtype else {}
    precision.update(ds.loss_scaling or {})
    if (ds.dtype or prec.dtype) != "float16":
        precision["loss_scale"] = 0.0  # Megatron's --loss-scale is unused: nothing scales bf16 or fp32 gradients
    optim = {"clip_grad": ds.gradient_clipping, **(ds.adam or {})}
    # The command line's own values, given or default (argparse dests are the field names), which the JSON's replace.
    replaced = [f"--{k.replace('_', '-')} {_power_of_two(getattr(a, k)) if k == 'initial_loss_scale' else _shown(getattr(a, k))}"
                for k, v in {**precision, **optim}.items() if k != "dtype" and getattr(a, k) != v]
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(tr, **train), optim=dataclasses.replace(opt, **optim),
        precision=dataclasses.replace(prec, **precision),
        parallel=dataclasses.replace(cfg.parallel, **({"zero_stage": zero} if zero is not None else {})))
    notes = [f"{src}: {_summary(cfg, ds)}" + (f"; these replace the command line's {', '.join(replaced)} (given "
                                             "or default)" if replaced else "")]
    if ds.unused:
        notes.append(f"{src}: unused: {', '.join(ds.unused)}")
    return cfg, notes


def _shown(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _power_of_two(v: float) -> str:
    k = math.log2(v)
    return f"2^{int(k)}" if k.is_integer() else _shown(v)


def _summary(cfg: Config, ds: DeepSpeedJSON) -> str:
    """What the JSON decides, in words: batch sizes, ZeRO, precision and loss scaling, clipping, Adam."""
    p, scaling = cfg.precision, LossScaling.of(cfg.precision)
    parts = [f"{name} {v}" for name, v in (("global batch", ds.train_batch_size), ("micro-batch", ds.micro_batch_size),
                                           ("accumulation steps", ds.gradient_accumulation_steps)) if v is not None]
    parts.append(f"ZeRO-{cfg.parallel.zero_stage}")
    if scaling.mode == "none":
        parts.append(SHORT_NAMES[p.dtype])
    else:
        scale = f"static loss scale {_shown(scaling.initial)}" if scaling.mode == "static" else (
            f"dynamic loss scale from {_power_of_two(scaling.initial)}, window "
            f"{scaling.window}, hysteresis {scaling.hysteresis}, min {_shown(scaling.min_scale)}")
        parts.append(f"{SHORT_NAMES[p.dtype]} ({scale})")
    parts.append(f"gradient clipping {_shown(cfg.optim.clip_grad)}" if cfg.optim.clip_grad else "no gradient clipping")
    if ds.adam:
        parts.append(", ".join(f"{k.replace('_', ' ')} {_shown(v)}" for k, v in ds.adam.items()))
    return ", ".join(parts)


def deepspeed_dests(ds: DeepSpeedJSON) -> set[str]:
    """The command line's dests (argparse names) whose settings the JSON gives: a resumed run keeps them from the
    JSON, not the checkpoint."""
    out = {k for k, v in (("global_batch_size", ds.train_batch_size), ("micro_batch_size", ds.micro_batch_size),
                          ("zero_stage", ds.zero_stage)) if v is not None}
    if ds.dtype:
        out |= {"fp16", "bf16"}
    if ds.loss_scaling:
        out |= {"loss_scale", "initial_loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"}
    return out | {"clip_grad"} | set(ds.adam or {})


def check_accumulation(ds: DeepSpeedJSON, cfg: Config, data_parallel: int) -> None:
    """DeepSpeed's batch rule, once the data-parallel size is known: train_batch_size = micro-batch x
    gradient_accumulation_steps x data-parallel size."""
    if ds.gradient_accumulation_steps is None:
        return
    tr = cfg.train
    accum = tr.global_batch_size // (tr.micro_batch_size * data_parallel)
    if accum * tr.micro_batch_size * data_parallel != tr.global_batch_size or accum != ds.gradient_accumulation_steps:
        raise ConfigError(f"--deepspeed_config {ds.path}'s gradient_accumulation_steps {ds.gradient_accumulation_steps} "
                          f"and the global batch {tr.global_batch_size} = micro-batch {tr.micro_batch_size} x "
                          f"accumulation x {data_parallel} data-parallel ranks disagree; set it to "
                          f"{tr.global_batch_size / (tr.micro_batch_size * data_parallel):g} or change the batch sizes")
