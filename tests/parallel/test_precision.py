"""The precision policy (jax3d.parallel.precision) against the decisions the code made before it, one place each
(the train step's dtype table, the state's loss-scale rule, the FP8 recipe and compiler options, the plan's device
check, generation's cache and weight dtypes), for every combination the flags allow; and a guard that no module
outside jax3d/parallel/precision.py decides precision from PrecisionConfig's strings again."""
import itertools
import os
import re
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.config import ConfigError, PrecisionConfig
from jax3d.parallel.precision import (FP8_COMPILER_OPTIONS, LossScaling, PrecisionPolicy, Recipe, dtype_of_flags,
                                      fp8_device_error)
from jax3d.train.state import initial_loss_scale, update_loss_scale
from tests.helpers import ROOT

# ---- the decisions as the code made them before the policy (jax3d/train/step.py, state.py, fp8.py, plan.py) ----

_OLD_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _old_initial_scale(p):
    return 1.0 if p.dtype != "float16" else p.loss_scale or p.initial_loss_scale


def _old_update(scale, good, hyst, finite, p):
    """The dynamic rule as train/state.py wrote it against PrecisionConfig, in plain Python."""
    if p.dtype != "float16" or p.loss_scale:
        return scale, good, hyst
    good = good + 1 if finite else 0
    hyst = hyst if finite else hyst - 1
    if not finite and hyst <= 0:
        scale = max(scale / 2, p.min_loss_scale)
    if good >= p.loss_scale_window:
        scale, hyst, good = scale * 2, p.hysteresis, 0
    else:
        hyst = max(hyst, 0)
    return scale, good, hyst


def _old_recipe(p):
    return None if not p.fp8 else (p.fp8, p.fp8_margin, p.fp8_amax_history_len, p.fp8_amax_compute_algo)


def _old_compiler_options(p, env):
    return {k: v for k, v in FP8_COMPILER_OPTIONS.items() if k not in env.get("XLA_FLAGS", "")} if p.fp8 else {}


def _old_header(p):
    note = (f" with FP8 GEMMs ({p.fp8}, amax {p.fp8_amax_compute_algo} of {p.fp8_amax_history_len}, margin "
            f"{p.fp8_margin})") if p.fp8 else ""
    return p.dtype + note


def _precisions():
    """Every PrecisionConfig the flags allow, over dtype, loss scaling and the FP8 recipe."""
    for dtype, loss_scale, fp8, (margin, history, algo), scaling in itertools.product(
            ("float32", "bfloat16", "float16"), (0.0, 1024.0), ("", "hybrid", "e4m3"),
            ((0, 1, "most_recent"), (2, 16, "max")),
            ({}, {"initial_loss_scale": 2.0**16, "loss_scale_window": 3, "hysteresis": 1, "min_loss_scale": 4.0})):
        if fp8 and dtype == "float16":
            continue  # refused by PrecisionConfig
        if not fp8 and (margin, history, algo) != (0, 1, "most_recent"):
            continue  # the recipe flags mean nothing without FP8
        yield PrecisionConfig(dtype=dtype, loss_scale=loss_scale, fp8=fp8, fp8_margin=margin,
                              fp8_amax_history_len=history, fp8_amax_compute_algo=algo, **scaling)


PRECISIONS = list(_precisions())


def test_the_combinations_cover_every_mode():
    modes = {(p.dtype, LossScaling.of(p).mode, p.fp8) for p in PRECISIONS}
    assert {m for _, m, _ in modes} == {"none", "static", "dynamic"}
    assert ("bfloat16", "none", "hybrid") in modes and ("float32", "none", "e4m3") in modes
    assert len(PRECISIONS) == 12 + 32  # 3 dtypes x 2 x 2 loss scalings; FP8 (not fp16): 2 x 2 x 2 formats x 2 x 2


@pytest.mark.parametrize("env", [{}, {"XLA_FLAGS": "--xla_gpu_autotune_level=4"},
                                 {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}])
def test_the_policy_decides_what_the_code_decided(env):
    for p in PRECISIONS:
        policy = PrecisionPolicy.of(p, env=env)
        assert policy.compute_dtype is _OLD_DTYPES[p.dtype], p
        assert policy.dtype == p.dtype
        recipe = policy.fp8
        assert (None if recipe is None else (recipe.format, recipe.margin, recipe.history, recipe.algorithm)) == \
            _old_recipe(p), p
        assert policy.compiler_options == _old_compiler_options(p, env), p
        assert policy.describe() == _old_header(p)
        off = bool(p.fp8) and env.get("XLA_FLAGS") == "--xla_gpu_autotune_level=0"
        assert bool(policy.autotuning_note) == off
        assert policy.cache_dtype == jnp.dtype(_OLD_DTYPES[p.dtype]) and policy.weight_dtype is None
        assert hash(policy) == hash(PrecisionPolicy.of(p, env=env))  # a frozen plan can hold it


