"""jax3d.kernels.row_gemv (one row times a weight stored as rows, with the norm before and the epilogue after, in
one kernel) against its unfused reference, and jax3d.inference.decode_rows (a block's decode step at batch 1 in
those kernels) against the Generator's tokens without them."""
import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.config import ModelConfig
from jax3d import kernels as registry
from jax3d.inference import decode_rows, generate
from jax3d.inference.cached_attention import decode_spec
from jax3d.inference.generate import Generator
from jax3d.kernels import KERNELS, decode_attention, row_gemv
from jax3d.kernels.policy import KernelPolicy
from jax3d.models import build_model, get_preset, layers, quantized
from jax3d.parallel import MeshConfig


def on_one_gpu(**kw) -> KernelPolicy:
    """One GPU's decode kernels, traced on this CPU (the train step's kernels left out: the Generator's prefill
    would run them)."""
    policy = KernelPolicy.resolve("gpu", 1, off=KERNELS + tuple(kw.pop("off", ())), **kw)
    return dataclasses.replace(policy, platform="cpu", attention="xla")

VARIANTS = {  # weight shape, contracted dims, activation
    "qkv": ((128, 3, 2, 32), (0,), None),
    "out": ((4, 32, 128), (0, 1), None),
    "up-gelu": ((128, 256), (0,), "gelu_tanh"),
    "up-swiglu": ((128, 2, 96), (0,), "swiglu"),
}


# each with the outputs a program computes: 4 (bf16's default), 8 (fp8's default, and bf16's at
# `--tune row_gemv:rows=8`) and 16 (`--tune row_gemv:rows=16`, fp8's at rows=8)
CASES = [("qkv", False, "layer", jnp.bfloat16, 8), ("qkv", True, "rms", jnp.float32, 16),
         ("out", False, "none", jnp.float32, 4), ("out", True, "none", jnp.bfloat16, 8),
         ("up-gelu", False, "layer", jnp.bfloat16, 16), ("up-gelu", True, "layer", jnp.float32, 4),
         ("up-swiglu", False, "rms", jnp.bfloat16, 4), ("up-swiglu", True, "rms", jnp.float32, 16)]


@pytest.mark.parametrize("variant, fp8, norm, dtype, rows", CASES,
                         ids=[f"{v}-{'fp8' if q else 'rows'}-{n}-{jnp.dtype(d).name}-{r}" for v, q, n, d, r in CASES])
def test_the_kernel_is_its_unfused_reference(variant, fp8, norm, dtype, rows):
    """Pallas' interpreter against row_gemv_reference, whose rounding is the unfused path's: the layer norm or
    RMSNorm before, the bias, GELU or SwiGLU and the residual add after, each rounded to the row's dtype; the
    weight as rows (no scale) or in fp8 with a scale per output; 4, 8 or 16 outputs a program. The contracted dim
    is walked in 4 blocks."""
    shape, contracted, activation = VARIANTS[variant]
    ks = jax.random.split(jax.random.key(0), 6)
    w = quantized.quantize((jax.random.normal(ks[0], shape) * 0.1).astype(dtype), contracted,
                           quantized.E4M3 if fp8 else None)
    k = int(np.prod([shape[i] for i in contracted]))
    x = jax.random.normal(ks[1], (k,)).astype(dtype)
    norms = {"none": None,
             "layer": row_gemv.Norm(jax.random.normal(ks[2], (k,)).astype(dtype),
                                    jax.random.normal(ks[3], (k,)).astype(dtype), 1e-5),
             "rms": row_gemv.Norm((1 + jax.random.normal(ks[2], (k,)) * 0.1).astype(dtype), None, 1e-6)}
    outputs = w.values.shape[:w.values.ndim - len(contracted)]
    bias = (jax.random.normal(ks[4], outputs) * 0.1).astype(dtype)
    n = int(np.prod(outputs)) // (2 if activation == "swiglu" else 1)
    residual = jax.random.normal(ks[5], (n,)).astype(dtype)
    args = (x, w, norms[norm], bias, activation, residual)
    tuning = row_gemv.Tuning(rows=rows // 2 if fp8 else rows, block=k // 4, programs=4)
    assert tuning.rows_for(n, w.values.dtype.itemsize) == rows
    got = row_gemv.row_gemv(*args, tuning=tuning, interpret=True)
    want = row_gemv.row_gemv_reference(*args)
    assert got.shape == want.shape == (n,) and got.dtype == dtype
    # fp32: the sums' order; bf16: two rounding steps apart at most (the kernel computes an activation in fp32
    # and rounds it once, where XLA rounds each of its operations)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -6, atol=2 ** -6)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    # and with nothing fused, the product of the weight it stands for
    plain = row_gemv.row_gemv(x, w, tuning=tuning, interpret=True)
    wanted = jnp.tensordot(x.astype(jnp.float32).reshape([shape[i] for i in contracted]), quantized.dequantize(w),
                           axes=(tuple(range(len(contracted))), contracted))
    np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(wanted).reshape(-1), **tol)


