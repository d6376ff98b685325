"""FP8 training (jax3d.models.fp8, jax3d.parallel.precision.Recipe, jax3d.train.fp8) on the CPU, where XLA emulates
the f8 types: the amax history against its definition, the same curve on every layout, bit-exact resume and restore
onto another layout, the GEMM pattern XLA's GPU rewriter needs in the step lowered for CUDA, and the flags'
refusals."""
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.checkpoint.checkpointer import Checkpointer
from jax3d.cli.train import main
from jax3d.config import ConfigError, PrecisionConfig
from jax3d.models import fp8
from jax3d.parallel.precision import Recipe, fp8_device_error
from jax3d.train.step import abstract_batch, abstract_state, build_steps
from tests.checkpoint import test_checkpoint
from tests.helpers import tiny_config
from tests.checkpoint.test_checkpoint import GB
from tests.checkpoint.test_checkpoint import host_batch as random_batch
from tests.train.test_llama_layouts import LLAMA, counting_batch
from jax3d.parallel.plan import Plan

FP8 = {"fp8": "hybrid", "fp8_amax_history_len": 4, "fp8_amax_compute_algo": "max"}
# Layouts that sum in another order differ in the last fp32 bit; FP8 rounds some of those values to neighbouring
# e4m3 / e5m2 codes (an eighth or a quarter apart), and AdamW's early, nearly sign-sized updates carry that into
# the weights. Measured over 10 steps at lr 3e-3: 2.0e-4 to 1.2e-3 with FP8 (dots of f8 arrays, power-of-two scales;
# 8.9e-4 to 1.6e-3 with the dequantized dots before), and 6e-4 to 1.9e-3 for the same layouts
# computing in bf16 without FP8 (1e-6 in fp32). On an AMD EPYC CPU (another summation order in XLA's CPU code)
# the four layouts below measured 2.3e-3 to 3.3e-3 with FP8. The first two steps, before the weights part, agree
# to round-off.
CURVE_TOL, FIRST_STEPS_TOL = 5e-3, 1e-5
LAYOUTS = {
    "222-1f1b-zero1": ((2, 2, 2, 1), {}),
    "124-zbh1": ((1, 2, 4), dict(pipeline_schedule="zb-h1")),
    "412-zero3-sp": ((4, 1, 2, 3), dict(sequence_parallel=True)),
    "111-accumulate8": ((1, 1, 1), {}),
}


def fp8_layout(data, stage, model, zero=0, precision=FP8, **parallel):
    """A 4-layer tiny GPT with FP8 GEMMs on one layout, micro-batch 2 of a global batch of 16."""
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, zero=zero, micro=2, global_batch=GB,
                                      model_kw={"num_layers": 4}, **parallel)
    return cfg.replace(precision=precision, optim={"lr": 3e-3, "min_lr": 3e-4}, train={"train_iters": 20}), \
        mesh_cfg, mesh


@pytest.fixture(scope="module", autouse=True)
def counting_batches():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(test_checkpoint, "host_batch", counting_batch)
        yield


def curve(cfg, mesh_cfg, mesh, steps=10):
    """(losses, the logical FP8 history after the first step, after the last)."""
    s = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = s.init_state(cfg.train.seed)
    first, state = test_checkpoint.train(s, state, 0, 1)
    after_one = jax.device_get(s.logical_state(state).fp8)
    rest, state = test_checkpoint.train(s, state, 1, steps)
    return np.concatenate([first, rest]), after_one, jax.device_get(s.logical_state(state).fp8)


# ---- the definitions ----------------------------------------------------------------------------------------------

