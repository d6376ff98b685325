"""Megatron-DeepSpeed's weight-decay schedule, --lr-warmup-fraction, --log-params-norm / --log-num-zeros-in-grad
and per-split datasets (--train/valid/test-data-path) act as they do there."""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jax3d.cli.train import main
from jax3d.cli.train_flags import build_parser, config_from_args
from jax3d.config import ConfigError, OptimConfig
from jax3d.counts import settle
from jax3d.train.optimizer import decay_mask, lr_schedule, make_optimizer, weight_decay_schedule
from tests.helpers import tiny_config
from jax3d.parallel.plan import Plan
from tests.helpers import as_plan


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def megatron_wd(num_steps, incr_steps, start, end, style):
    """Megatron's OptimizerParamScheduler.get_wd, by hand."""
    if num_steps > incr_steps:
        return end
    ratio = num_steps / incr_steps
    coeff = ratio if style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1.0)
    return start + coeff * (end - start)


def megatron_lr(num_steps, *, max_lr, min_lr, warmup_steps, decay_steps, style):
    """Megatron's OptimizerParamScheduler.get_lr (steps or samples, no tokens), by hand."""
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * num_steps / warmup_steps
    if num_steps > decay_steps:
        return min_lr
    ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_the_weight_decay_follows_megatrons_schedule_and_each_update_is_adamws_at_that_decay(style):
    cfg = _cfg("--train-iters", "8", "--lr", "1e-2", "--clip-grad", "0", "--weight-decay-incr-style", style,
               "--start-weight-decay", "0.01", "--end-weight-decay", "0.3")
    wd = weight_decay_schedule(cfg.optim, 8)
    for k in range(11):  # the decay of update k, after k applied ones; flat past the run
        assert float(wd(k)) == pytest.approx(megatron_wd(k, 8, 0.01, 0.3, style), rel=1e-6)
    params = {"w": jax.random.normal(jax.random.key(0), (4, 3)), "bias": jnp.ones(3)}
    opt = make_optimizer(cfg.optim, 8)
    state = opt.init(params)
    ref_state = state[0]  # the chain's AdamW (no clipping)
    lr = lr_schedule(cfg.optim, 8)
    p = params
    for k in range(4):
        g = jax.tree.map(lambda a: jax.random.normal(jax.random.key(k + 1), a.shape), params)
        updates, state = opt.update(g, state, p)
        # the reference: optax's AdamW built with this update's decay, on the same state (the two share its form)
        ref = optax.adamw(lr, b1=0.9, b2=0.95, eps=1e-8, weight_decay=megatron_wd(k, 8, 0.01, 0.3, style),
                          mask=decay_mask)
        ref_updates, ref_state = ref.update(g, ref_state, p)
        for a, b in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates)):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
        p = optax.apply_updates(p, updates)
    assert jax.tree.structure(state[0]) == jax.tree.structure(ref_state)


def test_a_sample_counted_run_increases_the_decay_over_its_samples():
    cfg = settle(_cfg("--train-samples", "96", "--global-batch-size", "16", "--micro-batch-size", "2",
                      "--weight-decay-incr-style", "linear", "--start-weight-decay", "0", "--end-weight-decay", "0.1"))
    assert cfg.train.train_iters == 6 and cfg.optim.weight_decay_incr_samples == 96
    wd = weight_decay_schedule(cfg.optim, cfg.train.train_iters)
    for k in range(8):
        assert float(wd(k)) == pytest.approx(megatron_wd(16 * k, 96, 0.0, 0.1, "linear"), abs=1e-8)


@pytest.mark.parametrize("argv, message", [
    (["--start-weight-decay", "0.1"], "--start-weight-decay sets a weight-decay schedule, and "
     "--weight-decay-incr-style is constant"),
    (["--weight-decay-incr-style", "cosine", "--end-weight-decay", "0.1"], "needs both --start-weight-decay and "
     "--end-weight-decay"),
    (["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.2", "--end-weight-decay", "0.1"],
     "must rise from 0 or more"),
    (["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], "--lr-warmup-fraction 0.1 and --lr-warmup-iters 3 "
     "both set the warm-up; pass one"),
    (["--train-samples", "64", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "8"],
     "--lr-warmup-fraction 0.1 and --lr-warmup-samples 8 both set the warm-up"),
    (["--lr-warmup-fraction", "1.5"], "--lr-warmup-fraction 1.5 must be at least 0 and below 1"),
    (["--data-path", "a", "--train-data-path", "b"], "--data-path and --train-data-path both name the data"),
    (["--valid-data-path", "b", "--tokenizer-type", "GPT2BPETokenizer"], "--valid-data-path needs "
     "--train-data-path"),
])
def test_what_megatron_refuses_of_these_flags_is_one_sentence(argv, message, capsys):
    with pytest.raises(ConfigError) as e:
        _cfg(*argv)
    assert message in str(e.value)
    assert main([*argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv, decay, per_step", [
    (["--train-iters", "10", "--lr-warmup-fraction", "0.25"], 10, 1),  # 2.5 steps: ends between two
    (["--train-iters", "10", "--lr-decay-iters", "8", "--lr-warmup-fraction", "0.5", "--lr-decay-style", "linear"],
     8, 1),
    (["--train-samples", "160", "--global-batch-size", "16", "--micro-batch-size", "2", "--lr-warmup-fraction",
      "0.15"], 160, 16),  # counted in samples: 24 samples, a step and a half
])
def test_the_warmup_fraction_is_that_share_of_the_decay_as_in_megatron(argv, decay, per_step):
    cfg = settle(_cfg("--lr", "1e-3", "--min-lr", "1e-4", *argv))
    assert cfg.optim.lr_warmup_fraction > 0
    fraction, style = cfg.optim.lr_warmup_fraction, cfg.optim.lr_decay_style
    lr = lr_schedule(cfg.optim, cfg.train.train_iters)
    for k in range(12):
        want = megatron_lr(k * per_step, max_lr=1e-3, min_lr=1e-4, warmup_steps=fraction * decay, decay_steps=decay,
                           style=style)
        assert float(lr(k)) == pytest.approx(want, rel=1e-5, abs=1e-9), k


def _one_step(cfg, mesh_cfg, mesh, batch, reference: bool):
    from jax3d.train.step import build_steps

    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(0)
    # logical order, scale 1: what the direct computation counts
    grads = jax.device_get(steps.loss_and_grads(state.params, batch)[1]) if reference else None
    new, metrics = steps.train_step(state, jax.device_put(batch, steps.batch_sharding()))
    return jax.device_get(metrics), grads, jax.device_get(steps.logical_params(new.params))


@pytest.mark.slow
def test_params_norm_and_zeros_in_grad_are_megatrons_and_the_same_on_every_layout():
    """Untied embeddings and a batch of 32 of the 256 tokens leave most word-embedding rows without gradient; (2, 2, 2)
    stacks 3 layers on 2 stages with a padding row, whose zeros are not the model's."""
    kw = dict(model_kw={"num_layers": 3, "untie_embeddings_and_output_weights": True, "hidden_dropout": 0.0},
              log=True)
    text = np.random.RandomState(0).randint(0, 32, (16, 17)).astype(np.int32)
    got = {}
    for layout, extra in (((1, 1, 1), {}), ((8, 1, 1), {}), ((2, 2, 2), {"pipeline_layout": (1, 2)})):
        cfg, mesh_cfg, mesh = _tiny(layout, **kw, **extra)
        accum = cfg.train.global_batch_size // (cfg.train.micro_batch_size * mesh_cfg.data)
        batch = {"text": text.reshape(accum, -1, 17)}
        metrics, grads, params = _one_step(cfg, mesh_cfg, mesh, batch, reference=layout == (1, 1, 1))
        got[layout] = metrics
        if layout == (1, 1, 1):  # the direct computation, unsharded
            zeros = sum(int(np.sum(np.asarray(g) == 0)) for g in jax.tree.leaves(grads))
            norm = math.sqrt(sum(float(np.sum(np.asarray(p, np.float64) ** 2)) for p in jax.tree.leaves(params)))
            assert zeros >= 224 * 64  # the word embedding's rows of the 224 tokens not in the batch
            assert metrics["num_zeros_in_grad"] == zeros
            assert float(metrics["params_norm"]) == pytest.approx(norm, rel=1e-6)
    for layout in ((8, 1, 1), (2, 2, 2)):
        assert got[layout]["num_zeros_in_grad"] == got[(1, 1, 1)]["num_zeros_in_grad"], layout
        assert float(got[layout]["params_norm"]) == pytest.approx(float(got[(1, 1, 1)]["params_norm"]), rel=1e-6)
    from jax3d.train.step import abstract_batch, abstract_state, build_steps
    steps = build_steps(*as_plan(_tiny((1, 1, 1), **{**kw, "log": False})))
    with jax.set_mesh(steps.mesh):  # traced, not compiled: what the step returns when they are not asked for
        _, metrics = jax.eval_shape(steps.train_step.fn, abstract_state(steps),
                                    abstract_batch(steps, steps.model.sample_shapes()))
    assert "grad_norm" in metrics and "params_norm" not in metrics and "num_zeros_in_grad" not in metrics


def _tiny(layout, model_kw, log, **parallel):
    import dataclasses

    data, stage, model = layout
    cfg, mesh_cfg, mesh = tiny_config(data=data, stage=stage, model=model, micro=2, global_batch=16,
                                      model_kw=model_kw, **parallel)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, log_params_norm=log,
                                                             log_num_zeros_in_grad=log))
    return cfg, mesh_cfg, mesh