def test_programs_and_blocks_fit_the_shape():
    t = row_gemv.Tuning()  # 4 rows a program, 1,024 programs or more where the outputs allow
    assert [t.rows_for(n) for n in (6144, 8192, 2048, 50304, 64, 3)] == [4, 4, 2, 4, 2, 0]
    # 1-byte weights: twice the rows on half the programs, the same bytes a program (8 rows on 512)
    assert [t.rows_for(n, 1) for n in (6144, 8192, 2048, 50304, 64, 3)] == [8, 8, 4, 8, 2, 0]
    wide = row_gemv.Tuning(rows=16, programs=256)
    assert [wide.rows_for(n) for n in (6144, 8192, 2048, 50304, 64, 3)] == [16, 16, 8, 16, 2, 0]
    assert [t.block_for(k) for k in (2048, 8192, 2560, 96, 8)] == [2048, 2048, 512, 32, 0]
    with pytest.raises(ValueError, match="power of two"):
        row_gemv.Tuning(rows=12)
    with pytest.raises(ValueError, match="at least"):
        row_gemv.Tuning(rows=1)


@pytest.mark.parametrize("what", ["qkv-ln", "out-residual", "up-gelu-ln", "down-residual", "up-swiglu-rms",
                                  "head-fp8"])
def test_the_kernel_lowers_to_one_named_triton_call_for_cuda(what):
    """What a GPU would compile, lowered on this CPU at gpt-1.3b's and Llama-3.2-1B's shapes (bf16): one Triton
    custom call, named for the profiler."""
    bf16, d = jnp.bfloat16, 2048
    spec = {"qkv-ln": ((d, 3, 16, 128), (0,), None, True, True, False),
            "out-residual": ((16, 128, d), (0, 1), None, False, True, True),
            "up-gelu-ln": ((d, 8192), (0,), "gelu_tanh", True, True, False),
            "down-residual": ((8192, d), (0,), None, False, True, True),
            "up-swiglu-rms": ((d, 2, 8192), (0,), "swiglu", True, False, False),
            "head-fp8": ((50304, d), (1,), None, True, False, False)}[what]
    shape, contracted, activation, normed, biased, residual = spec
    w = jax.eval_shape(lambda: quantized.quantize(jnp.zeros(shape, bf16), contracted,
                                                  quantized.E4M3 if what.endswith("fp8") else None))
    k = int(np.prod([shape[i] for i in contracted]))
    outputs = w.values.shape[:w.values.ndim - len(contracted)]
    n = int(np.prod(outputs)) // (2 if activation == "swiglu" else 1)
    vec = jax.ShapeDtypeStruct((k,), bf16)
    norm = row_gemv.Norm(vec, vec if "rms" not in what else None, 1e-5) if normed else None
    bias = jax.ShapeDtypeStruct(outputs, bf16) if biased else None
    res = jax.ShapeDtypeStruct((n,), bf16) if residual else None
    text = row_gemv.row_gemv.trace(vec, w, norm, bias, activation, res).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and 'name = "row_gemv"' in text
    assert re.search(rf"tensor<{n}xbf16>", text)


def test_the_tunings_warps_and_stages_reach_triton():
    """Tuning's warps and stages are the Triton call's (stages 0: Triton's default, which Pallas sets to 3)."""
    w = jax.eval_shape(lambda: quantized.quantize(jnp.zeros((2048, 4096), jnp.bfloat16), (0,), None))
    vec = jax.ShapeDtypeStruct((2048,), jnp.bfloat16)

    def settings(tuning):
        text = row_gemv.row_gemv.trace(vec, w, tuning=tuning).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"num_warps = (\d+)", text) + re.findall(r"num_stages = (\d+)", text)

    assert settings(row_gemv.Tuning()) == ["8", "3"]
    assert settings(row_gemv.Tuning(warps=4, stages=2)) == ["4", "2"]
    with pytest.raises(ValueError, match="stages at least 0"):
        row_gemv.Tuning(stages=-1)


def _tiny(model: str) -> ModelConfig:
    if model == "gpt":
        return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64,
                           max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
    cfg = get_preset("llama-tiny")[0]
    return cfg.__class__(**{**cfg.__dict__, "num_layers": 2, "max_position_embeddings": 64, "seq_length": 64,
                            "init_method_std": 0.1})


