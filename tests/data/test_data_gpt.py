"""GPT sampling against the plain token stream, determinism, splits and blending proportions."""
import numpy as np
import pytest

from jax3d.data import DataError, IndexedDataset, IndexedDatasetBuilder
from jax3d.data.gpt_dataset import build_gpt_datasets, build_gpt_indices
from jax3d.data.sampling import blending_indices, parse_data_paths, split_ranges

EOD = 0


def _make(prefix, n_docs, seed, vocab=1000):
    rng = np.random.default_rng(seed)
    b = IndexedDatasetBuilder(str(prefix), np.uint16)
    for _ in range(n_docs):
        b.add_item(list(rng.integers(1, vocab, rng.integers(0, 40))) + [EOD])
        b.end_document()
    b.finalize()
    return str(prefix)


def test_epoch_of_samples_is_the_shuffled_document_stream(tmp_path):
    prefix = _make(tmp_path / "a", 300, 0)
    seq = 16
    train, valid, test = build_gpt_datasets([prefix], "90,10,0", seq, (500, 20, 0), seed=3)
    assert test is None and len(train) >= 500 and len(valid) >= 20
    ds = IndexedDataset(prefix)
    lo, hi = split_ranges("90,10,0", 300)[0]
    assert (lo, hi) == (0, 270)
    # Reference: the documents in doc_idx order, back to back.
    stream = np.concatenate([ds[int(d)] for d in train.doc_idx]).astype(np.int32)
    assert sorted(set(train.doc_idx[:hi - lo].tolist())) == list(range(lo, hi))  # one epoch = the split
    inverse = np.argsort(train.shuffle_idx)
    samples = [train[int(inverse[j])]["text"] for j in range(len(train))]
    assert all(s.shape == (seq + 1,) and s.dtype == np.int32 for s in samples)
    got = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    np.testing.assert_array_equal(got, stream[:len(got)])
    assert len(stream) - len(got) < seq + 1  # every full window was used
    # Valid draws only from its own documents.
    assert set(valid.doc_idx.tolist()) <= set(range(270, 300))


def test_sentence_split_data_trains_gpt_each_sentence_a_document(tmp_path):
    """Data preprocessed with --split-sentences (pretrain_llama2_distributed.sh's _text_sentence) was refused;
    Megatron's GPT dataset walks the indexed dataset's sequences, so each sentence is a document: its split
    and its windows are those of the same sentences written one document each."""
    from jax3d.data.sampling import why_split_is_empty

    rng = np.random.default_rng(0)
    docs = [[list(rng.integers(1, 1000, rng.integers(1, 12))) for _ in range(rng.integers(2, 9))] for _ in range(6)]
    docs[-1][-1].append(EOD)
    sentences, one_each = IndexedDatasetBuilder(str(tmp_path / "s"), np.uint16), \
        IndexedDatasetBuilder(str(tmp_path / "d"), np.uint16)
    for doc in docs:
        for sent in doc:
            sentences.add_item(sent)
            one_each.add_item(sent)
            one_each.end_document()
        sentences.end_document()
    sentences.finalize()
    one_each.finalize()
    n = sum(len(d) for d in docs)
    assert IndexedDataset(str(tmp_path / "s")).num_documents == 6 < n
    got = build_gpt_datasets([str(tmp_path / "s")], "80,20,0", 8, (60, 10, 0), seed=2)
    want = build_gpt_datasets([str(tmp_path / "d")], "80,20,0", 8, (60, 10, 0), seed=2)
    for g, w in zip(got[:2], want[:2]):
        assert len(g) == len(w)
        for i in range(len(g)):
            np.testing.assert_array_equal(g[i]["text"], w[i]["text"])
    assert got[2] is None
    assert why_split_is_empty([str(tmp_path / "s")], "99,1,0", "valid", by_sequence=True) == (
        f"--split 99,1,0 gives the valid split 1.0% of the {n} sentences in {tmp_path / 's'}, which rounds to none; "
        "add sentences or raise its share")