# ---- per-split datasets ------------------------------------------------------------------------------------------

BASE = ["--preset", "gpt-tiny", "--seq-length", "32", "--global-batch-size", "16", "--micro-batch-size", "2",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--log-interval", "1", "--no-progress"]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three corpora (train, valid, other) of one tokenizer, and its files."""
    from jax3d.data import TokenizerSpec, preprocess_jsonl, train_tokenizer
    from jax3d.data.synthetic import synthetic_documents, write_jsonl

    d = tmp_path_factory.mktemp("corpora")
    tok = train_tokenizer([], str(d / "tok"), "bpe", 400, texts=iter(synthetic_documents(600, seed=1)))
    out = {"tok": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tok["vocab_file"], "--merge-file",
                   tok["merge_file"]]}
    for name, seed, n in (("train", 3, 600), ("valid", 4, 200), ("other", 5, 200)):
        write_jsonl(str(d / f"{name}.jsonl"), synthetic_documents(n, seed=seed))
        out[name] = preprocess_jsonl(str(d / f"{name}.jsonl"), str(d / "data" / name), TokenizerSpec(
            "GPT2BPETokenizer", **tok), append_eod=True, progress=False).outputs[0]
    return out


def _records(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_a_run_on_separate_train_and_valid_data_reads_them_and_resumes_on_them(corpora, tmp_path, capsys):
    from jax3d.cli.evaluate import main as evaluate

    ck, logs = str(tmp_path / "ck"), str(tmp_path / "logs")
    paths = ["--train-data-path", corpora["train"], "--valid-data-path", corpora["valid"]]
    assert main([*BASE, *corpora["tok"], *paths, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "2",
                 "--log-params-norm", "--log-num-zeros-in-grad", "--save", ck, "--log-dir", logs]) == 0
    recs = _records(logs)
    val = [r["val_loss"] for r in recs if "val_loss" in r]
    assert len(val) == 1
    assert all("params_norm" in r and "num_zeros_in_grad" in r for r in recs if "loss" in r)
    # the validation loss is the valid file's, as launch/evaluate.py computes it over the same 32 samples (by
    # default the checkpoint's own --valid-data-path, read whole)
    capsys.readouterr()
    assert evaluate(["--load", ck, "--num-samples", "32", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(val[0], rel=1e-5)
    assert evaluate(["--load", ck, "--data-path", corpora["valid"], "--split", "0,1,0", "--num-samples", "32",
                     "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(val[0], rel=1e-5)
    assert evaluate(["--load", ck, "--split-name", "train", "--num-samples", "32", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] != pytest.approx(val[0], rel=1e-3)  # the train file's
    assert evaluate(["--load", ck, "--split-name", "test", "--no-progress"]) == 2
    assert "trained without --test-data-path" in capsys.readouterr().err

    # resumed: the checkpoint's datasets, found by fingerprint; other data refused unless --override-data
    assert main([*BASE, "--load", ck, "--save", ck, "--train-iters", "3", "--eval-interval", "0",
                 "--log-dir", logs]) == 0
    err = capsys.readouterr().err
    assert (f"continuing on its data (--train-data-path {os.path.relpath(corpora['train'])} --valid-data-path "
            f"{os.path.relpath(corpora['valid'])})") in err
    for argv in (["--train-data-path", corpora["other"], "--valid-data-path", corpora["valid"]],
                 ["--train-data-path", corpora["train"]], ["--data-path", corpora["train"]]):
        assert main([*BASE, "--load", ck, "--train-iters", "4", "--eval-interval", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert f"is not what --load {ck} was trained on (--train-data-path" in err and "--override-data" in err, err
    assert main([*BASE, "--load", ck, "--train-iters", "4", "--eval-interval", "0", "--override-data",
                 "--train-data-path", corpora["other"], *corpora["tok"]]) == 0
    assert main([*BASE, "--load", ck, "--train-iters", "4", "--eval-interval", "0", *paths]) == 0


def test_a_longer_resumed_run_keeps_the_checkpoints_weight_decay_schedule():
    """A resumed run, longer than the first, keeps the checkpoint's weight-decay schedule and its length, as Megatron
    keeps a checkpoint's."""
    from jax3d.train.resume import adopt_saved_run
    from jax3d.cli.train_flags import given_flags

    wd = ["--weight-decay-incr-style", "cosine", "--start-weight-decay", "0.0", "--end-weight-decay", "0.2"]
    saved = _cfg(*BASE, *wd, "--train-iters", "4")
    meta = {"step": 2, "config": saved.to_dict()}
    argv = [*BASE, "--train-iters", "8"]
    resumed = adopt_saved_run(_cfg(*argv), "ck", meta, given_flags(argv)).cfg
    assert resumed.optim.weight_decay_incr_style == "cosine" and resumed.optim.weight_decay_incr_iters == 4
    schedule = weight_decay_schedule(resumed.optim, 8)
    assert [float(schedule(k)) for k in range(6)] == pytest.approx([megatron_wd(k, 4, 0.0, 0.2, "cosine")
                                                                     for k in range(6)], abs=1e-7)


@pytest.mark.slow
def test_a_resumed_run_continues_the_weight_decay_schedule_exactly(tmp_path):
    """Stopped at step 2 of 4 and resumed: the same losses and weight norms as the uninterrupted run, which differ
    from a constant decay's (the schedule acts)."""
    base = ["--preset", "gpt-tiny", "--seq-length", "32", "--global-batch-size", "16", "--micro-batch-size", "2",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--lr", "1e-2",
            "--train-iters", "4", "--log-params-norm"]
    wd = ["--weight-decay-incr-style", "linear", "--start-weight-decay", "0.0", "--end-weight-decay", "0.5"]
    runs = {}
    for name, argv in (("whole", wd), ("constant", [])):
        assert main([*base, *argv, "--log-dir", str(tmp_path / name)]) == 0
        runs[name] = [(r["loss"], r["params_norm"]) for r in _records(tmp_path / name) if "loss" in r]
    ck, cut = str(tmp_path / "ck"), str(tmp_path / "cut")
    assert main([*base, *wd, "--exit-interval", "2", "--save", ck, "--log-dir", cut]) == 0
    assert main([*base, "--load", ck, "--log-dir", cut]) == 0  # the schedule from the checkpoint, no flag repeated
    got = [(r["loss"], r["params_norm"]) for r in _records(cut) if "loss" in r]
    np.testing.assert_allclose(got, runs["whole"], rtol=1e-6)
    assert runs["whole"][3][1] != pytest.approx(runs["constant"][3][1], rel=1e-4)


def test_a_resumed_sample_counted_run_adopts_no_derived_counts_and_says_nothing_of_iterations():
    """A run counted in samples resumed with its own flags: the plan derives its batch counts and steps again,
    so adoption takes neither (no "--counted-batch" among the adopted settings) and says nothing of an
    iteration-counted decay (the run decays over its samples)."""
    from jax3d.cli.train_flags import given_flags
    from jax3d.counts import settle
    from jax3d.train.resume import adopt_saved_run

    argv = [*BASE, "--train-samples", "64", "--lr-decay-style", "cosine", "--seed", "7"]
    saved = settle(_cfg(*argv))  # what the checkpoint records: the plan's settled config
    assert saved.train.train_iters == 4 and saved.optim.counted_batch
    adopted = adopt_saved_run(_cfg(*argv), "ck", {"step": 2, "config": saved.to_dict()}, given_flags(argv))
    assert not any("counted" in n or "iterations" in n for n in adopted.notes), adopted.notes
    assert adopted.cfg.optim.counted_batch == ()  # left for the plan's settle
    again = settle(adopted.cfg)
    assert again.optim.counted_batch == saved.optim.counted_batch and again.train == saved.train