def test_quantized_gemm_and_its_amaxes_by_hand():
    """One GEMM: x and w rounded to e4m3 codes at their scales, g to e5m2; the scales' "gradient" is the three
    amaxes; the product and both input gradients are those of the rounded operands."""
    x = jnp.array([[1.1, -3.0], [0.26, 2.0]], jnp.float32)  # at scale 1: e4m3 codes 1.125, -3, 0.25, 2
    w = jnp.array([[0.5, 1.3], [2.2, -0.7]], jnp.float32)  # at scale 2: 0.25, 0.625 (0.65 rounds), 1.125, -0.34375
    g = jnp.array([[1.1, 0.3], [-2.9, 1.0]], jnp.float32)  # e5m2 at scale 1: 1.0, 0.3125, -3.0, 1.0
    scales = jnp.array([1.0, 2.0, 1.0])
    y, pullback = jax.vjp(lambda x, w, s: fp8.einsum("td,df->tf", x, w, s, "hybrid"), x, w, scales)
    xq = jnp.array([[1.125, -3.0], [0.25, 2.0]])
    wq = 2.0 * jnp.array([[0.25, 0.625], [1.125, -0.34375]])
    gq = jnp.array([[1.0, 0.3125], [-3.0, 1.0]])
    np.testing.assert_array_equal(y, xq @ wq)
    dx, dw, observed = pullback(g)
    np.testing.assert_array_equal(dx, gq @ wq.T)
    np.testing.assert_array_equal(dw, xq.T @ gq)
    np.testing.assert_array_equal(observed, np.float32([3.0, 2.2, 2.9]))


def test_amax_history_is_its_definition():
    """History entry i is the amax of i steps ago; the scale is amax x 2**margin / the format's largest value, of
    the latest amax or the history's max, rounded up to a power of two, and 1 while no positive finite amax is
    there."""
    top = np.array([448.0, 448.0, 57344.0])
    leaf = jax.ShapeDtypeStruct((2, 3), jnp.float32)  # (layers, x / w / g)
    seen = [np.full((2, 3), v, np.float32) * np.array([[1.0], [2.0]], np.float32) for v in (5.0, 7.0, 3.0, 4.0)]
    for algorithm in ("most_recent", "max"):
        r = Recipe("hybrid", margin=1, history=3, algorithm=algorithm)
        h = r.init({"a": leaf})
        np.testing.assert_array_equal(r.scales(h)["a"], np.ones((2, 3)))
        for a in seen:
            h = r.update(h, {"a": jnp.asarray(a)})
        np.testing.assert_array_equal(h["a"], np.stack([seen[3], seen[2], seen[1]], -1))  # the first one dropped
        ref = seen[3] if algorithm == "most_recent" else np.maximum(np.maximum(seen[1], seen[2]), seen[3])
        np.testing.assert_array_equal(r.scales(h)["a"], 2.0 ** np.ceil(np.log2(ref * 2.0 / top)))
    r = Recipe("e4m3", history=1)
    h = r.update(r.init({"a": leaf}), {"a": jnp.asarray([[0.0, np.inf, 8.96], [1.0, np.nan, 448.0]])})
    # 8.96 / 448 = 0.02 -> 2**-5; 1 / 448 -> 2**-8; 448 / 448 = 1 exactly, a power of two already
    np.testing.assert_array_equal(r.scales(h)["a"], [[1.0, 1.0, 2.0 ** -5], [2.0 ** -8, 1.0, 1.0]])


@pytest.mark.parametrize("model_kw, recompute", [({}, "none"), ({}, "selective"), ({}, "full"),
                                                ({"model_type": "bert"}, "none"),
                                                ({**LLAMA, "num_layers": 2}, "none")])
def test_fp8_steps_track_the_plain_steps(model_kw, recompute, monkeypatch):
    """Five steps of GPT, BERT and Llama, under each recompute policy: FP8 stays within quantization's reach of the
    plain fp32 step (a NaN, or a GEMM left unscaled, would not)."""
    monkeypatch.setattr(test_checkpoint, "host_batch", random_batch)  # BERT's batches too
    curves = {}
    for precision in ({}, FP8):
        cfg, mesh_cfg, mesh = tiny_config(data=8, micro=2, global_batch=GB,
                                          model_kw={**model_kw, "recompute": recompute})
        s = build_steps(Plan(cfg.replace(precision=precision, optim={"lr": 3e-3}), mesh_cfg), mesh)
        curves[bool(precision)], _ = test_checkpoint.train(s, s.init_state(0), 0, 5)
    np.testing.assert_allclose(curves[True], curves[False], rtol=0, atol=2e-2)


