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
        if name in ("embed.word", "head.mlm_bias", "head.output"):  # the rows of the vocabulary
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

    # transformers' entry points with no arguments but the length: pad and eos come from the export, and
    # transformers warns of nothing (no "Setting pad_token_id", no right padding, no length past the model's, and
    # no "Both `max_new_tokens` and `max_length`": the generation config leaves the length to the call).
    with open(os.path.join(out, "generation_config.json")) as f:
        assert "max_length" not in json.load(f)
    caplog.set_level(logging.WARNING)
    caplog.clear()  # the 70-token TEXT above warns (once per process) of its length; the prompts below must not
    prompt = "def add(a, b):"
    ids = tok.tokenize(prompt)
    sampled = transformers.pipeline("text-generation", model=out)(prompt, max_new_tokens=4)[0]["generated_text"]
    batch = transformers.pipeline("text-generation", model=out)([prompt, "The quick"], batch_size=2, max_new_tokens=4)
    greedy = hf.generate(**hf_tok(prompt, return_tensors="pt"), max_new_tokens=16 - len(ids))[0].tolist()
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


SP_TEXTS = [TEXT, "The quick brown fox", "Ünïcode ∑ and 12345,  two  spaces\tand a tab\n", "def add(a, b):"]


@pytest.mark.slow
def test_a_sentencepiece_llama_exports_a_tokenizer_transformers_reads_as_jax3d_does(tmp_path, caplog, capsys):
    """A Llama trained with GPTSentencePieceTokenizer: export ended in AttributeError (the tokenizer has no `tok`).
    It writes tokenizer.model with a LlamaTokenizer config whose bos, eos, unk and pad are the model's (pad its
    eos, as it has none), and AutoTokenizer reads text as jax3d does: no bos added, the same ids, the same text
    back (leading whitespace aside, which transformers' Llama tokenizer reads otherwise). The logits are jax3d's.
    Importing the export (tokenizer.model, no tokenizer.json) dropped the tokenizer; it takes it, and says so."""
    from jax3d.checkpoint.read import read_meta
    from jax3d.checkpoint.tokenizer import checkpoint_tokenizer

    ckpt, tok = jax3d_checkpoint_with_tokenizer(tmp_path, "llama")
    out = str(tmp_path / "hf")
    export_hf(ckpt, out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors",
                                       "special_tokens_map.json", "tokenizer.model", "tokenizer_config.json"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(hf_tok) == tok.vocab_size and tok.pad < 0
    assert (hf_tok.bos_token, hf_tok.eos_token, hf_tok.unk_token, hf_tok.pad_token) == ("<s>", "</s>", "<unk>", "</s>")
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.unk_token_id, hf_tok.pad_token_id) == \
        (tok.bos, tok.eod, tok.unk, tok.eod)
    for text in SP_TEXTS:
        ids = tok.tokenize(text)
        assert hf_tok(text)["input_ids"] == ids, text
        assert hf_tok.decode(ids) == tok.detokenize(ids), text
    with open(os.path.join(out, "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": tok.bos, "eos_token_id": tok.eod, "pad_token_id": tok.eod}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = np.array([tok.tokenize(TEXT)[:16]], np.int32)
    model, params = _model(ckpt)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    assert np.max(np.abs(np.asarray(model.logits(params, tokens))[..., :tok.vocab_size] - ref)) < TOL
    caplog.set_level(logging.WARNING)
    caplog.clear()
    hf.generate(**hf_tok("def add(a, b):", return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert not [r.getMessage() for r in caplog.records if r.name.startswith("transformers")]
    capsys.readouterr()
    _round_trip(out, ckpt, tmp_path, tok.vocab_size)
    said = [line for line in capsys.readouterr().err.splitlines() if "tokenizer" in line]
    assert said == [f"jax3d: {out} has no tokenizer.json; its tokenizer is tokenizer.model, read by SentencePiece "
                    "(--tokenizer-type GPTSentencePieceTokenizer)"]
    meta = read_meta(str(tmp_path / "again"), 0)
    assert meta["tokenizer"]["type"] == "GPTSentencePieceTokenizer"
    assert meta["tokenizer"]["fingerprints"] == read_meta(ckpt, 1)["tokenizer"]["fingerprints"]
    assert [checkpoint_tokenizer(meta).tokenize(t) for t in SP_TEXTS] == [tok.tokenize(t) for t in SP_TEXTS]


def test_a_sentencepiece_model_transformers_reads_otherwise_is_named_at_export(tmp_path, capsys):
    """SentencePiece's default training (NFKC, runs of spaces made one, no byte fallback) reads text otherwise
    than transformers' LlamaTokenizer: the export says so in one line; a Llama-style model exports silently."""
    from jax3d.data.tokenizers import build_tokenizer
    from jax3d.hf import tokenizer as hf_tok
    from tests.hf_fixtures import sentencepiece_model
    from tests.helpers import tiny_model

    for llama_style in (False, True):
        model = sentencepiece_model(tmp_path / str(llama_style), llama_style)
        out = tmp_path / f"hf_{llama_style}"
        out.mkdir()
        record = {"type": "GPTSentencePieceTokenizer", "tokenizer_model": model}
        hf_tok.copy_tokenizer_files(record, str(out), "gpt")
        hf_tok.write_tokenizer_config(record, build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model),
                                      str(out), tiny_model())
        err = capsys.readouterr().err
        ids = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model).tokenize("a  b\tc")
        agrees = transformers.AutoTokenizer.from_pretrained(str(out))("a  b\tc")["input_ids"] == ids
        assert agrees == llama_style
        assert (err == "") == llama_style and err.count("\n") == (0 if llama_style else 1), err
        if not llama_style:
            assert "normalizes text" in err and "no byte fallback" in err and "byte_fallback=true" in err