def test_the_loss_scale_follows_the_old_rule_step_by_step():
    """The state's initial loss scale and its update (now from LossScaling) against the rule as it read
    PrecisionConfig, over a run of overflows and good steps, for every combination."""
    pattern = [False, False, True, True, True, True, False, True, True, True, True, True, False, False, False]
    for p in PRECISIONS:
        scaling = LossScaling.of(p)
        assert scaling.dynamic == (p.dtype == "float16" and not p.loss_scale)
        ls = initial_loss_scale(scaling)
        want = (_old_initial_scale(p), 0, p.hysteresis)
        assert (float(ls.scale), int(ls.good_steps), int(ls.hysteresis)) == want, p
        skipped = 0
        for finite in pattern:
            ls = update_loss_scale(ls, jnp.bool_(finite), scaling)
            want = _old_update(*want, finite, p)
            skipped += not finite
            assert (float(ls.scale), int(ls.good_steps), int(ls.hysteresis), int(ls.skipped)) == (*want, skipped), p


def test_the_recipe_moved_whole():
    """Recipe.of is the policy's fp8 field; its scales are its definition's (test_fp8 checks the history)."""
    p = PrecisionConfig(dtype="bfloat16", fp8="hybrid", fp8_margin=1, fp8_amax_history_len=2)
    r = PrecisionPolicy.of(p).fp8
    assert r == Recipe.of(p) == Recipe("hybrid", 1, 2, "most_recent")
    h = r.update(r.init({"a": np.zeros((3,), np.float32)}), {"a": jnp.asarray([448.0, 100.0, 57344.0])})
    np.testing.assert_array_equal(r.scales(h)["a"], [2.0, 0.5, 2.0])  # x 2**margin / (448, 448, 57344), rounded up


def test_the_device_check_and_its_sentence():
    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100")
    cpu = SimpleNamespace(platform="cpu", device_kind="cpu")
    for fmt in ("hybrid", "e4m3"):
        p = PrecisionConfig(dtype="bfloat16", fp8=fmt)
        sentence = (f"--fp8-{fmt} needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper) and this "
                    "NVIDIA A100-SXM4-80GB has 8.0; drop the --fp8-* flags")
        assert fp8_device_error(p, [a100]) == sentence
        with pytest.raises(ConfigError) as e:
            PrecisionPolicy.of(p, [a100])
        assert str(e.value) == sentence
        assert PrecisionPolicy.of(p, [h100]).fp8.format == fmt and PrecisionPolicy.of(p, [cpu]).fp8.format == fmt
    assert PrecisionPolicy.of(PrecisionConfig(dtype="bfloat16"), [a100]).fp8 is None
    with pytest.raises(ConfigError, match=r"^jax3d's fp8 KV cache and weights \(--kv-cache-dtype fp8 and "
                                          r"--quantization fp8\) are built for GPUs with FP8 .* this NVIDIA "
                                          r"A100-SXM4-80GB has 8.0; drop --kv-cache-dtype fp8 and --quantization fp8$"):
        PrecisionPolicy.of(PrecisionConfig(), [a100], kv_cache_dtype="fp8", quantization="fp8")
    PrecisionPolicy.of(PrecisionConfig(), [h100], kv_cache_dtype="fp8", quantization="fp8")


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("kv, quant", itertools.product(("auto", "fp8"), ("none", "fp8")))
def test_generation_dtypes_are_the_old_tables(bf16, kv, quant):
    """cli/generate took `jnp.bfloat16 if --bf16 else jnp.float32`; the KV cache kept the compute dtype unless
    --kv-cache-dtype fp8 (e4m3), and the weights theirs unless --quantization fp8 (e4m3): the policy gives the same."""
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    policy = PrecisionPolicy.of(PrecisionConfig(dtype=dtype_of_flags(bf16)), kv_cache_dtype=kv, quantization=quant)
    assert policy.compute_dtype is dtype
    assert policy.cache_dtype == jnp.dtype(jnp.float8_e4m3fn if kv == "fp8" else dtype)
    assert policy.weight_dtype == (jnp.float8_e4m3fn if quant == "fp8" else None)


