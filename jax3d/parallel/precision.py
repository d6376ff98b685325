"""The run's precision, decided once: `PrecisionPolicy.of(cfg.precision, devices)`.

A `PrecisionConfig` holds the flags as given (`--bf16`, `--fp16` and its loss scaling, `--fp8-*`); the policy holds
what they mean, and every consumer reads it rather than the strings:

    compute_dtype     the dtype the model computes in (fp32 master weights always): jnp.float32, bfloat16, float16
    loss_scaling      none (bf16, fp32: the scale stays 1), static (--fp16 --loss-scale S) or dynamic (--fp16),
                      with the dynamic rule's first scale, window, hysteresis and floor
    fp8               the FP8 delayed-scaling `Recipe` (format, margin, history, algorithm), None when FP8 is off
    compiler_options  the XLA options the train step is compiled with (FP8: the GEMM autotuning level)
    cache_dtype       generation's KV cache (--kv-cache-dtype: fp8 or the compute dtype)
    weight_dtype      generation's stored GEMM weights (--quantization fp8: e4m3; None: the compute dtype)

With `devices`, the policy also checks them: FP8 training, an fp8 KV cache and fp8 weights need GPUs with FP8
(compute capability 8.9 or later), and a device without is one ConfigError sentence.

FP8 delayed scaling, Transformer Engine's recipe (`DelayedScaling`) with Megatron-DeepSpeed's flags: each GEMM of
the blocks (jax3d.models.fp8) quantizes x, w and the output gradient g with a scale taken from amaxes of earlier
steps, never from the tensor being quantized, so the quantization needs no reduction over the tensor first and
fuses with the producer (current scaling would put a global max, an all-reduce under tensor parallelism, in front
of every GEMM). The history the step keeps (jax3d.train.fp8) gives the scales (`Recipe.scales`) and takes each
step's amaxes (`Recipe.update`).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from jax3d.config import ConfigError, PrecisionConfig
from jax3d.xla_options import unless_in_xla_flags

# PrecisionConfig.dtype -> the compute dtype
COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# PrecisionConfig.dtype -> its name on the command line (--bf16, --fp16) and in DeepSpeed's JSON
SHORT_NAMES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

# (forward operands, output gradient) formats of each FP8 mode; float8_e4m3fn is e4m3 with no infinities, as on
# Hopper. The GEMMs (jax3d.models.fp8) read this table.
FP8_FORMATS = {"hybrid": (jnp.float8_e4m3fn, jnp.float8_e5m2), "e4m3": (jnp.float8_e4m3fn, jnp.float8_e4m3fn)}
# The least CUDA compute capability with FP8 tensor cores (Ada 8.9, Hopper 9.0).
FP8_COMPUTE_CAPABILITY = (8, 9)

# Generation's --kv-cache-dtype and --quantization (None: the compute dtype).
KV_CACHE_DTYPES = {"auto": None, "fp8": jnp.float8_e4m3fn}
WEIGHT_DTYPES = {"none": None, "fp8": jnp.float8_e4m3fn}

# XLA autotunes each FP8 GEMM (cuBLASLt's and Triton's candidates) while it compiles, and at its default level, 4,
# checks every candidate's output against a reference GEMM. Level 3 keeps the autotuning and its buffer
# initialisation and leaves out the check: on one H100, gpt-1.3b at batch 2 with full recompute, the FP8 step
# compiled in 17.2 s against 62.8 s and ran at the same speed (docs/performance.md). A bf16 step has few GEMM
# candidates and is left at XLA's default. XLA_FLAGS=--xla_gpu_autotune_level=4 brings the check back.
FP8_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 3}


def dtype_of_flags(bf16: bool, fp16: bool = False) -> str:
    """PrecisionConfig.dtype of the command line's --bf16 / --fp16 (neither: float32)."""
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


