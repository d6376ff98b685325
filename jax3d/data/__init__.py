"""Data: tokenizers, Megatron-compatible indexed datasets, GPT/BERT sample datasets, loaders.

The loader imports JAX; it is loaded lazily so that preprocessing workers stay light.
"""
# Imported eagerly (it is light): a lazy name would be shadowed by the submodule of the same name
# once anything imports `jax3d.data.default_corpus`.
from jax3d.data.default_corpus import default_corpus
from jax3d.data.indexed import (DataError, IndexedDataset, IndexedDatasetBuilder, best_dtype,
                                merge_datasets)
from jax3d.data.preprocess import PreprocessSummary, TokenizerSpec, preprocess_jsonl, split_sentences
from jax3d.data.tokenizers import build_tokenizer, train_tokenizer

_LAZY = {
    "BatchLoader": "jax3d.data.loader",
    "build_gpt_datasets": "jax3d.data.gpt_dataset",
    "parse_data_paths": "jax3d.data.sampling",
    "build_bert_datasets": "jax3d.data.bert_dataset",
    "BertTokenIds": "jax3d.data.bert_dataset",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jax3d.data' has no attribute {name!r}")