@pytest.mark.parametrize("flags, dtype, mode, initial", [
    ([], "float32", "none", 1.0),
    (["--bf16"], "bfloat16", "none", 1.0),
    (["--fp16"], "float16", "dynamic", 2.0**32),
    (["--fp16", "--initial-loss-scale", "65536"], "float16", "dynamic", 65536.0),
    (["--fp16", "--loss-scale", "128"], "float16", "static", 128.0),
])
def test_precision_flags_reach_the_policy(flags, dtype, mode, initial):
    from jax3d.cli.train_flags import build_parser, config_from_args

    cfg = config_from_args(build_parser().parse_args(["--preset", "gpt-tiny", *flags]))
    policy = PrecisionPolicy.of(cfg.precision)
    assert (policy.dtype, policy.compute_dtype, policy.loss_scaling.mode, policy.loss_scaling.initial) == \
        (dtype, _OLD_DTYPES[dtype], mode, initial)


def test_the_train_step_reads_the_policy():
    """build_steps carries the plan's policy, which it built its step with; the state starts at its loss scale."""
    from jax3d.parallel.plan import Plan
    from jax3d.train.step import abstract_state, build_steps
    from tests.helpers import tiny_config

    cfg, mesh_cfg, mesh = tiny_config(model_kw={"num_layers": 1})
    plan = Plan(cfg.replace(precision={"dtype": "float16", "loss_scale": 512.0}), mesh_cfg)
    steps = build_steps(plan, mesh)
    assert steps.precision is plan.precision
    assert steps.precision == PrecisionPolicy.of(PrecisionConfig(dtype="float16", loss_scale=512.0))
    assert steps.precision.loss_scaling.mode == "static"
    assert float(steps.new_run_parts()["loss_scale"].scale) == 512.0
    assert abstract_state(steps).fp8 is None


# ---- the guard ---------------------------------------------------------------------------------------------------

# Ways of deciding precision from PrecisionConfig's strings, which only jax3d/parallel/precision.py does now.
_REDECISIONS = {
    "a table of compute dtypes": r"DTYPES\s*=\s*\{\s*[\"']float32",
    "a dtype looked up from the config": r"DTYPES\[[^\]]*precision",
    "a dtype made from the config's string": r"jnp\.dtype\([^)]*precision",
    "a compute dtype picked from a flag": r"jnp\.(bfloat16|float16|float32) if\b",
    "a rule from the dtype's name": r"precision\.dtype\s*(==|!=|in\b)",
    "the FP8 recipe read field by field": r"precision\.fp8_(margin|amax_history_len|amax_compute_algo)\b",
    "the loss scaling read field by field": r"precision\.(loss_scale|initial_loss_scale|loss_scale_window|"
                                            r"hysteresis|min_loss_scale)\b",
    "the recipe built again": r"\bRecipe\.of\(",
}


def _grep(pattern, skip):
    found = []
    for d, _, files in os.walk(os.path.join(ROOT, "jax3d")):
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), ROOT)
            if f.endswith(".py") and not rel.startswith(skip):
                found += [f"{rel}:{n}: {line.strip()}" for n, line in enumerate(open(os.path.join(d, f)), 1)
                          if re.search(pattern, line)]
    return found


def test_precision_is_decided_only_in_the_policy():
    """Outside jax3d/parallel/precision.py (and the config and command line, which map flags onto PrecisionConfig),
    no module turns PrecisionConfig's strings into a dtype, a loss-scale rule or an FP8 recipe."""
    skip = ("jax3d/parallel/precision.py", "jax3d/config.py", "jax3d/cli/")
    for what, pattern in _REDECISIONS.items():
        assert _grep(pattern, skip) == [], what
    assert _grep(r"jnp\.(bfloat16|float16) if\b|DTYPES\[[^\]]*precision", ("jax3d/parallel/precision.py",)) == []


def test_the_guard_sees_what_it_forbids():
    found = [what for what, pattern in _REDECISIONS.items() if re.search(pattern, {
        "a table of compute dtypes": 'DTYPES = {"float32": jnp.float32}',
        "a dtype looked up from the config": "dtype = DTYPES[cfg.precision.dtype]",
        "a dtype made from the config's string": "jnp.dtype(cfg.precision.dtype)",
        "a compute dtype picked from a flag": "dtype = jnp.bfloat16 if a.bf16 else jnp.float32",
        "a rule from the dtype's name": 'if precision.dtype != "float16":',
        "the FP8 recipe read field by field": "h = cfg.precision.fp8_amax_history_len",
        "the loss scaling read field by field": "scale = precision.loss_scale or precision.initial_loss_scale",
        "the recipe built again": "recipe = Recipe.of(cfg.precision)"}[what])]
    assert found == list(_REDECISIONS)
    assert [hit.split(":")[0] for hit in _grep(_REDECISIONS["a table of compute dtypes"], ())] == \
        ["jax3d/parallel/precision.py"]