def test_indices_deterministic_and_seed_dependent(tmp_path):
    prefix = _make(tmp_path / "a", 200, 1)
    a = build_gpt_datasets([prefix], "1", 8, (400, 0, 0), seed=5, cache_dir=str(tmp_path / "c1"))[0]
    b = build_gpt_datasets([prefix], "1", 8, (400, 0, 0), seed=5, cache_dir=str(tmp_path / "c2"))[0]
    c = build_gpt_datasets([prefix], "1", 8, (400, 0, 0), seed=6, cache_dir=str(tmp_path / "c3"))[0]
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    # A second build with the same settings is served from the .npy cache.
    again = build_gpt_datasets([prefix], "1", 8, (400, 0, 0), seed=5, cache_dir=str(tmp_path / "c1"))[0]
    assert isinstance(again.shuffle_idx, np.memmap)
    np.testing.assert_array_equal(again[7]["text"], a[7]["text"])


def test_rebuilt_data_with_the_same_counts_gets_a_fresh_index(tmp_path):
    """The same documents in another order have the same token and document counts; the cached index of
    the first build must not serve the second (its windows would cut the new documents elsewhere)."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1, 1000, n)) + [EOD] for n in rng.integers(1, 40, 50)]

    def build(order):
        b = IndexedDatasetBuilder(str(tmp_path / "a"), np.uint16)
        for i in order:
            b.add_item(docs[i])
            b.end_document()
        b.finalize()
        return build_gpt_datasets([str(tmp_path / "a")], "1", 8, (60, 0, 0), seed=1)[0]

    first = build(range(50))
    second = build(range(49, -1, -1))
    fresh = build_gpt_datasets([str(tmp_path / "a")], "1", 8, (60, 0, 0), seed=1, cache_dir=str(tmp_path / "c"))[0]
    assert not np.array_equal(first.sample_idx, fresh.sample_idx)
    np.testing.assert_array_equal(second.sample_idx, fresh.sample_idx)


def test_multi_epoch(tmp_path):
    prefix = _make(tmp_path / "a", 20, 2)
    tr = build_gpt_datasets([prefix], "1", 8, (1000, 0, 0), seed=0, cache_dir=str(tmp_path))[0]
    assert len(tr.doc_idx) % 20 == 0 and len(tr.doc_idx) > 20
    for e in range(len(tr.doc_idx) // 20):
        assert sorted(tr.doc_idx[20 * e:20 * e + 20].tolist()) == list(range(20))
    assert all(tr[i]["text"].shape == (9,) for i in range(0, len(tr), 50))


def test_separate_last_epoch():
    # 20 docs x 50 tokens, seq 8: 124 samples per epoch. 130 samples use 6 of the second epoch's
    # 124 (< 80%), so those are shuffled apart and served last; 240 samples shuffle all together.
    sizes = np.full(20, 50)
    idx = build_gpt_indices(sizes, (0, 20), 8, 130, seed=0)
    assert len(idx["shuffle_idx"]) == 249
    assert sorted(idx["shuffle_idx"][:124].tolist()) == list(range(124))
    idx = build_gpt_indices(sizes, (0, 20), 8, 240, seed=0)
    assert sorted(idx["shuffle_idx"][:124].tolist()) != list(range(124))


def test_blending_proportions(tmp_path):
    a = _make(tmp_path / "a", 300, 3)
    b = _make(tmp_path / "b", 300, 4)
    train = build_gpt_datasets(["0.3", a, "0.7", b], "1", 8, (10_000, 0, 0), seed=0)[0]
    assert len(train) == 10_000
    frac = np.mean(train.dataset_index == 0)
    assert abs(frac - 0.3) < 0.01
    # Every prefix of the assignment tracks the weights (Megatron's greedy), not just the total.
    for n in (10, 100, 1000):
        assert abs(np.mean(train.dataset_index[:n] == 0) - 0.3) <= 1.0 / n + 1e-9
    # Samples come from the right source, each source's samples in its own order.
    i = int(np.argmax(train.dataset_index == 1))
    np.testing.assert_array_equal(train[i]["text"],
                                  train.datasets[1][int(train.dataset_sample_index[i])]["text"])


def test_blending_reference_small():
    # Greedy by hand, weights 0.25/0.75, error_j = w_j * max(i, 1) - count_j, ties to the first:
    # i=0 (.25,.75)->1  i=1 (.25,-.25)->0  i=2 (-.5,.5)->1  i=3 (-.25,.75)->1  i=4 (0,0)->0 ...
    idx, sample = blending_indices([0.25, 0.75], 8)
    assert idx.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert sample.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]


def test_parse_and_split_errors():
    assert parse_data_paths(["x"]) == ([1.0], ["x"])
    assert parse_data_paths("1 a 3 b") == ([0.25, 0.75], ["a", "b"])
    with pytest.raises(DataError, match="pairs of weight and prefix"):
        parse_data_paths(["a", "b", "c"])
    with pytest.raises(DataError, match="alternate weight and prefix"):
        parse_data_paths(["a", "b"])
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    with pytest.raises(DataError, match="--split"):
        split_ranges("a,b", 10)


def test_data_from_another_vocabulary_is_refused(tmp_path):
    """Token ids at or past the tokenizer's size would index past the embedding table (NaN loss)."""
    from jax3d.config import ConfigError
    from jax3d.train.inputs import check_token_ids

    prefix = _make(tmp_path / "a", 30, 0, vocab=1000)
    top = int(IndexedDataset(prefix).tokens.max())
    check_token_ids([prefix], top + 1)
    with pytest.raises(ConfigError, match=f"holds token id {top}, but the tokenizer has {top} tokens"):
        check_token_ids(["0.5", prefix, "0.5", prefix], top)
    # A long prefix is read in stretches; the last one ends the file, where an outlier id sits here.
    b = IndexedDatasetBuilder(str(tmp_path / "b"), np.uint16)
    b.add_item(list(range(1, 200)) + [5000])
    b.end_document()
    b.finalize()
    check_token_ids([str(tmp_path / "b")], 5001, sample=32, windows=4)
    with pytest.raises(ConfigError, match="holds token id 5000"):
        check_token_ids([str(tmp_path / "b")], 5000, sample=32, windows=4)