@pytest.mark.parametrize("weights", ["rows", "fp8"])
@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_decode_at_batch_1_in_the_fused_kernels_gives_the_blocks_tokens(model, weights, monkeypatch):
    """The Generator at batch 1 on "one GPU" (forced here, its kernels in Pallas' interpreter): each decode step's
    blocks and head run as decode_rows' kernels, and the greedy tokens are those of the same Generator with the
    kernels off (layers.Block); a GPT (layer norms, biases, GELU, a tied table) and a Llama (RMSNorm, grouped-query
    heads, rotary positions, SwiGLU, an untied head), with the weights as rows or in fp8."""
    cfg = _tiny(model)
    params = build_model(cfg).init(jax.random.key(3))
    mesh = MeshConfig(1, 1, 1).build(jax.devices()[:1])
    kw = dict(batch=1, max_len=64, weight_dtype=quantized.E4M3 if weights == "fp8" else None)
    prompts = [[5, 17, 300, 41, 9, 77, 2], [11]]
    monkeypatch.setattr(generate, "as_rows", lambda batch, kernels: batch == 1)
    want = [Generator(cfg, params, mesh, **kw).generate([p], 12)[0] for p in prompts]

    calls = []
    kernel = registry.kernel("row_gemv")

    def interpreted(*args, **kwargs):
        calls.append(kwargs.get("activation"))
        return kernel.run(*args, **{**kwargs, "interpret": True})

    monkeypatch.setitem(registry._REGISTRY, "row_gemv", dataclasses.replace(kernel, run=interpreted))
    attention = registry.kernel("decode_attention")
    monkeypatch.setitem(registry._REGISTRY, "decode_attention", dataclasses.replace(
        attention, run=lambda *a, **kw: attention.run(*a, **{**kw, "interpret": True})))
    plain = Generator(cfg, params, mesh, kernels=on_one_gpu(off=["row_gemv"]), **kw)
    assert [plain.generate([p], 12)[0] for p in prompts] == want and not calls
    fused = Generator(cfg, params, mesh, kernels=on_one_gpu(), **kw)  # on by default
    assert [fused.generate([p], 12)[0] for p in prompts] == want
    # traced once (prefill pads its prompts to a bucket, so never one token): four kernels a layer, then the head
    act = "swiglu" if model == "llama" else "gelu_tanh"
    assert calls[:4 * cfg.num_layers + 1] == [None, None, act, None] * cfg.num_layers + [None]


def _random_layer(cfg, dtype, weights, key):
    """One block's parameters drawn at random (biases and norms too, not their zeros and ones), the GEMM weights
    stored as rows or in fp8 as generation keeps them."""
    block = layers.Block(cfg, spec=decode_spec(cfg, KernelPolicy.none()))  # generation's, with a cache
    params = nn.unbox(layers.Block(cfg).init(jax.random.key(0), jnp.zeros((1, 1, cfg.hidden_size), dtype))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    params = jax.tree.unflatten(tree, [(a + 0.2 * jax.random.normal(k, a.shape)).astype(dtype)
                                       for a, k in zip(leaves, keys)])
    fp8 = quantized.E4M3 if weights == "fp8" else None
    return block, {k: quantized.quantize_params(v, fp8) if k in ("attn", "mlp") else v for k, v in params.items()}


@pytest.mark.parametrize("model, dtype, weights", [("gpt", jnp.float32, "rows"), ("gpt", jnp.bfloat16, "fp8"),
                                                    ("llama", jnp.float32, "fp8"), ("llama", jnp.bfloat16, "rows")])
def test_a_blocks_step_and_the_head_are_layers_own_with_every_parameter_drawn(model, dtype, weights, monkeypatch):
    """decode_rows.block and .head in Pallas' interpreter against layers.Block's cached step and the model's
    final_logits, every parameter random (non-zero biases, norms not ones), a cache of random keys and values
    whose row starts at slot 5, decoding at slot 37: the same output within the dtype's rounding, the same key
    and value written."""
    cfg = dataclasses.replace(_tiny(model), num_layers=1)
    block, params = _random_layer(cfg, dtype, weights, jax.random.key(5))
    ks = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(ks[0], (1, 1, cfg.hidden_size)).astype(dtype)
    shape = (1, cfg.kv_heads, 64, cfg.head_dim)
    start, index = jnp.array([5], jnp.int32), jnp.int32(37)
    cache = {"k": jax.random.normal(ks[1], shape).astype(dtype), "v": jax.random.normal(ks[2], shape).astype(dtype),
             "index": index, "start": start}
    positions = index[None, None] - start[:, None]
    mask = decode_attention.visible(jnp.arange(64)[None, None, None], start[:, None, None, None], index)
    want, want_cache = block.apply({"params": params}, x, mask, None, True, cache, positions)
    got, got_cache = decode_rows.block(cfg, params, x, cache, positions, interpret=True)
    def close(a, b):  # fp32: the sums' order; bf16: a few rounding steps of the largest values
        b = np.asarray(b, np.float32)
        scale = 1e-5 if dtype == jnp.float32 else 2 ** -6
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=scale, atol=scale * np.abs(b).max())

    close(got, want)
    for name in ("k", "v"):  # the slot written, as the block wrote it; every other slot untouched
        close(got_cache[name], want_cache[name])
        np.testing.assert_array_equal(np.delete(np.asarray(got_cache[name]), 37, axis=2),
                                      np.delete(np.asarray(cache[name]), 37, axis=2))

    model_ = build_model(cfg)
    ends = jax.tree.map(lambda a: (a + 0.2 * jax.random.normal(ks[0], a.shape)).astype(dtype),
                        {k: v for k, v in model_.init(jax.random.key(2)).items() if k != "blocks"})
    table = quantized.quantize(model_.output_table(ends), quantized.CONTRACTED["word"],
                               quantized.E4M3 if weights == "fp8" else None)
    ends = {**ends, **({"head": {"output": table}} if "head" in ends else {"embed": {**ends["embed"], "word": table}})}
    close(decode_rows.head(cfg, ends["final_norm"], table, x, interpret=True), model_.final_logits(ends, x))
    assert decode_rows.head_applies(cfg, table, x, on_one_gpu())  # on by default
    assert not decode_rows.head_applies(cfg, table, x, on_one_gpu(off=["row_gemv"]))
    assert not decode_rows.head_applies(cfg, table, x, KernelPolicy.resolve("cpu", 1))


