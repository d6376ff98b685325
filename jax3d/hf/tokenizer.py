"""The tokenizer and generation files of a Hugging Face export.

Beside the run's tokenizer files (under HF's names) an export writes `tokenizer_config.json` and
`special_tokens_map.json`, which name the special tokens as jax3d's tokenizer defines them, and for a GPT
`generation_config.json`, so that `AutoTokenizer`, `pipeline("text-generation")` and `generate` need no
extra arguments. The export's vocabulary is the tokenizer's size (`export_vocab`), not the padded one.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

from jax3d.config import TOKENIZER_FILE_KEYS, ConfigError

# Roles as transformers names them, and the tokenizer attribute that holds each one's id.
_BERT_ROLES = {"unk_token": "unk", "sep_token": "sep", "pad_token": "pad", "cls_token": "cls", "mask_token": "mask"}
# A SentencePiece model is read by transformers' LlamaTokenizer, as Llama's tokenizer.model is.
_HF_CLASS = {"GPT2BPETokenizer": "GPT2Tokenizer", "BertWordPieceLowerCase": "BertTokenizer",
             "BertWordPieceCase": "BertTokenizer", "HFTokenizer": "PreTrainedTokenizerFast",
             "GPTSentencePieceTokenizer": "LlamaTokenizer"}
_HF_NAMES = {"vocab_file": {"gpt": "vocab.json", "bert": "vocab.txt"}, "merge_file": "merges.txt",
             "tokenizer_file": "tokenizer.json", "tokenizer_model": "tokenizer.model"}  # SentencePiece's, as HF names it
_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # an HF import's, kept beside its files


def export_vocab(model_cfg, record: dict, tokenizer) -> int:
    """Rows of the exported embedding and head: the tokenizer's size (the record's when its files are gone),
    but never fewer than an imported model's own vocabulary, whose rows came from HF; without a tokenizer,
    the model's unpadded vocabulary."""
    size = tokenizer.vocab_size if tokenizer is not None else int(record.get("vocab_size") or 0)
    vocab = max(size, model_cfg.unpadded_vocab_size) or model_cfg.vocab_size
    if vocab > model_cfg.vocab_size:
        raise ConfigError(f"the checkpoint's tokenizer has {vocab} tokens but its model only {model_cfg.vocab_size} "
                          "embedding rows; export the checkpoint of a run that used this tokenizer")
    return vocab


def special_tokens(tokenizer, model_type: str) -> dict[str, str]:
    """{transformers role: token text} of a jax3d tokenizer. A GPT's eos is its end-of-document token, which is
    also its bos, unk and pad where it has none of its own (a SentencePiece model has <s> and <unk>): a pad token
    is what lets transformers batch prompts, and generation stops at eos anyway. A BERT's are [UNK] [SEP] [PAD]
    [CLS] [MASK], those it has."""
    if tokenizer is None:
        return {}
    if model_type == "bert":
        ids = {role: getattr(tokenizer, attr, None) for role, attr in _BERT_ROLES.items()}
    else:
        def own(attr):  # None, or -1 in a SentencePiece model, where it has none
            i = getattr(tokenizer, attr, None)
            return tokenizer.eod if i is None or i < 0 else i
        ids = {"bos_token": own("bos"), "eos_token": tokenizer.eod, "unk_token": own("unk"), "pad_token": own("pad")}
    return {role: tokenizer.id_to_token(i) for role, i in ids.items() if i is not None}


def special_token_ids(tokenizer, specials: dict[str, str]) -> dict[str, int]:
    """config.json's `bos_token_id` / `eos_token_id` / `pad_token_id` of the special tokens there are."""
    return {f"{role[:-6]}_token_id": tokenizer.token_to_id(specials[role])
            for role in ("bos_token", "eos_token", "pad_token") if role in specials}