def test_a_run_without_validation_data_says_so(capsys):
    """--split with no validation share while validation is asked for: the run says it will not validate
    (it skipped validation without a word); with a share it builds the split and says nothing."""
    from jax3d.config import Config, DataConfig
    from jax3d.train.inputs import build_inputs

    for split, want_note in (("100,0,0", True), ("90,10,0", False)):
        inputs = build_inputs(Config(data=DataConfig(split=split)), 32, 16)
        assert (inputs.valid is None) == want_note
        assert ("does not validate: --split 100,0,0 gives the valid split no share" in capsys.readouterr().err) == want_note


def test_a_split_too_small_for_its_documents_says_so(tmp_path):
    """969,30,1 of five documents gives the validation split none: the note said to give it a share, e.g.
    969,30,1, the value given. It now names the share, the documents and the fix."""
    from jax3d.data.sampling import why_split_is_empty

    b = IndexedDatasetBuilder(str(tmp_path / "five"), np.uint16)
    for _ in range(5):
        b.add_item(list(range(1, 50)))
        b.end_document()
    b.finalize()
    assert why_split_is_empty([str(tmp_path / "five")], "969,30,1", "valid") == (
        f"--split 969,30,1 gives the valid split 3.0% of the 5 documents in {tmp_path / 'five'}, which rounds to "
        "none; add documents or raise its share")


def test_the_train_split_must_not_be_empty_and_blend_weights_must_be_finite():
    """--split 0,100,0 was a TypeError from the loader; a nan or inf blend weight, a ValueError."""
    from jax3d.config import Config, ConfigError, DataConfig
    from jax3d.train.inputs import build_inputs

    with pytest.raises(ConfigError, match="--split 0,100,0 gives the train split no share; give it one"):
        build_inputs(Config(data=DataConfig(split="0,100,0")), 32, 16)
    for w in ("nan", "inf"):
        with pytest.raises(DataError, match="must be finite, non-negative numbers"):
            parse_data_paths([w, "a", "1", "b"])


def test_cached_indices_are_readable_by_the_data_folders_other_users(tmp_path):
    """mkstemp writes 0600; the cache beside shared data is written as a plain file would be (0644 under
    umask 022), or every other user rebuilds it with a warning."""
    import os
    import stat

    from jax3d.data.sampling import cached_arrays

    old = os.umask(0o022)
    try:
        cached_arrays(str(tmp_path), "gpt_x", "k1", lambda: {"doc": np.arange(4)})
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes
