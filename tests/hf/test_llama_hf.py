"""Hugging Face Llama both ways against transformers itself: logits and loss of tiny random LlamaForCausalLM models
(grouped-query, multi-query, tied and untied, rope theta 1e4 and 5e5, llama3 and linear rope scaling, odd layer
counts, Mistral), greedy generation at batch 1, a ragged batch and tensor parallel 2, exports that
transformers reads back as identical tensors (fp32, bf16, shards), and folders jax3d refuses."""
import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax3d.checkpoint.export import load_params  # noqa: E402
from jax3d.cli.convert_hf import main as convert_main  # noqa: E402
from jax3d.config import config_from_dict  # noqa: E402
from jax3d.hf import export_hf, import_hf  # noqa: E402
from jax3d.inference import Generator  # noqa: E402
from jax3d.models import build_model  # noqa: E402
from jax3d.parallel.mesh import MeshConfig  # noqa: E402
from tests.hf_fixtures import causal_lm_gap, tiny_llama  # noqa: E402
from tests.helpers import interpreted, only  # noqa: E402

TOL = 1e-4
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}  # shorter than the test's sequences, so the scaling shows
CASES = {
    "gqa-3L-kv2-untied": dict(),
    "mqa-kv1": dict(kv_heads=1),
    "mha-tied-theta5e5": dict(kv_heads=8, tied=True, theta=500000.0),
    "gqa-kv4-llama3-scaling-5L": dict(n_layer=5, kv_heads=4, theta=500000.0, rope_scaling=LLAMA3),
    "linear-scaling-1L": dict(n_layer=1, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral-no-window": dict(arch="MistralForCausalLM", kv_heads=4),
    "head-dim-12-of-8": dict(n_layer=2, head_dim=12),  # imports as --kv-channels 12
}


def _import(tmp_path, **kw):
    hf = tiny_llama(str(tmp_path / "hf"), **kw)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    params, meta = load_params(str(tmp_path / "ckpt"))
    return hf, params, config_from_dict(meta["config"]).model


def _same_tensors(a_model, b_model):
    a, b = a_model.state_dict(), b_model.state_dict()
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("case", list(CASES))
def test_llama_logits_loss_and_round_trip(tmp_path, case):
    hf, params, cfg = _import(tmp_path, **CASES[case])
    v = hf.config.vocab_size
    assert cfg.swiglu and cfg.normalization == "rmsnorm" and cfg.use_rotary_position_embeddings
    assert cfg.kv_heads == hf.config.num_key_value_heads
    assert cfg.untie_embeddings_and_output_weights == (not hf.config.tie_word_embeddings)
    model = build_model(cfg)
    tokens = np.random.RandomState(0).randint(0, v, (3, 40)).astype(np.int32)
    assert max(causal_lm_gap(hf, model, params, tokens)) < TOL

    export_hf(str(tmp_path / "ckpt"), str(tmp_path / "out"))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(back).__name__ == "LlamaForCausalLM"
    _same_tensors(back, hf)
    assert back.config.rope_parameters == hf.config.rope_parameters


def test_bf16_shards_both_ways(tmp_path):
    """A bf16 model in shards imports to its values upcast exactly, and exports (--dtype bfloat16, small shards)
    to a folder whose tensors are the source's bit for bit."""
    src = tiny_llama(str(tmp_path / "src"), n_layer=2)
    src.to(torch.bfloat16).save_pretrained(str(tmp_path / "hf"), max_shard_size="40KB")
    assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    assert convert_main(["export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "out"), "--dtype",
                         "bfloat16", "--max-shard-size", "40KB"]) == 0
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1
    want = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.bfloat16)
    assert next(back.parameters()).dtype == torch.bfloat16
    _same_tensors(back, want)


# ---- generation ----------------------------------------------------------------------------------------------

NEW = 32
PROMPTS = [[5, 17, 200, 41, 9, 77, 3], [11], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 12], [88, 3, 3, 250]]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    """A 3-layer Llama, 8 heads over 2 KV heads, llama3 rope scaling, untied; eos off so every row gets 32 tokens."""
    hf, params, cfg = _import(tmp_path_factory.mktemp("gen"), kv_heads=2, theta=500000.0, rope_scaling=LLAMA3,
                              positions=64)
    hf.generation_config.eos_token_id = None
    return hf, params, cfg