def copy_tokenizer_files(record: dict, hf_dir: str, model_type: str) -> list[str]:
    """Copies the run's tokenizer files under HF's names; returns the names written."""
    copied = []
    for key in TOKENIZER_FILE_KEYS:
        src, name = record.get(key), _HF_NAMES[key]
        name = name[model_type] if isinstance(name, dict) else name
        if src and not os.path.exists(src):
            print(f"jax3d: the checkpoint's tokenizer file {src} does not exist; the export leaves it out",
                  file=sys.stderr)
        elif src:
            shutil.copy(src, os.path.join(hf_dir, name))
            copied.append(name)
    return copied


def write_tokenizer_config(record: dict, tokenizer, hf_dir: str, model_cfg) -> list[str]:
    """Writes tokenizer_config.json and special_tokens_map.json for `tokenizer` (None: nothing written). An
    HF import's own files, kept beside its vocabulary, are the base: their settings stay, and the special
    tokens they leave out (GPT-2's pad) are added."""
    if tokenizer is None:
        return []
    specials = special_tokens(tokenizer, model_cfg.model_type)
    config = {"tokenizer_class": _HF_CLASS.get(record["type"], "PreTrainedTokenizerFast"),
              "model_max_length": model_cfg.max_position_embeddings,
              # decoder-only generation continues the last token, so a batch is padded on the left
              "padding_side": "right" if model_cfg.model_type == "bert" else "left",
              "added_tokens_decoder": {str(tokenizer.token_to_id(t)): {
                  "content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                  "single_word": False} for t in sorted(set(specials.values()), key=tokenizer.token_to_id)},
              **specials}
    if record["type"] == "GPTSentencePieceTokenizer":
        # jax3d's ids are the model's pieces, nothing added; legacy: the model's own dummy-prefix handling
        config.update(add_bos_token=False, add_eos_token=False, legacy=True, clean_up_tokenization_spaces=False)
        _warn_if_transformers_reads_it_otherwise(tokenizer)
    elif record["type"] == "GPT2BPETokenizer":
        # as jax3d's tokenizer reads and writes text: no space before the first word, none removed when decoding
        config.update(add_prefix_space=False, clean_up_tokenization_spaces=False)
    elif record["type"].startswith("BertWordPiece"):
        config.update(do_lower_case=tokenizer.lower_case, tokenize_chinese_chars=True, strip_accents=None)
    out = {"tokenizer_config.json": config, "special_tokens_map.json": specials}
    src_dir = os.path.dirname(next(record[k] for k in TOKENIZER_FILE_KEYS if record.get(k)))
    for name in _SIDE_FILES:
        own = os.path.join(src_dir, name)
        if os.path.exists(own):
            with open(own) as f:
                out[name].update({k: v for k, v in json.load(f).items() if v is not None})
        with open(os.path.join(hf_dir, name), "w") as f:
            json.dump(out[name], f, indent=2)
    return list(_SIDE_FILES)


def _warn_if_transformers_reads_it_otherwise(tokenizer) -> None:
    """One line when SentencePiece model `tokenizer` has settings transformers' LlamaTokenizer does not
    reproduce (it reads pieces as Llama's model is trained: no normalization, unknown characters as bytes)."""
    sp = tokenizer.sp
    otherwise = [why for why, differs in (
        ("normalizes text (runs of spaces, tabs and newlines, compatibility characters)",
         sp.normalize("a  b\tc\uff21") != "\u2581a\u2581\u2581b\tc\uff21"),
        ("has no byte fallback for characters outside its pieces", sp.piece_to_id("<0x41>") == sp.unk_id()))
        if differs]
    if otherwise:
        print(f"jax3d: the SentencePiece model {' and '.join(otherwise)}, which transformers' LlamaTokenizer does "
              "not reproduce, so the export's tokenizer reads such text otherwise; train it as Llama's is "
              "(normalization_rule_name=identity, remove_extra_whitespaces=false, byte_fallback=true) for an "
              "export that reads all text as jax3d does", file=sys.stderr)


def write_generation_config(hf_dir: str, token_ids: dict[str, int], model_cfg) -> str:
    """generation_config.json of a GPT: its special token ids. No `max_length`: transformers warns of it on
    every `generate` that passes `max_new_tokens`, and caps its own default length at the model's context."""
    config = dict(token_ids)
    with open(os.path.join(hf_dir, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return "generation_config.json"
