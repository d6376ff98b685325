"""Evaluation equals what training logs: the perplexity of a checkpoint over Megatron .bin/.idx samples is
exp of the mean validation loss launch/train.py logged on the same samples, on two layouts."""
import json
import math
import os

import pytest

from jax3d.data import default_corpus
from jax3d.cli.evaluate import main as evaluate_main
from jax3d.train.evaluate import evaluate_checkpoint
from jax3d.cli.train import main as train_main

ARGS = ["--seed", "3", "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "2", "--global-batch-size", "16",
        "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-progress",
        "--seq-length", "64", "--log-interval", "1", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "1"]


def _val(log_dir, step):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return next(r for r in recs if r.get("step") == step and "val_loss" in r)


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("evalgpt")
    assert train_main(["--preset", "gpt-tiny", *ARGS, "--save", str(d / "ckpt"), "--log-dir", str(d / "log")]) == 0
    return d


@pytest.mark.parametrize("layout", [dict(tp=1, pp=1), dict(tp=2, pp=2)], ids=["dp8", "dp2-pp2-tp2"])
def test_gpt_perplexity_equals_exp_of_train_logged_loss(gpt_run, layout):
    prefix, _ = default_corpus(kind="gpt")
    logged = _val(str(gpt_run / "log"), 3)
    out = evaluate_checkpoint(str(gpt_run / "ckpt"), data_paths=[prefix], num_samples=2 * 16, micro_batch_size=2,
                              progress=False, **layout)
    assert out["samples"] == 32 and out["tokens"] == 32 * 64
    assert abs(out["loss"] - logged["val_loss"]) < 1e-5
    assert abs(out["ppl"] - math.exp(logged["val_loss"])) < 1e-4 * out["ppl"]


def test_text_file_and_partial_last_batch(gpt_run, tmp_path):
    """A text file with a ragged tail: every token predicted once, whatever the batch size."""
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    a = evaluate_checkpoint(str(gpt_run / "ckpt"), text_file=str(text), micro_batch_size=1, progress=False)
    b = evaluate_checkpoint(str(gpt_run / "ckpt"), text_file=str(text), micro_batch_size=3, tp=2, progress=False)
    assert a["tokens"] == b["tokens"] > 64 and abs(a["loss"] - b["loss"]) < 1e-5


def test_fp8_weights_cost_a_little_loss_the_same_on_every_layout(gpt_run, capsys):
    """--quantization fp8 evaluates the weights generation's fp8 holds (tests/models/test_quantized.py ties
    quantized.rounded to the Generator's): one loss on one device and on a pipelined, tensor-parallel layout, near
    the checkpoint's own and not equal to it."""
    prefix, _ = default_corpus(kind="gpt")
    kw = dict(data_paths=[prefix], num_samples=32, micro_batch_size=2, progress=False)
    plain = evaluate_checkpoint(str(gpt_run / "ckpt"), **kw)
    fp8 = evaluate_checkpoint(str(gpt_run / "ckpt"), quantization="fp8", **kw)
    fp8_222 = evaluate_checkpoint(str(gpt_run / "ckpt"), quantization="fp8", tp=2, pp=2, **kw)
    assert fp8["quantization"] == "fp8" and abs(fp8["loss"] - fp8_222["loss"]) < 1e-5
    assert 0 < abs(fp8["loss"] - plain["loss"]) < 0.01 * plain["loss"]
    assert evaluate_main(["--load", str(gpt_run / "ckpt"), "--data-path", prefix, "--num-samples", "32",
                          "--micro-batch-size", "2", "--quantization", "fp8", "--no-progress"]) == 0
    assert abs(json.loads(capsys.readouterr().out)["loss"] - fp8["loss"]) < 1e-6