def test_what_the_fused_step_does_not_take_runs_the_block(monkeypatch):
    """decode_rows.applies refuses a post-LN block, GELU's erf form, more than one row, weights not
    stored as rows, anything off one GPU (tensor parallelism: the kernels are not partitioned), and everything
    with the row_gemv kernel turned off (it is on by default)."""
    cfg = dataclasses.replace(_tiny("gpt"), num_layers=1)
    _, params = _random_layer(cfg, jnp.float32, "rows", jax.random.key(5))
    x = jnp.zeros((1, 1, cfg.hidden_size))
    cache = {"k": jnp.zeros((1, cfg.kv_heads, 64, cfg.head_dim)), "start": jnp.zeros((1,), jnp.int32)}
    rules = on_one_gpu()

    assert not decode_rows.applies(cfg, params, x, cache, KernelPolicy.resolve("cpu", 1))  # not one GPU's policy
    assert not decode_rows.applies(cfg, params, x, cache, KernelPolicy.resolve("gpu", 2))  # tensor parallel
    assert decode_rows.applies(cfg, params, x, cache, rules)  # on by default
    assert not decode_rows.applies(cfg, params, x, cache, on_one_gpu(off=["row_gemv"]))
    for change in (dict(post_layernorm=True), dict(activation="gelu_erf")):
        assert not decode_rows.applies(dataclasses.replace(cfg, **change), params, x, cache, rules), change
    assert not decode_rows.applies(cfg, params, jnp.zeros((2, 1, cfg.hidden_size)), cache, rules)
    plain = {**params, "mlp": {k: quantized.dequantize(v) if isinstance(v, quantized.Quantized) else v
                               for k, v in params["mlp"].items()}}
    assert not decode_rows.applies(cfg, plain, x, cache, rules)


def test_the_benchmarks_tune_and_off_flags_set_the_kernel_and_name_a_bad_setting(capsys):
    """`--tune row_gemv:rows=16` (profile_decode, generate_speed, gpu_compile decode) gives a Tuning that replaces
    the default, `--off row_gemv` turns the kernel off; a field it has not, or a kernel that is none, is one
    sentence and exit 2."""
    import argparse

    from benchmarks import generate_speed, profile_decode
    from benchmarks.harness import add_decode_kernel_flags, decode_kernel_flags

    p = argparse.ArgumentParser()
    add_decode_kernel_flags(p)
    tuned, off = decode_kernel_flags(p, p.parse_args(["--tune", "row_gemv:rows=16"]))
    assert tuned == [row_gemv.Tuning(rows=16)] and not off
    assert KernelPolicy.resolve("gpu", 1).tuning("row_gemv") == row_gemv.DEFAULT != tuned[0]
    assert KernelPolicy.resolve("gpu", 1, tunings=tuned).tuning("row_gemv") == row_gemv.Tuning(rows=16)
    tuned, off = decode_kernel_flags(p, p.parse_args(["--off", "row_gemv"]))
    assert KernelPolicy.resolve("gpu", 1, tunings=tuned, off=off).tuning("row_gemv") is None
    with pytest.raises(SystemExit) as e:
        generate_speed.main(["--off", "row_gemm"])
    assert e.value.code == 2
    assert "--off row_gemm: choose decode kernels from decode_attention, row_gemv" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        profile_decode.main(["--tune", "row_gemv:lanes=4"])
    assert e.value.code == 2
    assert "--tune row_gemv:lanes=4: row_gemv: 'lanes=4' is not FIELD=INTEGER" in capsys.readouterr().err
