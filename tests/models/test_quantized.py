"""Generation with the blocks' GEMM weights in fp8 (jax3d.models.quantized): each column within e4m3's rounding of
the weight, and decoding that gives the tokens of the same model holding the dequantized weights, on one device and
with heads over two."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.config import ModelConfig
from jax3d.inference import Generator
from jax3d.models import build_model, get_preset, quantized
from jax3d.parallel.mesh import MeshConfig

PROMPTS = [[5, 17, 300, 41, 9, 77, 2], [11], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 12],
           [88, 3, 3, 250]]


@pytest.mark.parametrize("shape, contracted", [((64, 3, 4, 16), (0,)), ((4, 16, 64), (0, 1)), ((96, 64), (1,))],
                         ids=["qkv", "out", "table"])
def test_each_column_is_kept_to_e4m3s_rounding_of_its_own_scale(shape, contracted):
    """Columns (a table's rows) whose magnitudes differ by up to 10**6: every element within half an e4m3 step of
    itself (2**-4, relative) or, below e4m3's normal range, of the column's largest (2**-10 / 448); each column's
    largest kept; an all-zero column stays zero."""
    rs = np.random.RandomState(0)
    cols = tuple(n for i, n in enumerate(shape) if i not in contracted)
    w = rs.standard_normal(shape) * np.expand_dims(10.0 ** rs.uniform(-3, 3, cols), contracted)
    first = tuple(slice(None) if i in contracted else 0 for i in range(len(shape)))  # the first column
    w[first] = 0.0
    q = quantized.quantize(jnp.asarray(w, jnp.float32), contracted)
    assert q.values.dtype == jnp.float8_e4m3fn and q.scale.shape == cols and q.shape == shape
    back = np.asarray(quantized.dequantize(q), np.float64)
    amax = np.max(np.abs(w), axis=contracted, keepdims=True)
    err = np.abs(back - w)
    bound = np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 / 448 * amax) * (1 + 1e-6) + 1e-30
    assert np.all(err <= bound), float(np.max(err / bound))
    np.testing.assert_allclose(np.max(np.abs(back), axis=contracted, keepdims=True), amax, rtol=1e-6)
    assert np.all(back[first] == 0)
    assert np.max(err / (np.abs(w) + 1e-30)) > 2.0 ** -6  # it rounded: not a bf16 or fp32 copy


def _out_dot(c_btkgh, w_nhd):  # the attention's out-projection (jax3d.models.cached_attention._out)
    kv, g, h = c_btkgh.shape[2:]
    return jax.lax.dot_general(c_btkgh, w_nhd.reshape(kv, g, h, -1), (((2, 3, 4), (0, 1, 2)), ((), ())))


GEMMS = {"qkv": (lambda x, w: jnp.einsum("btd,dcnh->btcnh", x, w), (64, 3, 4, 16), (0,), (64,)),
         "out": (_out_dot, (4, 16, 64), (0, 1), (2, 2, 16)),
         "head": (lambda x, w: jnp.einsum("btd,vd->btv", x, w), (96, 64), (1,), (64,))}


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, None], ids=["fp8", "rows"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("gemm", list(GEMMS))
def test_a_quantized_gemm_is_the_gemm_of_its_dequantized_weight(gemm, rows, dtype):
    """quantized.dot on one row (a reduction over the stored values, no dot) and on three (the GEMM on the values
    put back in the weight's dim order) gives the GEMM of the dequantized weight, for the blocks' QKV and
    out-projection and the LM head's table; in fp8, and as the weight's own values stored as rows (no scale),
    which dequantize to the weight itself."""
    fn, shape, contracted, row = GEMMS[gemm]
    key = jax.random.key(0)
    w = jax.random.normal(key, shape)
    q = quantized.quantize(w, contracted, dtype)
    if dtype is None:
        assert q.scale is None and q.values.dtype == w.dtype
        np.testing.assert_array_equal(quantized.dequantize(q), w)
    assert q.shape == shape and q.values.shape[q.values.ndim - len(contracted):] == tuple(shape[i] for i in contracted)
    x = jax.random.normal(jax.random.fold_in(key, 1), (rows, 1) + row)
    want = fn(x, quantized.dequantize(q))
    got = quantized.dot(fn, x, q)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    eqns = jax.make_jaxpr(lambda x, q: quantized.dot(fn, x, q))(x, q).eqns
    assert len([e for e in eqns if e.primitive.name == "dot_general"]) == (rows > 1)


def _tiny(model: str) -> ModelConfig:
    if model == "gpt":  # weights large enough that attention, not the residual stream, picks the tokens
        return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=512, seq_length=64,
                           max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.3)
    cfg = get_preset("llama-tiny")[0]
    return cfg.__class__(**{**cfg.__dict__, "num_layers": 2, "max_position_embeddings": 64, "seq_length": 64,
                            "init_method_std": 0.1})


def _gen(cfg, params, tp=1, batch=len(PROMPTS), **kw):
    return Generator(cfg, params, MeshConfig(1, 1, tp).build(jax.devices()[:tp]), batch=batch, max_len=64, **kw)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_fp8_weights_give_the_tokens_of_their_dequantized_weights_on_every_layout(model):
    """Greedy tokens of a ragged batch with the GEMM weights and vocabulary tables in fp8 equal those of the fp32
    model holding their dequantized values, with heads over 1 and 2 devices; a GPT (biases, GELU, a tied table)
    and a Llama (grouped-query heads, rotary positions, SwiGLU, no biases, an untied head). The compiled decode
    takes the weights in fp8. At batch 1 too, where each GEMM is a reduction of one row."""
    cfg = _tiny(model)
    params = build_model(cfg).init(jax.random.key(3))
    want = _gen(cfg, quantized.rounded(params)).generate(PROMPTS, 12)
    fp8 = _gen(cfg, params, weight_dtype=jnp.float8_e4m3fn)
    assert fp8.generate(PROMPTS, 12) == want
    assert _gen(cfg, params, tp=2, weight_dtype=jnp.float8_e4m3fn).generate(PROMPTS, 12) == want
    for tp in (1, 2):  # one row: the GEMMs are quantized.dot's reductions
        one = _gen(cfg, params, tp=tp, batch=1, weight_dtype=jnp.float8_e4m3fn)
        assert [one.generate([p], 12)[0] for p in PROMPTS[:2]] == want[:2]
    kernels = [v for k, v in fp8.params["blocks"][0]["attn"].items() if k.endswith("kernel")]
    assert kernels and all(isinstance(v, quantized.Quantized) for v in kernels)
    tables = [fp8.params["embed"]["word"], *([fp8.params["head"]["output"]] if "head" in fp8.params else [])]
    assert len(tables) == (2 if model == "llama" else 1) and all(isinstance(t, quantized.Quantized) for t in tables)
    qkv = fp8.params["blocks"][0]["attn"]["qkv_kernel"].values
    assert f"f8e4m3fn[{','.join(map(str, qkv.shape))}]" in fp8.decode_hlo(PROMPTS)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_weights_stored_as_rows_at_batch_1_give_the_gemms_tokens(model, monkeypatch):
    """At batch 1 on a GPU (generate.as_rows, here forced on the CPU) the Generator keeps its GEMM weights and
    tables as rows, each product a reduction: the greedy tokens of the Generator whose GEMMs take the weights as
    they are, with heads over 1 and 2 devices; a GPT (biases, GELU, a tied table) and a Llama (grouped-query
    heads, rotary positions, SwiGLU, an untied head). Off the GPU, and at more rows, the weights stay as they are."""
    from jax3d.inference import generate

    cfg = _tiny(model)
    params = build_model(cfg).init(jax.random.key(3))
    plain = _gen(cfg, params, batch=1)
    assert not isinstance(plain.params["blocks"][0]["attn"]["qkv_kernel"], quantized.Quantized)
    want = [plain.generate([p], 12)[0] for p in PROMPTS[:2]]
    monkeypatch.setattr(generate, "as_rows", lambda batch, kernels: batch == 1)
    for tp in (1, 2):
        rows = _gen(cfg, params, tp=tp, batch=1)
        assert [rows.generate([p], 12)[0] for p in PROMPTS[:2]] == want
    stored = [v for k, v in rows.params["blocks"][0]["attn"].items() if k.endswith("kernel")]
    stored += [rows.params["embed"]["word"], *([rows.params["head"]["output"]] if "head" in rows.params else [])]
    assert all(isinstance(v, quantized.Quantized) and v.scale is None and v.values.dtype == jnp.float32
               for v in stored)
    assert " dot(" in plain.decode_hlo(PROMPTS[:1]) and " dot(" not in rows.decode_hlo(PROMPTS[:1])  # reductions
    assert not isinstance(_gen(cfg, params, batch=2).params["blocks"][0]["attn"]["qkv_kernel"], quantized.Quantized)


def test_weights_are_stored_as_rows_at_batch_1_on_a_gpu_only():
    from jax3d.inference.generate import as_rows
    from jax3d.kernels.policy import KernelPolicy

    gpu, cpu = KernelPolicy.resolve("gpu", 1), KernelPolicy.resolve("cpu", 1)
    assert as_rows(1, gpu) and not as_rows(2, gpu) and not as_rows(1, cpu)
    assert not _gen(_tiny("gpt"), build_model(_tiny("gpt")).init(jax.random.key(0)), batch=1).kernels.uses(
        "row_gemv")  # this CPU's Generator keeps the weights as they are


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rounded_parameters_are_the_generators_fp8_weights(dtype):
    """quantized.rounded (what `launch/evaluate.py --quantization fp8` evaluates) holds exactly the values of the
    Generator's fp8 weights, layer by layer and for the table, placed in fp32 or bf16 (whose scales are bf16)."""
    cfg = get_preset("llama-tiny")[0]
    params = build_model(cfg).init(jax.random.key(1))
    gen = Generator(cfg, params, MeshConfig(1, 1, 1).build(jax.devices()[:1]), batch=1, max_len=32, dtype=dtype,
                    weight_dtype=jnp.float8_e4m3fn)
    want = quantized.rounded(params, compute_dtype=dtype)
    for i, layer in enumerate(gen.params["blocks"]):
        got = jax.tree.map(lambda a: quantized.dequantize(a) if isinstance(a, quantized.Quantized) else a, layer,
                           is_leaf=lambda a: isinstance(a, quantized.Quantized))
        for path, w in jax.tree_util.tree_leaves_with_path(got):
            if path[-1].key in quantized.CONTRACTED:
                ref = want["blocks"]
                for k in path:
                    ref = ref[k.key]
                np.testing.assert_array_equal(np.asarray(w), np.asarray(ref[i]))
    np.testing.assert_array_equal(np.asarray(quantized.dequantize(gen.params["embed"]["word"])),
                                  np.asarray(want["embed"]["word"]))