def test_bad_input(gpt_run, tmp_path, capsys):
    ck = str(gpt_run / "ckpt")
    for argv, words in [(["--load", ck, "--data-path", "d", "--text-file", "t"], "exactly one of"),
                        (["--load", str(tmp_path / "no"), "--text-file", "x"], "holds no complete checkpoint"),
                        (["--load", ck, "--text-file", str(tmp_path / "missing.txt")], "is unreadable"),
                        (["--load", ck, "--text-file", "x", "--pipeline-model-parallel-size", "3"],
                         "--pipeline-model-parallel-size 3 does not divide the checkpoint's"),
                        (["--load", ck, "--data-path", default_corpus(kind="gpt")[0], "--num-samples", "100000000"],
                         "--num-samples 100000000 is more than the")]:
        assert evaluate_main([*argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err


def test_bert_mlm_and_sentence_order_equal_train_logged(tmp_path):
    """One validation batch (BERT batches differ in masked-token counts, and training averages batch means)."""
    args = list(ARGS)
    args[args.index("--eval-iters") + 1] = "1"
    assert train_main(["--preset", "bert-tiny", *args, "--save", str(tmp_path / "ckpt"),
                       "--log-dir", str(tmp_path / "log")]) == 0
    logged = _val(str(tmp_path / "log"), 3)
    prefix, _ = default_corpus(kind="bert")
    out = evaluate_checkpoint(str(tmp_path / "ckpt"), data_paths=[prefix], num_samples=16, micro_batch_size=4,
                              tp=2, progress=False)
    assert abs(out["mlm_loss"] - logged["val_lm_loss"]) < 1e-5
    assert abs(out["sop_loss"] - logged["val_sop_loss"]) < 1e-5
    assert abs(out["sop_acc"] - logged["val_sop_acc"]) < 1e-6


def test_the_checkpoint_names_its_tokenizer_and_refuses_another(gpt_run, tmp_path, monkeypatch, capsys):
    """A checkpoint records its tokenizer's files by absolute path (read from any folder); a fine-tune whose
    tokenizer has another vocabulary is refused, and so is generating from a checkpoint with no tokenizer or
    whose tokenizer files have gone."""
    from types import SimpleNamespace

    from jax3d.config import Config, ConfigError, DataConfig, ModelConfig
    from jax3d.checkpoint.tokenizer import check_same_tokenizer, checkpoint_tokenizer, tokenizer_info
    from jax3d.checkpoint.read import read_meta

    monkeypatch.chdir(tmp_path)
    info = tokenizer_info(Config(data=DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file="tok/vocab.json",
                                                 merge_file="tok/merges.txt")))
    assert info["vocab_file"] == str(tmp_path / "tok" / "vocab.json") and info["tokenizer_file"] == ""

    ck = str(gpt_run / "ckpt")
    meta = read_meta(ck, 3)
    own = checkpoint_tokenizer(meta)  # the bundled corpus's
    check_same_tokenizer(ck, -1, own)
    with pytest.raises(ConfigError, match=f"--load {ck} was trained on a tokenizer of {own.vocab_size} tokens and "
                                          "this run's has 1000; .*the bundled corpus's, used without --data-path"):
        check_same_tokenizer(ck, -1, SimpleNamespace(vocab_size=1000))
    capsys.readouterr()
    # one of the same size that reads text otherwise (another Python's bundled BPE, say): refused
    other = SimpleNamespace(vocab_size=own.vocab_size, tokenize=lambda text: own.tokenize(text)[::-1])
    with pytest.raises(ConfigError, match=f"--load {ck} was trained on another tokenizer of the same "
                                          f"{own.vocab_size} tokens .*its files are in {ck}/tokenizer"):
        check_same_tokenizer(ck, -1, other)
    check_same_tokenizer(ck, -1, SimpleNamespace(vocab_size=own.vocab_size + 2))  # added tokens: allowed
    assert "this run's tokenizer has" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="records no tokenizer .*imported without tokenizer files"):
        checkpoint_tokenizer({"tokenizer": {"type": "", "vocab_size": None, "note": "imported without tokenizer files"}})
    # a checkpoint saved from code with no tokenizer record (as before this was written): the bundled one
    assert checkpoint_tokenizer({"tokenizer": {"type": "", "vocab_size": None}}).vocab_size == own.vocab_size
    assert tokenizer_info(Config())["note"] == "bundled default corpus tokenizer"  # a library run, no tokenizer
    # one on ids of another vocabulary (the README's 512) recorded the bundled tokenizer, whose files export copied
    assert tokenizer_info(Config(model=ModelConfig(vocab_size=512)))["note"] == "imported without tokenizer files"
    gone = {"tokenizer": {"type": "GPT2BPETokenizer", "vocab_file": str(tmp_path / "v.json"), "merge_file": ""}}
    with pytest.raises(ConfigError, match="tokenizer file .*v.json does not exist"):
        checkpoint_tokenizer(gone)


def test_a_small_validation_split_is_read_past_its_end_as_training_read_it(tmp_path, capsys):
    """With one validation sample per pass, training's validation read 32 (the split wraps around): the
    same count gives its logged loss; more than both is refused (it counted, or hung building, 1e8)."""
    prefix, _ = default_corpus(kind="gpt")
    d = tmp_path
    assert train_main(["--preset", "gpt-tiny", *ARGS, "--split", "998,2,0", "--save", str(d / "ckpt"),
                       "--log-dir", str(d / "log")]) == 0
    logged = _val(str(d / "log"), 3)
    out = evaluate_checkpoint(str(d / "ckpt"), data_paths=[prefix], num_samples=32, micro_batch_size=2,
                              progress=False)
    assert out["samples"] == 32 and abs(out["loss"] - logged["val_loss"]) < 1e-5
    assert evaluate_main(["--load", str(d / "ckpt"), "--data-path", prefix, "--num-samples", "33", "--no-progress"]) == 2
    assert "more than the 1 samples of the valid split (training validated on 32); pass at most 32" in capsys.readouterr().err
    # A blend is one pass over each of its sources (it scored one sample, whatever the data): the same
    # source twice at equal weights gives two samples, each the one sample alone, so the same loss.
    one = evaluate_checkpoint(str(d / "ckpt"), data_paths=[prefix], micro_batch_size=1, progress=False)
    two = evaluate_checkpoint(str(d / "ckpt"), data_paths=["0.5", prefix, "0.5", prefix], micro_batch_size=1,
                              progress=False)
    assert one["samples"] == 1 and two["samples"] == 2 and abs(two["loss"] - one["loss"]) < 1e-6
