"""jax3d.models.row_gemv (one row times a weight stored as rows, with the norm before and the epilogue after, in
one kernel) against its unfused reference, and jax3d.models.decode_rows (a block's decode step at batch 1 in
those kernels) against the Generator's tokens without them."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.config import ModelConfig
from jax3d.inference import generate
from jax3d.inference.generate import Generator
from jax3d.models import build_model, decode_attention, decode_rows, get_preset, quantized, row_gemv
from jax3d.parallel import MeshConfig

VARIANTS = {  # weight shape, contracted dims, activation
    "qkv": ((128, 3, 2, 32), (0,), None),
    "out": ((4, 32, 128), (0, 1), None),
    "up-gelu": ((128, 256), (0,), "gelu_tanh"),
    "up-swiglu": ((128, 2, 96), (0,), "swiglu"),
}


CASES = [("qkv", False, "layer", jnp.bfloat16), ("qkv", True, "rms", jnp.float32),
         ("out", False, "none", jnp.float32), ("out", True, "none", jnp.bfloat16),
         ("up-gelu", False, "layer", jnp.bfloat16), ("up-gelu", True, "layer", jnp.float32),
         ("up-swiglu", False, "rms", jnp.bfloat16), ("up-swiglu", True, "rms", jnp.float32)]


@pytest.mark.parametrize("variant, fp8, norm, dtype", CASES,
                         ids=[f"{v}-{'fp8' if q else 'rows'}-{n}-{jnp.dtype(d).name}" for v, q, n, d in CASES])
def test_the_kernel_is_its_unfused_reference(variant, fp8, norm, dtype):
    """Pallas' interpreter against row_gemv_reference, whose rounding is the unfused path's: the layer norm or
    RMSNorm before, the bias, GELU or SwiGLU and the residual add after, each rounded to the row's dtype; the
    weight as rows (no scale) or in fp8 with a scale per output. The contracted dim is walked in 4 blocks."""
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
    got = row_gemv.row_gemv(*args, tuning=row_gemv.Tuning(block=k // 4), interpret=True)
    want = row_gemv.row_gemv_reference(*args)
    assert got.shape == want.shape == (n,) and got.dtype == dtype
    # fp32: the sums' order; bf16: one rounding step of the output apart at most
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    # and with nothing fused, the product of the weight it stands for
    plain = row_gemv.row_gemv(x, w, tuning=row_gemv.Tuning(block=k // 4), interpret=True)
    wanted = jnp.tensordot(x.astype(jnp.float32).reshape([shape[i] for i in contracted]), quantized.dequantize(w),
                           axes=(tuple(range(len(contracted))), contracted))
    np.testing.assert_allclose(np.asarray(plain, np.float32), np.asarray(wanted).reshape(-1), **tol)


def test_programs_and_blocks_fit_the_shape():
    t = row_gemv.Tuning()
    assert [t.rows_for(n) for n in (6144, 8192, 2048, 50304, 64, 3)] == [16, 16, 8, 16, 2, 0]
    assert [t.block_for(k) for k in (2048, 8192, 2560, 96, 8)] == [512, 512, 512, 32, 0]
    with pytest.raises(ValueError, match="power of two"):
        row_gemv.Tuning(rows=12)


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
    monkeypatch.setattr(generate, "as_rows", lambda batch, devices: batch == 1)
    want = [Generator(cfg, params, mesh, **kw).generate([p], 12)[0] for p in prompts]

    calls = []
    kernel = row_gemv.row_gemv

    def interpreted(*args, **kwargs):
        calls.append(kwargs.get("activation"))
        return kernel(*args, **{**kwargs, "interpret": True})

    monkeypatch.setattr(row_gemv, "row_gemv", interpreted)
    attention = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention", lambda *a, **kw: attention(*a, **{**kw, "interpret": True}))
    monkeypatch.setattr(row_gemv, "on_one_gpu", lambda rules: True)
    monkeypatch.setattr(decode_attention, "on_one_gpu", lambda rules: True)
    fused = Generator(cfg, params, mesh, **kw)
    assert [fused.generate([p], 12)[0] for p in prompts] == want
    # traced once: four kernels a layer and the head (the prefill of one-token prompts takes them too)
    act = "swiglu" if model == "llama" else "gelu_tanh"
    assert calls[:4 * cfg.num_layers + 1] == [None, None, act, None] * cfg.num_layers + [None]
    assert decode_rows.applies(cfg, fused.params["blocks"][0], jnp.zeros((1, 1, cfg.hidden_size)),
                               {"k": jnp.zeros((1, cfg.kv_heads, 64, cfg.head_dim)), "start": 0}, fused.rules)
    assert not decode_rows.applies(cfg, fused.params["blocks"][0], jnp.zeros((2, 1, cfg.hidden_size)),
                                   {"k": jnp.zeros((2, cfg.kv_heads, 64, cfg.head_dim)), "start": 0}, fused.rules)
