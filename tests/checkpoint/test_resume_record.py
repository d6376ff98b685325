"""A resumed run keeps its checkpoint's data and tokenizer; --finetune and --no-load-optim/--no-save-optim do as
Megatron's; damaged checkpoints and data of another tokenizer are named before any compile."""
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.data import TokenizerSpec, preprocess_jsonl, train_tokenizer
from jax3d.data.synthetic import synthetic_documents, write_jsonl
from jax3d.cli.train import main

# (8, 1, 1) compiles fastest; 32-token samples of a 16-sample batch keep 6 steps inside one pass of the data, so
# the sample order of a 4-step and a 6-step run is the same (it depends on the passes a run needs).
BASE = ["--preset", "gpt-tiny", "--seq-length", "32", "--global-batch-size", "16", "--micro-batch-size", "2",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--hidden-dropout", "0.1",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two corpora tokenized by tokenizer A (`a`, `b`) and one by tokenizer B (`c`), with A's files."""
    d = tmp_path_factory.mktemp("corpora")
    tok_a = train_tokenizer([], str(d / "tok_a"), "bpe", 400, texts=iter(synthetic_documents(800, seed=1)))
    tok_b = train_tokenizer([], str(d / "tok_b"), "bpe", 300, texts=iter(synthetic_documents(800, seed=2)))
    out = {"tok_a": tok_a, "tok_b": tok_b}
    for name, seed, files in (("a", 3, tok_a), ("b", 4, tok_a), ("c", 5, tok_b)):
        write_jsonl(str(d / f"{name}.jsonl"), synthetic_documents(800, seed=seed))
        out[name] = preprocess_jsonl(str(d / f"{name}.jsonl"), str(d / "data" / name),
                                     TokenizerSpec("GPT2BPETokenizer", **files), append_eod=True,
                                     progress=False).outputs[0]
    return out


def _data(corpora, name="a", tok="tok_a"):
    files = corpora[tok]
    return ["--data-path", corpora[name], "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
            files["vocab_file"], "--merge-file", files["merge_file"]]


def _metrics(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f) if "loss" in r}


def _checksums(directory):
    sums = {}
    for root, _, names in os.walk(directory):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                sums[os.path.relpath(os.path.join(root, n), directory)] = hashlib.sha256(f.read()).hexdigest()
    return sums


@pytest.fixture(scope="module")
def run4(corpora, tmp_path_factory):
    """A 4-step run on corpus a, saved at step 4, and its stderr."""
    d = tmp_path_factory.mktemp("run4")
    ck, logs = str(d / "ck"), str(d / "logs")
    assert main([*BASE, *_data(corpora), "--train-iters", "4", "--save", ck, "--log-dir", logs]) == 0
    return ck, logs


def test_resume_adopts_the_data_and_tokenizer_and_continues_the_curve(corpora, run4, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(run4[0], ck)
    logs = str(tmp_path / "logs")
    shutil.copytree(run4[1], logs)
    assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "6", "--log-dir", logs]) == 0
    err = capsys.readouterr().err
    assert f"jax3d: --load {ck}: continuing on its data ({os.path.relpath(corpora['a'])}, split 969,30,1)" in err
    assert "keeps the checkpoint's cosine decay over 4 iterations" in err
    assert f"jax3d: saved step 6 to {ck} (" in err
    # the reference: one uninterrupted run with the schedule the resumed run keeps
    ref = str(tmp_path / "ref")
    assert main([*BASE, *_data(corpora), "--train-iters", "6", "--lr-decay-iters", "4", "--log-dir", ref]) == 0
    got, want = _metrics(logs), _metrics(ref)
    assert sorted(got) == list(range(1, 7))
    np.testing.assert_allclose([got[s]["loss"] for s in range(1, 7)], [want[s]["loss"] for s in range(1, 7)],
                               rtol=0, atol=1e-6)


def test_other_data_is_refused_and_the_checkpoint_is_unchanged(corpora, run4, capsys):
    ck = run4[0]
    before = _checksums(ck)
    for argv, message in [
            (_data(corpora, "b"), f"--data-path {corpora['b']} is not what --load {ck} was trained on"),
            (["--split", "98,1,1"], "--split 98,1,1 is not what"),
            ([*_data(corpora, "a", "tok_b")], "--vocab-file"),
    ]:
        assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "6", *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "add --override-data to resume on this, or --finetune" in err, err
    assert _checksums(ck) == before


def test_moved_data_and_tokenizer_are_found_by_fingerprint(corpora, run4, tmp_path, capsys):
    moved = tmp_path / "moved"
    moved.mkdir()
    for ext in (".bin", ".idx"):
        shutil.copy(corpora["a"] + ext, str(moved / "a") + ext)
    ck = str(tmp_path / "ck")
    shutil.copytree(run4[0], ck)
    # the recorded corpus is gone: named, with the fix
    hidden = corpora["a"] + ".idx.hidden"
    os.rename(corpora["a"] + ".idx", hidden)
    try:
        assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "5"]) == 2
        assert f"was trained on --data-path {corpora['a']}, and" in capsys.readouterr().err
        # found where it moved (same .idx fingerprint); the tokenizer is the checkpoint's own copy
        argv = ["--data-path", str(moved / "a"), "--tokenizer-type", "GPT2BPETokenizer",
                "--vocab-file", os.path.join(ck, "tokenizer", "vocab.json"),
                "--merge-file", os.path.join(ck, "tokenizer", "merges.txt")]
        assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "5", *argv,
                     "--log-dir", str(tmp_path / "logs")]) == 0
    finally:
        os.rename(hidden, corpora["a"] + ".idx")
    assert "jax3d: saved step 5" in capsys.readouterr().err


