"""A Hugging Face export is complete: its vocabulary is the tokenizer's size, not the padded one, its tokenizer
and generation files name the special tokens, and transformers' own entry points (AutoTokenizer,
`pipeline`, `generate`) run on it with no extra arguments and agree with jax3d."""
import json
import logging
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jax3d.config import config_from_dict  # noqa: E402
from jax3d.checkpoint.export import flat_names, load_params  # noqa: E402
from jax3d.hf import export_hf, import_hf, read_safetensors_file  # noqa: E402
from jax3d.models import build_model  # noqa: E402
from tests.hf_fixtures import jax3d_checkpoint_with_tokenizer  # noqa: E402

TOL = 1e-4
TEXT = "The model's 3 layers read text, then code:\n    def main(argv=None):\n        return {'ok': 0}\n"


def _model(ckpt):
    params, meta = load_params(ckpt)
    return build_model(config_from_dict(meta["config"]).model), params


def _round_trip(out, ckpt, tmp_path, vocab):
    """Importing the export gives the checkpoint's parameters back, with zeros in its padding rows."""
    import_hf(out, str(tmp_path / "again"))
    a, b = (flat_names(load_params(d)[0]) for d in (ckpt, str(tmp_path / "again")))
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name], b[name]
        if name in ("embed.word", "head.mlm_bias"):  # the rows of the vocabulary
            np.testing.assert_array_equal(y[vocab:], 0, err_msg=name)
            x, y = x[:vocab], y[:vocab]
        np.testing.assert_array_equal(x, y, err_msg=name)


def test_gpt_export_has_the_tokenizers_vocabulary_and_runs_in_pipeline(tmp_path, caplog):
    """A GPT of a 300-odd-token tokenizer, padded to 384 rows: the export has the tokenizer's rows, HF's
    tokenizer reads text as jax3d's does, and `pipeline("text-generation")` and `generate` need no arguments
    (pad, eos and the length limit come from the export) and continue greedily as jax3d does."""
    ckpt, tok = jax3d_checkpoint_with_tokenizer(tmp_path, "gpt")
    out = str(tmp_path / "hf")
    export_hf(ckpt, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "merges.txt", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer_config.json", "vocab.json"]
    v = tok.vocab_size
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.vocab_size == len(hf_tok) == v
    assert read_safetensors_file(os.path.join(out, "model.safetensors"))["transformer.wte.weight"].shape[0] == v
    assert hf_tok(TEXT)["input_ids"] == tok.tokenize(TEXT) and hf_tok.decode(tok.tokenize(TEXT)) == TEXT
    eod = tok.eod
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == hf_tok.pad_token_id == eod
    assert hf.generation_config.eos_token_id == hf.generation_config.pad_token_id == eod
    tokens = np.array([tok.tokenize(TEXT)[:16]], np.int32)
    model, params = _model(ckpt)
    ours = np.asarray(model.logits(params, tokens))
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert ref.shape[-1] == v and np.max(np.abs(ours[..., :v] - ref)) < TOL

    # transformers' entry points with no arguments: pad, eos and the length limit come from the export, and
    # transformers warns of nothing (no "Setting pad_token_id", no right padding, no length past the model's).
    caplog.set_level(logging.WARNING)
    caplog.clear()  # the 70-token TEXT above warns (once per process) of its length; the prompts below must not
    prompt = "def add(a, b):"
    ids = tok.tokenize(prompt)
    sampled = transformers.pipeline("text-generation", model=out)(prompt)[0]["generated_text"]
    batch = transformers.pipeline("text-generation", model=out)([prompt, "The quick"], batch_size=2)
    greedy = hf.generate(**hf_tok(prompt, return_tensors="pt"))[0].tolist()
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    # (a position past the model's 16 would have raised IndexError)
    assert sampled.startswith(prompt) and [b[0]["generated_text"][:9] for b in batch] == [prompt[:9], "The quick"]
    # `generate` is greedy up to the model's 16 positions or eos: jax3d's argmax over the tokenizer's columns.
    want = list(ids)
    while len(want) < 16 and (len(want) == len(ids) or want[-1] != eod):
        want.append(int(np.argmax(model.logits(params, np.array([want], np.int32))[0, -1, :v])))
    assert greedy == want
    _round_trip(out, ckpt, tmp_path, v)


def test_bert_export_loads_with_its_wordpiece_tokens(tmp_path):
    """A jax3d BERT of a 300-odd-token WordPiece: AutoTokenizer has [PAD] [CLS] [SEP] [MASK] [UNK] at
    jax3d's ids and tokenizes as jax3d does, AutoModelForPreTraining and AutoModelForMaskedLM load every
    weight, the MLM decoder (and its bias) has the tokenizer's rows, and the logits are jax3d's."""
    ckpt, tok = jax3d_checkpoint_with_tokenizer(tmp_path, "bert")
    out = str(tmp_path / "hf")
    export_hf(ckpt, out)
    v = tok.vocab_size
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf_tok) == v == json.load(open(os.path.join(out, "config.json")))["vocab_size"]
    assert (hf_tok.pad_token_id, hf_tok.cls_token_id, hf_tok.sep_token_id, hf_tok.mask_token_id, hf_tok.unk_token_id) \
        == (tok.pad, tok.cls, tok.sep, tok.mask, tok.unk)
    assert hf_tok(TEXT, add_special_tokens=False)["input_ids"] == tok.tokenize(TEXT)
    assert read_safetensors_file(os.path.join(out, "model.safetensors"))["cls.predictions.bias"].shape == (v,)
    pre, info = transformers.AutoModelForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    mlm, info = transformers.AutoModelForMaskedLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info
    enc = hf_tok(["the quick brown fox", "def add(a, b):"], padding=True, return_tensors="np")
    text, types, pad = (enc[k].astype(np.int32) for k in ("input_ids", "token_type_ids", "attention_mask"))
    model, params = _model(ckpt)
    ours = np.asarray(model.forward(params, {"text": text, "types": types, "padding_mask": pad})[0])
    with torch.no_grad():
        for model in (pre.eval(), mlm.eval()):
            got = model(**{k: torch.tensor(x) for k, x in enc.items()})
            got = (got.prediction_logits if hasattr(got, "prediction_logits") else got.logits).numpy()
            assert got.shape[-1] == v and np.max(np.abs((ours[..., :v] - got) * pad[..., None])) < TOL
    _round_trip(out, ckpt, tmp_path, v)