# ---- layouts ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    return curve(*fp8_layout(8, 1, 1))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_same_fp8_curve(reference, name):
    """The amaxes of the first step (taken with max over micro-batches, data shards, tensor shards and stages)
    agree to fp32 round-off on every layout, so every layout quantizes with the same scales; the curves agree as
    CURVE_TOL says. 8 micro-batches summed would give 8x the amaxes, not the same."""
    args, parallel = LAYOUTS[name]
    losses, after_one, _ = curve(*fp8_layout(*args, **parallel))
    ref_losses, ref_one, _ = reference
    assert ref_losses[-1] < ref_losses[0] - 0.3  # it learns
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, err_msg=name), after_one, ref_one)
    np.testing.assert_allclose(losses[:2], ref_losses[:2], rtol=0, atol=FIRST_STEPS_TOL, err_msg=name)
    print(name, "max |loss - reference|", np.abs(losses - ref_losses).max(), flush=True)
    np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=CURVE_TOL, err_msg=name)


# ---- checkpoints ------------------------------------------------------------------------------------------------------

def run_and_save(tmp_path_factory, cfg, mesh_cfg, mesh, name):
    """20 steps, saving step 10: the losses, and the logical state's params and FP8 history at steps 10 and 20."""
    d = str(tmp_path_factory.mktemp(name))
    cfg = cfg.replace(train={"save": d, "save_interval": 10})
    s = build_steps(Plan(cfg, mesh_cfg), mesh)
    ck = Checkpointer(cfg, to_logical=s.logical_state)
    l1, state = test_checkpoint.train(s, s.init_state(cfg.train.seed), 0, 10, ck)
    ck.wait()
    at_10 = jax.device_get(s.logical_state(state).fp8)
    l2, state = test_checkpoint.train(s, state, 10, 20, ck)
    ck.wait()
    end = jax.device_get(s.logical_state(state))
    return {"dir": d, "losses": np.concatenate([l1, l2]), "fp8_10": at_10, "params": end.params, "fp8": end.fp8}


def restored(ref, cfg, mesh_cfg, mesh):
    """(the steps, the state restored from step 10 of `ref` onto this layout)."""
    cfg = cfg.replace(train={"load": ref["dir"], "ckpt_step": 10})
    s = build_steps(Plan(cfg, mesh_cfg), mesh)
    state, _ = Checkpointer(cfg).restore(s)
    return s, state


@pytest.mark.slow
def test_fp8_resume_is_bit_exact_and_restores_onto_another_layout(tmp_path_factory):
    layout = fp8_layout(2, 2, 2, zero=1, pipeline_schedule="interleaved", layers_per_virtual_stage=1)
    ref = run_and_save(tmp_path_factory, *layout, "fp8_ref")
    s, state = restored(ref, *layout)
    losses, state = test_checkpoint.train(s, state, 10, 20)
    np.testing.assert_array_equal(losses, ref["losses"][10:])
    end = jax.device_get(s.logical_state(state))
    jax.tree.map(np.testing.assert_array_equal, end.params, ref["params"])
    jax.tree.map(np.testing.assert_array_equal, end.fp8, ref["fp8"])
    # Onto ZB-H1 over tensor parallelism 4: the history arrives as saved (in logical layer order).
    s, state = restored(ref, *fp8_layout(1, 2, 4, pipeline_schedule="zb-h1"))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(s.logical_state(state).fp8), ref["fp8_10"])
    assert np.any(jax.tree.leaves(ref["fp8_10"])[0] > 0)
    # Without FP8 the histories are left unread; with another history length they start empty.
    s, state = restored(ref, *fp8_layout(8, 1, 1, precision={}))
    assert state.fp8 is None and np.isfinite(test_checkpoint.train(s, state, 10, 11)[0]).all()
    s, state = restored(ref, *fp8_layout(8, 1, 1, precision={**FP8, "fp8_amax_history_len": 2}))
    assert all(not np.any(a) for a in jax.tree.leaves(jax.device_get(state.fp8)))