def test_override_data_resumes_on_other_data(corpora, run4, tmp_path, capsys):
    ck = str(tmp_path / "ck")
    shutil.copytree(run4[0], ck)
    logs = str(tmp_path / "logs")
    assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "5", "--override-data", *_data(corpora, "b"),
                 "--log-dir", logs]) == 0
    assert sorted(_metrics(logs)) == [5]  # the step goes on


def test_finetune_starts_at_step_0_with_a_fresh_optimizer(corpora, tmp_path, capsys):
    """A base run at learning rate 0 keeps its initial weights but has Adam moments, a step and a data
    position; fine-tuning it must then be exactly a fresh run."""
    base = str(tmp_path / "base")
    assert main([*BASE, *_data(corpora), "--train-iters", "3", "--lr", "0", "--save", base,
                 "--log-dir", str(tmp_path / "b")]) == 0
    assert main([*BASE, *_data(corpora, "b"), "--load", base, "--finetune", "--train-iters", "4",
                 "--save", str(tmp_path / "ft"), "--log-dir", str(tmp_path / "ft_logs")]) == 0
    assert "fine-tuning from step 0 with a fresh optimizer" in capsys.readouterr().err
    assert main([*BASE, *_data(corpora, "b"), "--train-iters", "4", "--log-dir", str(tmp_path / "fresh")]) == 0
    got, want = _metrics(str(tmp_path / "ft_logs")), _metrics(str(tmp_path / "fresh"))
    assert sorted(got) == [1, 2, 3, 4]
    for s in got:
        assert got[s]["loss"] == want[s]["loss"] and got[s]["lr"] == want[s]["lr"]
    # --finetune may not save into the checkpoint it reads, whose steps its saves would replace
    assert main([*BASE, "--load", base, "--save", base, "--finetune"]) == 2
    assert "pass another --save" in capsys.readouterr().err


@pytest.mark.slow
def test_other_data_is_read_with_the_checkpoints_tokenizer_when_no_flag_names_one(corpora, run4, tmp_path, capsys):
    """--help says the checkpoint's tokenizer is the default: a fine-tune and an --override-data resume on other
    data stopped with "--data-path needs --tokenizer-type". They read it with the checkpoint's tokenizer, which
    the new checkpoint records as the base run's (same files, by fingerprint)."""
    from jax3d.checkpoint.read import read_meta

    base = read_meta(run4[0], 4)["tokenizer"]
    ck = str(tmp_path / "ck")
    shutil.copytree(run4[0], ck)
    for flag, extra, save, step in (("--data-path", ["--finetune", "--train-iters", "1"], str(tmp_path / "ft"), 1),
                                    ("--train-data-path", ["--finetune", "--train-iters", "1"], str(tmp_path / "f2"), 1),
                                    ("--data-path", ["--override-data", "--train-iters", "5"], ck, 5)):
        assert main([*BASE, "--load", ck, "--save", save, flag, corpora["b"], *extra,
                     "--log-dir", str(tmp_path / "logs" / save[-2:])]) == 0
        err = capsys.readouterr().err
        assert f"jax3d: --load {ck}: {flag} is read with its tokenizer (GPT2BPETokenizer: " in err, err
        record = read_meta(save, step)["tokenizer"]
        assert (record["type"], record["fingerprints"]) == (base["type"], base["fingerprints"])


def test_a_checkpoint_past_train_iters_is_refused_and_one_at_it_is_done(run4, capsys):
    ck = run4[0]
    assert main([*BASE, "--load", ck, "--train-iters", "2"]) == 2
    assert f"--load {ck} is at step 4, past --train-iters 2; raise --train-iters" in capsys.readouterr().err
    assert main([*BASE, "--load", ck, "--train-iters", "4"]) == 0
    assert "nothing to do: the checkpoint is already at step 4 of 4" in capsys.readouterr().err


def _restore(ck, **train):
    """The state of checkpoint `ck` restored at (8, 1, 1) as Checkpointer.restore gives it."""
    from jax3d.cli.train_flags import build_parser, config_from_args
    from jax3d.parallel.plan import resolve
    from jax3d.checkpoint.checkpointer import Checkpointer
    from jax3d.train.step import build_steps

    argv = [*BASE, "--load", ck, "--vocab-size", "512"]
    cfg = config_from_args(build_parser().parse_args(argv))
    cfg = cfg.replace(train=train)
    plan = resolve(cfg, jax.device_count(), 400, checkpoint=ck)
    steps = build_steps(plan)
    return Checkpointer(plan.cfg).restore(steps)[0]