@dataclass(frozen=True)
class LossScaling:
    """How the gradients are scaled: `mode` "none" (bf16, fp32: the scale stays 1), "static" (--fp16 --loss-scale)
    or "dynamic" (--fp16: Megatron's rule, jax3d.train.state.update_loss_scale), from the scale `initial`. The
    dynamic rule's window, hysteresis and floor are kept whatever the mode: the state records the hysteresis."""

    mode: str
    initial: float
    window: int
    hysteresis: int
    min_scale: float

    @classmethod
    def of(cls, precision: PrecisionConfig) -> LossScaling:
        if precision.dtype != "float16":
            mode, initial = "none", 1.0
        elif precision.loss_scale:
            mode, initial = "static", precision.loss_scale
        else:
            mode, initial = "dynamic", precision.initial_loss_scale
        return cls(mode, initial, precision.loss_scale_window, precision.hysteresis, precision.min_loss_scale)

    @property
    def dynamic(self) -> bool:
        return self.mode == "dynamic"


@dataclass(frozen=True)
class Recipe:
    """The delayed-scaling recipe of a run: format, margin, history length and how the history gives an amax."""

    format: str
    margin: int = 0
    history: int = 1
    algorithm: str = "most_recent"

    @classmethod
    def of(cls, precision: PrecisionConfig) -> Recipe | None:
        """The run's recipe, or None when FP8 is off."""
        if not precision.fp8:
            return None
        return cls(precision.fp8, precision.fp8_margin, precision.fp8_amax_history_len,
                   precision.fp8_amax_compute_algo)

    def _largest(self):
        fwd, grad = FP8_FORMATS[self.format]
        return jnp.asarray([_largest(fwd), _largest(fwd), _largest(grad)], jnp.float32)

    def init(self, scales_tree):
        """A fresh history (zeros: scale 1 until an amax is seen) for a tree of (..., 3) scales leaves (abstract)."""
        return jax.tree.map(lambda a: jnp.zeros((*a.shape, self.history), jnp.float32), scales_tree)

    def scales(self, history):
        """The dequantizing scales of a history: amax * 2**margin / the format's largest value, rounded up to a
        power of two, where the history holds a positive finite amax, else 1. A power of two divides exactly and
        makes the product of two scales, which multiplies an FP8 GEMM's bf16 output, exact (jax3d.models.fp8);
        rounding up keeps amax / scale within the format's range, at most one binade below its top."""
        top = self._largest()

        def one(h):
            ref = h[..., 0] if self.algorithm == "most_recent" else jnp.max(h, axis=-1)
            ok = (ref > 0) & jnp.isfinite(ref)
            return jnp.where(ok, power_of_two_above(ref * (2.0 ** self.margin) / top), 1.0)
        return jax.tree.map(one, history)

    @staticmethod
    def update(history, amaxes):
        """The history with this step's amaxes in front and the oldest entry dropped."""
        return jax.tree.map(lambda h, a: jnp.concatenate([a.astype(h.dtype)[..., None], h[..., :-1]], axis=-1),
                            history, amaxes)

    def describe(self) -> str:
        """The recipe in the run header's words."""
        return f"{self.format}, amax {self.algorithm} of {self.history}, margin {self.margin}"


def _largest(f8) -> float:
    """The largest finite value of an f8 format (448 for e4m3, 57344 for e5m2)."""
    return float(jnp.finfo(f8).max)


def power_of_two_above(v):
    """The least power of two >= v, for positive finite v (exact: frexp, not a rounded log2); at least the
    smallest normal float, so that a scale is never zero."""
    # v = mantissa * 2**exponent, mantissa in [0.5, 1): a power of two has mantissa 0.5
    mantissa, exponent = jnp.frexp(jnp.maximum(v, jnp.finfo(v.dtype).tiny))
    return jnp.ldexp(jnp.ones_like(v), jnp.where(mantissa == 0.5, exponent - 1, exponent))