# ---- the GPU program ------------------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?([\w.\-]+) = (\S+?)(?:\[[^\]]*\])?(?:\{[^}]*\})? ([\w\-]+)\((.*)$")
_PASS_THROUGH = ("transpose", "reshape", "bitcast", "copy", "all-gather")  # what the GEMM rewriter looks through


def fp8_dots(hlo: str) -> list[tuple[str, str]]:
    """The f8 formats of both operands of every dot whose operands are each an f8 array, possibly through
    transposes, reshapes, bitcasts, copies or all-gathers: what XLA's GPU compiler runs as an FP8 GEMM
    (cuBLASLt's, or Triton's with f8 operands)."""
    defs = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            name, dtype, op, rest = m.groups()
            defs[name] = (dtype, op, re.findall(r"%?([\w.\-]+)(?=[,)])", rest.split("), ")[0] + ")"))

    def f8_source(name):
        while name in defs and defs[name][1] in _PASS_THROUGH:
            name = defs[name][2][0]
        dtype = defs.get(name, ("",))[0]
        return dtype if dtype.startswith("f8") else None

    out = []
    for dtype, op, args in defs.values():
        if op == "dot":
            fmts = [f8_source(a) for a in args[:2]]
            if all(fmts):
                out.append(tuple(fmts))
    return out


@pytest.mark.parametrize("model_kw", [{}, LLAMA], ids=["gpt", "llama"])
def test_the_step_lowered_for_cuda_has_fp8_gemms(model_kw):
    """The one-device bf16 step with --fp8-hybrid, lowered for CUDA: each layer's QKV, attention-out, MLP-up (with
    SwiGLU's gate) and MLP-down GEMMs, forward and both backward ones, are dots of f8 arrays (e4m3 x e4m3
    forward, e5m2 with e4m3 backward); with FP8 off, none is."""
    layers = 2

    def lowered(precision):
        cfg, mesh_cfg, mesh = tiny_config(model_kw={**model_kw, "num_layers": layers})
        s = build_steps(Plan(cfg.replace(precision=precision), mesh_cfg), mesh)
        batch = abstract_batch(s, s.model.sample_shapes())
        with jax.set_mesh(s.mesh):
            return s.train_step.fn.trace(abstract_state(s), batch).lower(lowering_platforms=("cuda",))

    hlo = lowered({"dtype": "bfloat16", "fp8": "hybrid"}).as_text(dialect="hlo")
    dots = fp8_dots(hlo)
    e4, e5 = "f8e4m3fn", "f8e5m2"
    assert sorted(dots).count((e4, e4)) == 4 * layers
    assert len([d for d in dots if sorted(d) == sorted((e4, e5))]) == 8 * layers
    assert len(dots) == 12 * layers
    assert fp8_dots(lowered({"dtype": "bfloat16"}).as_text(dialect="hlo")) == []


def test_the_fp8_step_compiles_with_its_xla_options_unless_xla_flags_set_them(monkeypatch):
    """FP8's train step is compiled with FP8_COMPILER_OPTIONS; bf16's step, and FP8's evaluation (the plain
    model), with none; XLA_FLAGS naming an option wins. An option XLA does not know, put in its place, fails
    the FP8 train step's compile and no other."""
    from jax3d.parallel import precision as recipe

    fp8_on, off = PrecisionConfig(dtype="bfloat16", fp8="hybrid"), PrecisionConfig(dtype="bfloat16")
    assert recipe.compiler_options(fp8_on, {}) == recipe.FP8_COMPILER_OPTIONS
    assert recipe.compiler_options(off, {}) == {}
    assert recipe.compiler_options(fp8_on, {"XLA_FLAGS": "--xla_gpu_autotune_level=4"}) == {}
    monkeypatch.setattr(recipe, "FP8_COMPILER_OPTIONS", {"xla_not_an_option": 3})

    def steps(precision):
        cfg, mesh_cfg, mesh = tiny_config(model_kw={"num_layers": 1})
        s = build_steps(Plan(cfg.replace(precision=precision), mesh_cfg), mesh)
        return s, abstract_state(s), abstract_batch(s, s.model.sample_shapes())

    s, state, batch = steps({"dtype": "bfloat16"})
    with jax.set_mesh(s.mesh):
        s.train_step.fn.lower(state, batch).compile()
    s, state, batch = steps({"dtype": "bfloat16", "fp8": "hybrid"})
    with jax.set_mesh(s.mesh):
        s.eval_step.fn.lower(state.params, batch).compile()
        with pytest.raises(Exception, match="xla_not_an_option"):
            s.train_step.fn.lower(state, batch).compile()