def _named(tree, name):
    out = []
    jax.tree_util.tree_map_with_path(
        lambda p, x: out.append(np.asarray(x)) if any(getattr(k, "name", None) == name for k in p) else None, tree)
    return out


def test_no_load_optim_keeps_the_step_and_resets_the_moments(run4, tmp_path, capsys):
    ck = run4[0]
    full = _restore(ck)
    fresh = _restore(ck, no_load_optim=True)
    assert int(fresh.step) == int(full.step) == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(fresh.params), jax.device_get(full.params))
    assert any(np.abs(m).max() > 0 for m in _named(full.opt_state, "mu"))
    assert all(np.abs(m).max() == 0 for m in _named(fresh.opt_state, "mu") + _named(fresh.opt_state, "nu"))
    assert [int(c) for c in _named(fresh.opt_state, "count")] == [int(c) for c in _named(full.opt_state, "count")]
    # end to end: the step goes on at the schedule's place, and only the update differs
    runs = {}
    for name, extra in (("full", []), ("no_optim", ["--no-load-optim"])):
        d = str(tmp_path / name)
        shutil.copytree(ck, d)
        assert main([*BASE, "--load", d, "--save", d, "--train-iters", "6", "--log-dir", str(tmp_path / (name + "_logs")),
                     *extra]) == 0
        runs[name] = _metrics(str(tmp_path / (name + "_logs")))
    assert "Adam moments started anew (--no-load-optim)" in capsys.readouterr().err
    assert sorted(runs["no_optim"]) == [5, 6]
    assert runs["no_optim"][5]["loss"] == runs["full"][5]["loss"] and runs["no_optim"][5]["lr"] == runs["full"][5]["lr"]
    assert runs["no_optim"][6]["loss"] != runs["full"][6]["loss"]


def test_no_save_optim_and_rng_leave_them_out_and_loading_starts_them_fresh(corpora, tmp_path, capsys):
    small, full = str(tmp_path / "small"), str(tmp_path / "full")
    for d, extra in ((small, ["--no-save-optim", "--no-save-rng"]), (full, [])):
        assert main([*BASE, *_data(corpora), "--train-iters", "2", "--save", d, "--log-dir", d + "_logs", *extra]) == 0
    size = {d: sum(json.load(open(os.path.join(d, "2", "jax3d_files.json"))).values()) for d in (small, full)}
    assert size[small] < 0.5 * size[full]  # fp32 weights, against weights and two Adam moments
    capsys.readouterr()
    state = _restore(small)
    err = capsys.readouterr().err
    assert "Adam moments started anew (it was saved with --no-save-optim)" in err
    assert "RNG started anew (it was saved with --no-save-rng)" in err
    assert int(state.step) == 2 and all(np.abs(m).max() == 0 for m in _named(state.opt_state, "mu"))


def test_a_file_cut_short_is_named_before_the_step_compiles(run4, tmp_path, capsys, monkeypatch):
    from jax3d.train import loop

    ck = str(tmp_path / "ck")
    shutil.copytree(run4[0], ck)
    files = json.load(open(os.path.join(ck, "4", "jax3d_files.json")))
    rel = max((f for f in files if f.startswith("params/")), key=files.get)
    with open(os.path.join(ck, "4", rel), "r+b") as f:
        f.truncate(files[rel] // 2)
    monkeypatch.setattr(loop, "build_steps", lambda *a: pytest.fail("a damaged checkpoint's run built its step"))
    assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "6"]) == 2
    err = capsys.readouterr().err
    assert f"error: checkpoint {ck} step 4 is damaged: {os.path.join('4', rel)} holds {files[rel] // 2:,} bytes " \
           f"where {files[rel]:,} were saved" in err
    with pytest.raises(ConfigError, match="is damaged"):  # every reader checks, generation and export included
        from jax3d.checkpoint.read import restore_arrays
        restore_arrays(ck, 4, {})


def test_data_of_another_tokenizer_is_refused(corpora, run4, capsys):
    from jax3d.data import build_tokenizer
    from jax3d.cli.evaluate import main as evaluate
    from jax3d.train.inputs import check_tokenized_by

    tok_a = build_tokenizer("GPT2BPETokenizer", **corpora["tok_a"])
    for name in ("a", "b"):
        check_tokenized_by([corpora[name]], tok_a)  # its own
    with pytest.raises(ConfigError, match="was tokenized by another tokenizer than this run's"):
        check_tokenized_by([corpora["c"]], tok_a)
    assert evaluate(["--load", run4[0], "--data-path", corpora["c"]]) == 2
    assert f"error: --data-path {corpora['c']} was tokenized by another tokenizer than the checkpoint's" in \
        capsys.readouterr().err
    assert main([*BASE, *_data(corpora, "c", "tok_a"), "--train-iters", "1"]) == 2


def test_evaluate_reads_the_checkpoints_own_data_by_default(corpora, run4, capsys):
    from jax3d.cli.evaluate import main as evaluate

    assert evaluate(["--load", run4[0], "--no-progress"]) == 0
    own = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert evaluate(["--load", run4[0], "--no-progress", "--data-path", corpora["a"]]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == own