@dataclass(frozen=True)
class PrecisionPolicy:
    """What a run's precision flags decide (the module's docstring lists the fields). `PrecisionPolicy.of` builds
    it; nothing outside jax3d/parallel/precision.py turns PrecisionConfig's strings into dtypes or rules."""

    dtype: str  # PrecisionConfig.dtype, as the checkpoint and the run header name it
    compute_dtype: object
    loss_scaling: LossScaling
    fp8: Recipe | None
    compiler_options: dict = field(hash=False)  # a dict, as jax.jit takes it; the policy still hashes
    cache_dtype: object
    weight_dtype: object = None
    autotuning_note: str = ""  # a line for the run header when XLA_FLAGS keeps XLA from picking FP8 GEMMs

    @classmethod
    def of(cls, precision: PrecisionConfig, devices=None, *, kv_cache_dtype: str = "auto",
           quantization: str = "none", env=os.environ) -> PrecisionPolicy:
        """The policy of `precision` (and of generation's --kv-cache-dtype and --quantization). With `devices`,
        ConfigError where they cannot run it (FP8 on a GPU without FP8)."""
        if devices is not None:
            refused = fp8_device_error(precision, devices) or generation_device_error(
                kv_cache_dtype == "fp8", quantization == "fp8", devices)
            if refused:
                raise ConfigError(refused)
        compute = COMPUTE_DTYPES[precision.dtype]
        return cls(dtype=precision.dtype, compute_dtype=compute, loss_scaling=LossScaling.of(precision),
                   fp8=Recipe.of(precision), compiler_options=compiler_options(precision, env),
                   cache_dtype=jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype] or compute),
                   weight_dtype=WEIGHT_DTYPES[quantization], autotuning_note=autotuning_off_note(precision, env) or "")

    def describe(self) -> str:
        """The run header's words: the dtype, and the FP8 recipe where FP8 is on."""
        return self.dtype + (f" with FP8 GEMMs ({self.fp8.describe()})" if self.fp8 else "")


def compiler_options(precision: PrecisionConfig, env=os.environ) -> dict:
    """The train step's XLA options: FP8_COMPILER_OPTIONS in FP8 (less what XLA_FLAGS sets), else none."""
    return unless_in_xla_flags(FP8_COMPILER_OPTIONS, env) if precision.fp8 else {}


def autotuning_off_note(precision: PrecisionConfig, env=os.environ) -> str | None:
    """A line for the run's header when XLA_FLAGS turns GEMM autotuning off under FP8: XLA then chose no FP8 GEMM,
    and the 1.3B step ran at 0.05x (one H100, docs/performance.md)."""
    if precision.fp8 and re.search(r"--xla_gpu_autotune_level=0(\s|$)", env.get("XLA_FLAGS", "")):
        return ("jax3d: XLA_FLAGS sets --xla_gpu_autotune_level=0, with which XLA picks no FP8 GEMM and the FP8 "
                "step runs about 20x slower on a GPU; drop it (jax3d compiles FP8 steps at level 3)")
    return None


def without_fp8(devices) -> str:
    """The compute capability of `devices`' GPUs where they lack FP8 (below 8.9), else "": FP8 GPUs, CPUs (which
    emulate the f8 types, for tests) and GPUs other than CUDA's (ROCm names its architecture: XLA decides)."""
    if not devices or devices[0].platform != "gpu":
        return ""
    cc = str(getattr(devices[0], "compute_capability", ""))
    try:
        have = tuple(int(p) for p in cc.split(".")[:2])
    except ValueError:
        return ""
    return "" if have >= FP8_COMPUTE_CAPABILITY else cc


def fp8_device_error(precision: PrecisionConfig, devices) -> str:
    """Why FP8 can't run on `devices` (GPUs without FP8 tensor cores), or "". CPUs emulate the f8 types (tests)."""
    cc = without_fp8(devices) if precision.fp8 else ""
    if not cc:
        return ""
    return (f"--fp8-{precision.fp8} needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper) and this "
            f"{devices[0].device_kind} has {cc}; drop the --fp8-* flags")


def generation_device_error(fp8_cache: bool, fp8_weights: bool, devices) -> str:
    """Why generation's fp8 KV cache or fp8 weights can't run on `devices`, or "". The decode kernel's fp8
    conversions are Triton's, which wants FP8 hardware; XLA's are untried."""
    fp8 = {what: flag for what, flag, on in (("KV cache", "--kv-cache-dtype fp8", fp8_cache),
                                             ("weights", "--quantization fp8", fp8_weights)) if on}
    cc = without_fp8(devices) if fp8 else ""
    if not cc:
        return ""
    flags, verb = " and ".join(fp8.values()), "is" if list(fp8) == ["KV cache"] else "are"
    return (f"jax3d's fp8 {' and '.join(fp8)} ({flags}) {verb} built for GPUs with FP8 (compute capability 8.9 or "
            f"later: Ada, Hopper) and this {devices[0].device_kind} has {cc}; drop {flags}")
