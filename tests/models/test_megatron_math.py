"""Megatron-DeepSpeed's model-math flags act as they do there: --kv-channels, --openai-gelu, --squared-relu,
--apply-layernorm-1p, --eod-mask-loss, --reset-position-ids, --reset-attention-mask. Each against a reference:
numpy, the plain model, Megatron's get_ltor_masks_and_position_ids, documents run one by one, one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.hf.mapping import hf_config_from_model, to_hf
from jax3d.models import GPT, MLP, LayerNorm
from jax3d.models import documents
from jax3d.models.transformer import unbox
from jax3d.train.step import build_steps
from tests.helpers import ROOT, tiny_config, tiny_model, with_random
from jax3d.parallel.plan import Plan

EOD = 1
DOCS = dict(eod_mask_loss=True, reset_position_ids=True, reset_attention_mask=True, eod_token_id=EOD)


def megatron_masks(tokens: np.ndarray, eod: int):
    """Megatron-DeepSpeed's megatron/utils.py get_ltor_masks_and_position_ids with all three switches on, in
    numpy, loop for loop: (attention allowed (b, 1, s, s), loss mask (b, s), position ids (b, s))."""
    b, s = tokens.shape
    allowed = np.tril(np.ones((b, s, s))).reshape(b, 1, s, s)
    loss_mask = np.ones((b, s), np.float32)
    loss_mask[tokens == eod] = 0.0
    positions = np.tile(np.arange(s), (b, 1))
    for row in range(b):
        prev = 0
        for i in np.arange(s)[tokens[row] == eod]:
            allowed[row, 0, i + 1:, :i + 1] = 0
            positions[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    return allowed > 0.5, loss_mask, positions


def test_masks_and_positions_are_megatrons():
    rs = np.random.RandomState(0)
    tokens = rs.randint(0, 6, (4, 24)).astype(np.int32)  # EOD (1) about every sixth token
    tokens[0, 0], tokens[1, -1], tokens[2] = EOD, EOD, 3  # at the start, at the end, none at all
    allowed, loss_mask, positions = megatron_masks(tokens, EOD)
    causal = np.tril(np.ones((24, 24), bool))
    np.testing.assert_array_equal(np.asarray(documents.document_mask(tokens, EOD)) & causal, allowed)
    np.testing.assert_array_equal(documents.document_positions(tokens, EOD), positions)
    np.testing.assert_array_equal(documents.not_after_eod(tokens, EOD), loss_mask)
    text = np.concatenate([tokens, tokens[:, :1]], axis=1)
    model = GPT(tiny_model(seq_length=24, eod_mask_loss=True, eod_token_id=EOD))
    np.testing.assert_array_equal(model._loss_mask({"text": text}), loss_mask)
    np.testing.assert_array_equal(model.normalizers({"text": text})["lm"], loss_mask.sum())


def _loss_sum(cfg, params, text):
    loss = jax.jit(lambda p, t: GPT(cfg).loss(p, {"text": t}, norms={"lm": 1.0})[0])
    with jax.default_matmul_precision("highest"):
        return float(loss(params, np.asarray(text, np.int32)[None]))


def test_two_documents_in_one_sample_lose_what_each_loses_alone():
    """Under --reset-attention-mask, --reset-position-ids and --eod-mask-loss, a sample that holds document A
    (ending in EOD) then document B loses the sum of what A and B lose run alone: nothing crosses the EOD, the
    positions of B start at 0, and the prediction of B's first token from A's EOD is not counted."""
    cfg = tiny_model(num_layers=1, **DOCS)
    params = jax.jit(GPT(cfg).init)(jax.random.key(0))
    params = with_random(with_random(params, "bias"), "qkv_kernel")  # sharp attention, which the mask changes
    rs = np.random.RandomState(3)
    a = [*rs.randint(2, cfg.vocab_size, 6), EOD]
    b = [*rs.randint(2, cfg.vocab_size, 10)]
    assert len(a) + len(b) == cfg.seq_length + 1
    together = _loss_sum(cfg, params, a + b)
    np.testing.assert_allclose(together, _loss_sum(cfg, params, a) + _loss_sum(cfg, params, b), rtol=2e-6)
    # Each switch is needed for that: without one of them, the sample loses something else.
    for off in ("eod_mask_loss", "reset_position_ids", "reset_attention_mask"):
        other = tiny_model(num_layers=1, **{**DOCS, off: False})
        assert abs(_loss_sum(other, params, a + b) - together) > 1e-3, off


def test_layernorm_1p_is_the_plain_norm_with_scale_one_plus_w_and_exports_one_plus_w():
    x = jax.random.normal(jax.random.key(1), (2, 5, 64))
    norm = LayerNorm(one_plus=True)
    v = unbox(norm.init(jax.random.key(0), x))
    np.testing.assert_array_equal(v["params"]["scale"], 0.0)  # Megatron's init: scale 1 + 0
    np.testing.assert_allclose(norm.apply(v, x), LayerNorm().apply(LayerNorm().init(jax.random.key(0), x), x),
                               atol=1e-6)
    w = {"scale": 0.3 * jax.random.normal(jax.random.key(2), (64,)), "bias": jnp.full((64,), 0.1)}
    np.testing.assert_allclose(norm.apply({"params": w}, x),
                               LayerNorm().apply({"params": {**w, "scale": 1 + w["scale"]}}, x), atol=1e-6)

    # In the whole GPT: the blocks' and the final norm take 1 + w, and HF export writes 1 + w.
    cfg, plain_cfg = tiny_model(apply_layernorm_1p=True), tiny_model()
    params = with_random(jax.jit(GPT(cfg).init)(jax.random.key(0)), "scale")
    plain = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 1 if jax.tree_util.keystr(path).endswith("['scale']") else a, params)
    text = np.random.RandomState(0).randint(0, cfg.vocab_size, cfg.seq_length + 1)
    loss = _loss_sum(cfg, params, text)
    np.testing.assert_allclose(loss, _loss_sum(plain_cfg, plain, text), rtol=1e-6)
    assert abs(loss - _loss_sum(plain_cfg, params, text)) > 1e-3
    ours, want = to_hf(jax.device_get(params), cfg), to_hf(jax.device_get(plain), plain_cfg)
    assert ours.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(ours[k], want[k], err_msg=k)

    # RMSNorm keeps a plain scale, as Megatron-DeepSpeed's does.
    rms = jax.jit(GPT(tiny_model(apply_layernorm_1p=True, normalization="rmsnorm")).init)(jax.random.key(0))
    np.testing.assert_array_equal(rms["final_norm"]["scale"], 1.0)


def test_squared_relu_mlp_is_relu_squared():
    cfg = tiny_model(activation="squared_relu")
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size))
    mlp = MLP(cfg)
    p = with_random(unbox(mlp.init(jax.random.key(0), x)), "bias")["params"]
    with jax.default_matmul_precision("highest"):
        got = mlp.apply({"params": p}, x)
    p64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
    h = np.asarray(x, np.float64) @ p64["up_kernel"] + p64["up_bias"]
    want = np.maximum(h, 0) ** 2 @ p64["down_kernel"] + p64["down_bias"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="--squared-relu and --swiglu"):
        tiny_model(activation="squared_relu", swiglu=True)
    with pytest.raises(ConfigError, match="HF BERT cannot express activation squared_relu"):
        hf_config_from_model(tiny_model(activation="squared_relu", model_type="bert"))


def test_kv_channels_sets_each_heads_width():
    cfg = tiny_model(kv_channels=12)  # 8 heads x 12 = 96 wide, on a 64-wide model
    attn = jax.jit(GPT(cfg).init)(jax.random.key(0))["blocks"]["attn"]
    assert attn["qkv_kernel"].shape == (2, 64, 3, 8, 12) and attn["qkv_bias"].shape == (2, 3, 8, 12)
    assert attn["out_kernel"].shape == (2, 8, 12, 64)
    assert GPT(cfg).num_params() - GPT(tiny_model()).num_params() == 2 * (4 * 64 * 32 + 3 * 32)
    with pytest.raises(ConfigError, match="HF GPT-2 cannot express --kv-channels 12"):
        hf_config_from_model(cfg)


def _train(data, stage, model, model_kw, steps_=4):
    """Losses of `steps_` steps of the tiny GPT on the (data, stage, model) layout, on samples with EODs."""
    sp = model_kw.pop("sequence_parallel", False)
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, micro=2, global_batch=16,
                                      model_kw=model_kw, sequence_parallel=sp)
    cfg = cfg.replace(optim={"lr": 3e-3, "min_lr": 3e-4})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(cfg.train.seed)
    losses = []
    for i in range(steps_):
        rs = np.random.RandomState(100 + i)
        text = rs.randint(2, cfg.model.vocab_size, (16, cfg.model.seq_length + 1)).astype(np.int32)
        text[rs.rand(*text.shape) < 0.15] = EOD
        v = text.reshape(steps.accum_steps, -1, text.shape[-1])
        batch = {"text": jax.make_array_from_callback(v.shape, steps.batch_sharding(), lambda idx: v[idx])}
        state, m = steps.train_step(state, batch)
        losses.append(float(m["loss"]))
    return np.array(losses)


MATH = dict(kv_channels=12, activation="squared_relu", apply_layernorm_1p=True, **DOCS)


@pytest.fixture(scope="module")
def one_device():
    losses = _train(1, 1, 1, MATH)
    assert losses[-1] < losses[0]
    return losses


@pytest.mark.parametrize("layout", [(2, 2, 2, {}), (1, 2, 4, {"sequence_parallel": True})])
def test_the_flags_train_the_same_on_3d_layouts_as_on_one_device(one_device, layout):
    """--kv-channels, --squared-relu, --apply-layernorm-1p and the three EOD switches, pipelined (the document
    mask reaches every stage), tensor- and data-parallel, sequence-parallel: the loss curve of one device."""
    data, stage, model, kw = layout
    np.testing.assert_allclose(_train(data, stage, model, {**MATH, **kw}), one_device, rtol=0, atol=1e-5)


def _config(argv):
    from jax3d.cli.train_flags import build_parser, config_from_args
    return config_from_args(build_parser().parse_args(argv))


def test_the_flags_map_onto_the_model_config(monkeypatch):
    monkeypatch.chdir(ROOT)
    m = _config(["--kv-channels", "12", "--squared-relu", "--apply-layernorm-1p", "--eod-mask-loss",
                 "--reset-position-ids", "--reset-attention-mask"]).model
    assert (m.kv_channels, m.head_dim, m.activation) == (12, 12, "squared_relu")
    assert m.apply_layernorm_1p and m.eod_mask_loss and m.reset_position_ids and m.reset_attention_mask
    assert _config(["--openai-gelu", "--model", "bert"]).model.activation == "gelu_tanh"
    plain = _config([]).model
    assert (plain.kv_channels, plain.apply_layernorm_1p, plain.uses_eod) == (0, False, False)


@pytest.mark.parametrize("argv, message", [
    (["--squared-relu", "--swiglu"], "--squared-relu and --swiglu each set the MLP's activation"),
    (["--squared-relu", "--openai-gelu"], "--squared-relu and --openai-gelu each set the MLP's activation"),
    (["--squared-relu", "--preset", "llama-tiny"], "--squared-relu and --swiglu each replace"),
    (["--openai-gelu", "--preset", "llama-tiny"], "--openai-gelu sets a GELU MLP and this model's is SwiGLU"),
    (["--kv-channels", "0"], "--kv-channels 0 must be at least 1"),
    (["--model", "bert", "--reset-attention-mask"], "act on GPT samples"),
])
def test_combinations_that_cannot_run_are_refused_in_one_sentence(argv, message, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError, match=message):
        _config(argv)


def test_a_run_takes_the_end_of_document_id_from_its_tokenizer(tmp_path, monkeypatch):
    from jax3d.checkpoint.read import read_meta
    from jax3d.cli.train import main
    from jax3d.train.inputs import tokenizer_and_paths, with_eod_token

    monkeypatch.chdir(ROOT)
    save = str(tmp_path / "ck")
    assert main(["--train-iters", "2", "--seq-length", "32", "--log-interval", "1", "--eval-interval", "0",
                 "--no-progress", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                 "--log-dir", str(tmp_path / "log"), "--save", save, "--eod-mask-loss",
                 "--reset-attention-mask", "--reset-position-ids"]) == 0
    model = read_meta(save, 2)["config"]["model"]
    cfg = _config(["--eod-mask-loss"])
    tok, _ = tokenizer_and_paths(cfg)
    assert model["eod_token_id"] == tok.eod == with_eod_token(cfg, tok).model.eod_token_id >= 0
    assert model["eod_mask_loss"] and model["reset_attention_mask"] and model["reset_position_ids"]

    class NoEod:
        eod = None
    with pytest.raises(ConfigError, match="NoEod has none"):
        with_eod_token(cfg, NoEod())