def _hf_greedy(hf, prompts):
    t = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (t - len(p)) + p for p in prompts], dtype=torch.long)
    mask = torch.tensor([[0] * (t - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[:, t:].tolist()


def _gen(cfg, params, batch, tp=1):
    return Generator(cfg, params, MeshConfig(1, 1, tp).build(jax.devices()[:tp]), batch=batch, max_len=64)


def test_greedy_batch1_equals_transformers(gqa):
    hf, params, cfg = gqa
    gen = _gen(cfg, params, batch=1)
    assert gen.generate([PROMPTS[0]], NEW) == _hf_greedy(hf, [PROMPTS[0]])
    assert gen.params["blocks"][0]["attn"]["qkv_kernel"].shape[1:3] == (6, 2)  # 4 query heads per KV head + k + v


def test_ragged_batch_equals_transformers_also_at_tp2(gqa):
    hf, params, cfg = gqa
    want = _hf_greedy(hf, PROMPTS)
    assert _gen(cfg, params, batch=4).generate(PROMPTS, NEW) == want
    tp = _gen(cfg, params, batch=4, tp=2)
    assert tp.params["blocks"][0]["attn"]["qkv_kernel"].sharding.spec[2] == "model"  # KV heads split
    assert tp.generate(PROMPTS, NEW) == want


@pytest.mark.parametrize("parts", [1, 4], ids=["one-part", "4-parts"])
def test_the_decode_kernel_gives_transformers_tokens_for_grouped_queries(gqa, monkeypatch, parts):
    """Decode's attention as jax3d.kernels.decode_attention (Pallas' interpreter standing in for the GPU): rotated
    queries and keys packed into the projection's layout again, 4 query heads per KV head, the kernel writing
    each KV head's key and value from one of its programs, each row's slots walked whole or in 4 parts; a
    ragged batch gives transformers' greedy tokens."""
    from jax3d.kernels import decode_attention

    hf, params, cfg = gqa
    calls = interpreted(monkeypatch, "decode_attention")
    kernels = only("decode_attention", decode_attention.Tuning(block=16, parts=parts))
    gen = Generator(cfg, params, MeshConfig(1, 1, 1).build(jax.devices()[:1]), batch=4, max_len=64, kernels=kernels)
    assert gen.generate(PROMPTS, NEW) == _hf_greedy(hf, PROMPTS)
    assert calls, "the kernel did not run"


def test_mqa_greedy_equals_transformers(tmp_path):
    hf, params, cfg = _import(tmp_path, kv_heads=1, tied=True, n_layer=2)
    hf.generation_config.eos_token_id = None
    assert _gen(cfg, params, batch=4).generate(PROMPTS, NEW) == _hf_greedy(hf, PROMPTS)


# ---- refusals ------------------------------------------------------------------------------------------------

REFUSED = {
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
             "config.json rope_scaling type 'yarn' is not built"),
    "dynamic-v4-key": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    "attention-bias": ({"attention_bias": True}, "config.json attention_bias true with mlp_bias false"),
    "sliding-window": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
                       "config.json sliding_window 4096"),
    "gelu": ({"hidden_act": "gelu"}, "config.json hidden_act 'gelu'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_inexpressible_llama_folders_are_refused_in_one_sentence_and_nothing_is_written(tmp_path, capsys, name):
    tiny_llama(str(tmp_path / "hf"), n_layer=1)
    path = tmp_path / "hf" / "config.json"
    change, words = REFUSED[name]
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    capsys.readouterr()
    assert convert_main(["import", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "ckpt")


def test_export_of_a_model_no_hf_class_expresses_names_the_field():
    from jax3d.config import ConfigError
    from jax3d.hf import hf_config_from_model
    from tests.helpers import tiny_model
    with pytest.raises(ConfigError, match="HF Llama cannot express a GPT with normalization='layernorm'"):
        hf_config_from_model(tiny_model(swiglu=True, use_rotary_position_embeddings=True))
    with pytest.raises(ConfigError, match="HF BERT cannot express a BERT with normalization='rmsnorm'"):
        hf_config_from_model(tiny_model(model_type="bert", normalization="rmsnorm"))
    cfg = hf_config_from_model(tiny_model(normalization="rmsnorm", swiglu=True, use_rotary_position_embeddings=True,
                                          num_key_value_heads=2, add_bias_linear=False))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"]


def test_train_py_fine_tunes_an_imported_llama_from_transformers_loss_and_exports_it(tmp_path):
    """train.py --load of an imported Llama with its tokenizer.json (no shape flags) starts at exactly transformers'
    loss on its first batch at (data, stage, model) = (2, 2, 2), and its export loads in transformers with its
    tokenizer and generates through pipeline()."""
    from jax3d.data import build_tokenizer
    from tests.hf_fixtures import fine_tune_import, llama_folder_with_tokenizer

    hf, _ = llama_folder_with_tokenizer(tmp_path / "hf", n_layer=4, kv_heads=2)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    tok_file = str(tmp_path / "ckpt" / "tokenizer" / "tokenizer.json")
    tok = build_tokenizer("HFTokenizer", tokenizer_file=tok_file)
    assert fine_tune_import(tmp_path, hf, tok, ["--tokenizer-type", "HFTokenizer", "--tokenizer-file", tok_file],
                            (2, 2)) < TOL
    export_hf(str(tmp_path / "tuned"), str(tmp_path / "out"))
    out = str(tmp_path / "out")
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token == "</s>"
    assert transformers.pipeline("text-generation", model=out)("def add", max_new_tokens=4)[0][
        "generated_text"].startswith("def add")
