"""End to end: JSONL -> preprocess -> GPT/BERT datasets -> sharded loader, against the host reference."""
import jax
import numpy as np
import pytest

from jax3d.data import (BatchLoader, IndexedDataset, TokenizerSpec, build_bert_datasets,
                        build_gpt_datasets, preprocess_jsonl, train_tokenizer)
from jax3d.data.synthetic import synthetic_documents, write_jsonl


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("data", "stage", "model"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)


def test_gpt_end_to_end_blended(tmp_path, mesh):
    docs_a, docs_b = synthetic_documents(600, seed=1), synthetic_documents(600, seed=2)
    files = train_tokenizer([], str(tmp_path), "bpe", 300, texts=iter(docs_a))
    spec = TokenizerSpec("GPT2BPETokenizer", **files)
    prefixes = []
    for name, docs in (("a", docs_a), ("b", docs_b)):
        write_jsonl(str(tmp_path / f"{name}.jsonl"), docs)
        s = preprocess_jsonl(str(tmp_path / f"{name}.jsonl"), str(tmp_path / name), spec,
                             append_eod=True, progress=False)
        prefixes.append(s.outputs[0])
    train, valid, test = build_gpt_datasets(["0.4", prefixes[0], "0.6", prefixes[1]], "98,2,0",
                                            32, (256, 16, 0), seed=1234)
    assert test is None and len(train) == 256 and len(valid) == 16
    eod = spec.build().eod
    assert any((train[i]["text"] == eod).any() for i in range(len(train)))  # windows cross docs
    with BatchLoader(train, global_batch_size=16, accum_steps=4, mesh=mesh) as loader:
        for step in range(3):
            batch = next(loader)
            assert batch["text"].shape == (4, 4, 33)
            np.testing.assert_array_equal(np.asarray(batch["text"]),
                                          loader.numpy_batch(16 * step)["text"])


def test_bert_end_to_end(tmp_path, mesh):
    docs = synthetic_documents(400, seed=3, min_sentences=2, max_sentences=6)
    files = train_tokenizer([], str(tmp_path), "wordpiece", 200, texts=iter(docs))
    spec = TokenizerSpec("BertWordPieceLowerCase", **files)
    write_jsonl(str(tmp_path / "d.jsonl"), docs)
    s = preprocess_jsonl(str(tmp_path / "d.jsonl"), str(tmp_path / "d"), spec,
                         split_sentences_=True, progress=False)
    assert IndexedDataset(s.outputs[0]).num_documents == 400
    tok = spec.build()
    train, _, _ = build_bert_datasets([s.outputs[0]], "1", 48, (64, 0, 0), seed=0, token_ids=tok)
    with BatchLoader(train, 8, 2, mesh) as loader:
        batch = next(loader)
        ref = loader.numpy_batch(0)
    assert set(batch) == {"text", "types", "labels", "loss_mask", "padding_mask", "is_random"}
    for k in batch:
        np.testing.assert_array_equal(np.asarray(batch[k]), ref[k])
    assert (ref["text"][..., 0] == tok.cls).all()