# ---- flags --------------------------------------------------------------------------------------------------------

BASE = ["--preset", "gpt-tiny", "--train-iters", "1", "--seq-length", "32", "--bf16"]


@pytest.mark.parametrize("flags, says", [
    (["--fp8-hybrid", "--fp8-interval", "4"], "--fp8-interval 4 asks for FP8 scales updated less often than every "
                                              "step, which jax3d does not build; pass 1"),
    (["--fp8-hybrid", "--fp8-e4m3"], "--fp8-hybrid and --fp8-e4m3 ask for two FP8 formats; pass one"),
    (["--fp8-hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be at least 1"),
    (["--fp8-hybrid", "--no-fp8-wgrad"], "--no-fp8-wgrad asks for weight-gradient GEMMs in bf16 under FP8"),
])
def test_fp8_flags_refused_in_one_sentence(flags, says, tmp_path, capsys):
    assert main([*BASE, *flags, "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0] and "Traceback" not in err


def test_fp8_needs_fp8_tensor_cores():
    precision = PrecisionConfig(dtype="bfloat16", fp8="hybrid")
    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    assert fp8_device_error(precision, [a100]) == (
        "--fp8-hybrid needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper) and this NVIDIA "
        "A100-SXM4-80GB has 8.0; drop the --fp8-* flags")
    for ok in (SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100"),
               SimpleNamespace(platform="cpu", device_kind="cpu")):
        assert fp8_device_error(precision, [ok]) == ""
    assert fp8_device_error(PrecisionConfig(dtype="bfloat16"), [a100]) == ""
    with pytest.raises(ConfigError, match="not --fp16 and its loss scaling; pass --bf16 instead of --fp16$"):
        PrecisionConfig(dtype="float16", fp8="hybrid")
    with pytest.raises(ConfigError, match="^--fp8-amax-compute-algo 'mean' must be most_recent or max$"):
        PrecisionConfig(fp8="e4m3", fp8_amax_compute_algo="mean")


def test_fp8_with_gemm_autotuning_off_gets_a_line_in_the_header(monkeypatch, capsys):
    """XLA_FLAGS=--xla_gpu_autotune_level=0 made XLA pick no FP8 GEMM (0.05x on an H100): the header says so."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert main([*BASE, "--fp8-hybrid", "--dry-run"]) == 0
    assert "sets --xla_gpu_autotune_level=0, with which XLA picks no FP8 GEMM" in capsys.readouterr().err
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=3")
    assert main([*BASE, "--fp8-hybrid", "--dry-run"]) == 0
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert main([*BASE, "--dry-run"]) == 0
    assert "autotune_level" not in capsys.readouterr().err


def test_dry_run_compiles_the_fp8_step(capsys):
    assert main([*BASE, "--fp8-hybrid", "--dry-run"]) == 0
    report = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")][-1]
    assert '"fp8": "hybrid"' in report and '"peak"' in report


def test_fp8_flags_reach_the_config():
    from jax3d.cli.train_flags import build_parser, config_from_args
    a = build_parser().parse_args([*BASE, "--fp8-e4m3", "--fp8-margin", "2", "--fp8-amax-history-len", "16",
                                   "--fp8-amax-compute-algo", "max", "--transformer-impl", "transformer_engine"])
    p = config_from_args(a).precision
    assert (p.fp8, p.fp8_margin, p.fp8_amax_history_len, p.fp8_amax_compute_algo) == ("e4m3", 2, 16, "max")
    assert config_from_args(build_parser().parse_args(BASE)).precision.fp8 == ""
