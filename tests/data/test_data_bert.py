"""BERT samples: special-token layout, sentence order, masking proportions, determinism."""
import numpy as np
import pytest

from jax3d.data import IndexedDataset, IndexedDatasetBuilder
from jax3d.data.bert_dataset import BertTokenIds, build_bert_datasets

IDS = BertTokenIds(cls=2, sep=3, mask=4, pad=0, vocab_size=1000)
SPECIAL = {0, 1, 2, 3, 4}


def _make(prefix, n_docs=300, seed=0, max_sent_len=30):
    """Documents of 1-8 sentences of ids 5..999 (never special)."""
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(prefix), np.uint16)
    for _ in range(n_docs):
        for _ in range(rng.integers(1, 9)):
            b.add_item(rng.integers(5, 1000, rng.integers(1, max_sent_len)))
        b.end_document()
    b.finalize()
    return str(prefix)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("bert") / "s")


def _original(sample):
    """Undo masking with the labels."""
    return np.where(sample["loss_mask"] == 1, sample["labels"], sample["text"])


def test_layout_and_sentence_order_against_source(data):
    # seq 512 and no short-target samples: no truncation, so the segments must be the source
    # sentences, whole.
    train, _, _ = build_bert_datasets([data], "1", 512, (400, 0, 0), seed=0, token_ids=IDS,
                                      short_seq_prob=0.0)
    ds = IndexedDataset(data)
    swapped = 0
    for i in range(400):
        s = train[i]
        assert all(s[k].shape == (512,) and s[k].dtype == np.int32
                   for k in ("text", "types", "labels", "loss_mask", "padding_mask"))
        n = int(s["padding_mask"].sum())
        assert s["padding_mask"][:n].all() and not s["padding_mask"][n:].any()
        orig = _original(s)[:n]
        seps = np.flatnonzero(orig == IDS.sep)
        assert orig[0] == IDS.cls and len(seps) == 2 and seps[1] == n - 1
        assert (s["types"][:seps[0] + 1] == 0).all() and (s["types"][seps[0] + 1:n] == 1).all()
        assert (s["text"][n:] == IDS.pad).all() and (s["labels"][n:] == -1).all()
        a, b = orig[1:seps[0]].tolist(), orig[seps[0] + 1:n - 1].tolist()
        start, end, _ = train.samples_mapping[i]
        source = np.concatenate([ds[j] for j in range(start, end)]).tolist()
        if s["is_random"]:
            swapped += 1
            assert b + a == source
        else:
            assert a + b == source
        assert {len(a), len(b)} and min(len(a), len(b)) > 0
    assert abs(swapped / 400 - 0.5) < 0.08  # binomial sd is 0.025


def test_masking_proportions(data):
    train, _, _ = build_bert_datasets([data], "1", 64, (3000, 0, 0), seed=1, token_ids=IDS)
    cand = chosen = masked = kept = 0
    for i in range(len(train)):
        s = train[i]
        orig = _original(s)
        real = s["padding_mask"] == 1
        is_cand = real & ~np.isin(orig, list(SPECIAL))
        sel = s["loss_mask"] == 1
        assert not (sel & ~is_cand).any()  # never a special token or padding
        cand += is_cand.sum()
        chosen += sel.sum()
        masked += (sel & (s["text"] == IDS.mask)).sum()
        kept += (sel & (s["text"] == s["labels"])).sum()
        if cand >= 100_000:
            break
    assert cand >= 100_000
    assert abs(chosen / cand - 0.15) < 0.01
    assert abs(masked / chosen - 0.8) < 0.01
    # Kept: 10%, plus random replacements that drew the same id (1/vocab of the other 10%).
    assert abs(kept / chosen - 0.1) < 0.01
    assert abs(1 - (masked + kept) / chosen - 0.1) < 0.01


def test_deterministic_per_seed_and_index_and_truncation(data, tmp_path):
    a = build_bert_datasets([data], "1", 32, (200, 0, 0), seed=3, token_ids=IDS,
                            cache_dir=str(tmp_path / "a"))[0]
    b = build_bert_datasets([data], "1", 32, (200, 0, 0), seed=3, token_ids=IDS,
                            cache_dir=str(tmp_path / "b"))[0]
    c = build_bert_datasets([data], "1", 32, (200, 0, 0), seed=4, token_ids=IDS,
                            cache_dir=str(tmp_path / "c"))[0]
    np.testing.assert_array_equal(a.samples_mapping, b.samples_mapping)
    assert not np.array_equal(a.samples_mapping, c.samples_mapping)
    for i in (0, 17, 199):
        for k, v in a[i].items():
            np.testing.assert_array_equal(v, b[i][k])
            np.testing.assert_array_equal(v, a[i][k])
    # Every sample fits, with [CLS] and two [SEP]s.
    assert all(int(a[i]["padding_mask"].sum()) <= 32 for i in range(len(a)))
    assert all(e - s >= 2 for s, e, _ in a.samples_mapping)


def test_splits_use_disjoint_documents(data):
    train, valid, test = build_bert_datasets([data], "8,1,1", 64, (100, 20, 20), seed=0,
                                             token_ids=IDS)
    ds = IndexedDataset(data)
    doc_of = np.searchsorted(ds.doc_idx, np.arange(len(ds)), side="right") - 1
    docs = [set(doc_of[d.samples_mapping[:, 0]].tolist()) for d in (train, valid, test)]
    assert max(docs[0]) < min(docs[1]) and max(docs[1]) < min(docs[2])


def test_data_without_sentence_splits_is_named_in_the_error(data, tmp_path):
    """In a blend, the error says which prefix holds no two-sentence documents."""
    from jax3d.data import DataError

    one = IndexedDatasetBuilder(str(tmp_path / "docs"), np.uint16)
    for i in range(20):
        one.add_item(np.arange(5, 25 + i))
        one.end_document()
    one.finalize()
    with pytest.raises(DataError, match=f"no document in the train split of {tmp_path / 'docs'} has two or more"):
        build_bert_datasets([0.5, data, 0.5, str(tmp_path / "docs")], "1", 64, (40, 0, 0), seed=0, token_ids=IDS,
                            cache_dir=str(tmp_path / "cache"))
