"""Megatron-DeepSpeed's example scripts on jax3d: their arguments (tests/fixtures/megatron_ds_scripts, captured by
capture.py) parse with no unknown flag, and each plan resolves or stops on the feature jax3d does not build;
DeepSpeed's JSON, Megatron's sample- and token-counted schedules, the batch ramp, --exit-duration-in-mins,
TensorBoard's flags and SentencePiece tokenizers act as in Megatron-DeepSpeed."""
import glob
import json
import math
import os

import numpy as np
import pytest

from jax3d.cli import megatron
from jax3d.cli.train import main
from jax3d.cli.train_flags import build_parser, config_from_args
from jax3d.config import ConfigError
from jax3d.counts import BatchCounts, settle
from tests.helpers import ROOT

DATA = os.path.join(ROOT, "tests", "fixtures", "megatron_ds_scripts")
SCRIPTS = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(DATA, "*.json")))
# The scripts that ask for a feature jax3d does not build, and the words of the sentence that stops them.
REFUSED = {"ds_pretrain_gpt_1.3B_PR-MoE64or128": "mixture of experts", "ds_pretrain_gpt_125M_MoE64": "mixture of experts",
           "ds_pretrain_gpt_350M": "ZeRO-Offload", "ds_pretrain_gpt_1.3B_seq_parallel_32k": "DeepSpeed-Ulysses",
           "ds_pretrain_gpt_1.3B_rope_slw": "curriculum learning"}
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type", "--tokenizer-model")


def script(name: str) -> dict:
    with open(os.path.join(DATA, f"{name}.json")) as f:
        return json.load(f)


def _value(args, flag):
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def script_args(name: str, tmp_path, overrides=(), drop=DATA_FLAGS, files=None) -> list[str]:
    """The script's arguments as its trainer reads them (`--model bert` for pretrain_bert.py), with its DeepSpeed
    JSON written under `tmp_path`, the flags of `drop` (and their values) left out, the paths of those in `files`
    ({flag: path}; --data-path keeps its weights) replaced, each flag of `overrides` (pairs) set, and every output
    folder under `tmp_path`."""
    rec = script(name)
    out, args = [], list(rec["args"])
    if rec["trainer"] == "pretrain_bert.py":
        out += ["--model", "bert"]
    files = files or {}
    i = 0
    while i < len(args):
        flag = args[i].split("=")[0]
        n = 1
        while i + n < len(args) and not args[i + n].startswith("--"):
            n += 1
        values = args[i + 1:i + n] if "=" not in args[i] else [args[i].split("=", 1)[1]]
        if flag in files:
            out += [flag, *[v if _is_weight(v) else files[flag] for v in values]]
        elif flag not in drop:
            out += args[i:i + n]
        i += n
    if rec["deepspeed_config"] is not None:
        path = str(tmp_path / "ds_config.json")
        with open(path, "w") as f:
            json.dump(rec["deepspeed_config"], f)
        out = [f"--deepspeed_config={path}" if a.startswith("--deepspeed_config=") else a for a in out]
        out = [path if i and out[i - 1] == "--deepspeed_config" else a for i, a in enumerate(out)]
    outputs = [("--save", str(tmp_path / "ck")), ("--load", str(tmp_path / "ck")),
               ("--tensorboard-dir", str(tmp_path / "tb")), ("--log-dir", str(tmp_path / "log"))]
    for flag, v in [*[(f, v) for f, v in outputs if f in out or f == "--log-dir"], *overrides]:
        if flag in out:
            out[out.index(flag) + 1] = v
        else:
            out += [flag, v]
    return out


def _is_weight(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def _shrunk(name: str) -> list[tuple[str, str]]:
    """Sizes small enough to plan in a test, that still divide the script's tensor and pipeline sizes."""
    args = script(name)["args"]
    tp = int(_value(args, "--tensor-model-parallel-size") or 1)
    pp = 1 if "--no-pipeline-parallel" in args else int(_value(args, "--pipeline-model-parallel-size") or 1)
    heads = 2 * tp
    return [("--num-layers", str(2 * pp)), ("--num-attention-heads", str(heads)), ("--hidden-size", str(8 * heads)),
            ("--ffn-hidden-size", str(32 * heads)), ("--seq-length", "32"), ("--max-position-embeddings", "32")]


def test_the_flags_captured_from_the_scripts_and_how_many_the_table_adds():
    """The counts the issue reported, recomputed: flag uses over the captured scripts, and those the train
    parser knew before this table (its rows taken away)."""
    parser = build_parser()
    known = {o for a in parser._actions for o in a.option_strings}
    table = {n for f in megatron.FLAGS for n in f.names}
    uses = [a.split("=")[0] for name in SCRIPTS for a in script(name)["args"] if a.startswith("--")]
    assert len(SCRIPTS) == 21 and len(uses) == 1008
    assert sum(u not in known for u in uses) == 0
    # unknown to jax3d before the table (333 with the LLaMA flags' 25 uses, which train.py has since issue 31)
    assert sum(u in table for u in uses) == 308


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_script_parses_and_plans_or_names_the_feature_it_asks_for(name, tmp_path):
    from jax3d.parallel.plan import resolve

    args = script_args(name, tmp_path, _shrunk(name))
    ns, unknown = build_parser().parse_known_args(args)
    assert unknown == []
    refused = REFUSED.get(name)
    if refused:
        with pytest.raises(ConfigError, match=refused):
            config_from_args(ns)
        return
    cfg = config_from_args(ns)
    tp, pp = cfg.parallel.tensor_parallel or 1, cfg.parallel.pipeline_parallel or 1
    plan = resolve(cfg, tp * pp * 2, 50257)
    cfg = megatron.after_plan(ns, plan.cfg, plan.mesh.data)
    assert (plan.mesh.data, plan.mesh.stage, plan.mesh.model) == (2, pp, tp)
    assert cfg.train.global_batch_size == int(_value(args, "--global-batch-size"))


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_script_stops_in_one_sentence_with_exit_2_before_anything_compiles(name, tmp_path, capsys):
    assert main(script_args(name, tmp_path, _shrunk(name))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "which jax3d does not build" in err
    assert not os.path.exists(tmp_path / "log")  # nothing ran


def megatron_lr(num_steps, num_tokens, *, max_lr, min_lr, warmup_steps, decay_steps, warmup_tokens, decay_tokens,
                style):
    """Megatron-DeepSpeed's OptimizerParamScheduler.get_lr, restated: steps count samples, tokens override them."""
    if warmup_tokens is None:
        if warmup_steps > 0 and num_steps <= warmup_steps:
            return max_lr * num_steps / warmup_steps
    elif warmup_tokens > 0 and num_tokens <= warmup_tokens:
        return max_lr * num_tokens / warmup_tokens
    if style == "constant":
        return max_lr
    if (num_steps > decay_steps) if decay_tokens is None else (num_tokens > decay_tokens):
        return min_lr
    ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps) if decay_tokens is None else \
        (num_tokens - warmup_tokens) / (decay_tokens - warmup_tokens)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0) if style == "cosine" else 1.0 - ratio
    return min_lr + coeff * (max_lr - min_lr)


def test_the_125m_scripts_token_counted_warmup_and_decay_give_megatrons_rates(tmp_path):
    """ds_pretrain_gpt_125M.sh: 3B warm-up tokens, cosine decay over 300B tokens, global batch 256 x 2048 tokens.
    The rate of the update after k steps is Megatron's at k x 256 samples and k x 256 x 2048 tokens."""
    from jax3d.train.optimizer import lr_schedule

    cfg = settle(config_from_args(build_parser().parse_args(script_args("ds_pretrain_gpt_125M", tmp_path))))
    assert (cfg.optim.lr_warmup_tokens, cfg.optim.lr_decay_tokens) == (3_000_000_000, 300_000_000_000)
    assert cfg.train.train_iters == 292968750 // 256  # from --train-samples; --train-tokens stops it at half
    schedule = lr_schedule(cfg.optim, cfg.train.train_iters)
    batch, seq = 256, 2048
    for k in (0, 2000, 5722, 200_000, 600_000):  # warm-up, its last step, the decay, past its end
        want = megatron_lr(k * batch, k * batch * seq, max_lr=6e-4, min_lr=1e-6, warmup_steps=0,
                           decay_steps=292968750, warmup_tokens=3e9, decay_tokens=300e9, style="cosine")
        assert float(schedule(k)) == pytest.approx(want, rel=1e-5, abs=1e-12), k


def megatron_ramp(start, incr, ramp_samples, global_batch, train_samples):
    """Megatron's RampupBatchsizeNumMicroBatches and update_train_iters, restated: each step's batch, and the
    train iterations."""
    per_increment = ramp_samples / ((global_batch - start) // incr)

    def batch(consumed):
        return global_batch if consumed > ramp_samples else start + int(consumed / per_increment) * incr
    sizes, consumed = [], 0
    while consumed <= ramp_samples:
        sizes.append(batch(consumed))
        consumed += sizes[-1]
    return sizes, len(sizes) + (train_samples - consumed) // global_batch


@pytest.mark.parametrize("ramp, gbs, samples", [((32, 32, 1953125), 256, 439453125), ((8, 4, 24), 16, 112),
                                                ((4, 4, 10), 16, 50)])
def test_the_batch_ramp_and_run_length_are_megatrons(ramp, gbs, samples):
    counts = BatchCounts(gbs, 2048, ramp)
    sizes, iters = megatron_ramp(*ramp, gbs, samples)
    consumed = 0
    for k, size in enumerate(sizes):
        assert counts.samples_before(k) == consumed and counts.batch_at(consumed) == size
        consumed += size
    assert counts.steps_for_samples(samples) == iters


def _curve(log_dir, key="loss"):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return {r["step"]: r[key] for r in recs if key in r}


# A sample-counted run with a batch ramp (8, 8, 12, then 16), a token-counted warm-up and decay, and a token stop
# at 80 samples (step 7): tensor parallelism 2 leaves 4 data-parallel ranks, which divide every batch of the ramp.
RAMPED = ["--preset", "gpt-tiny", "--seq-length", "32", "--seed", "1", "--lr", "1e-3", "--hidden-dropout", "0",
          "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "0", "--no-progress",
          "--tensor-model-parallel-size", "2", "--micro-batch-size", "1", "--global-batch-size", "16",
          "--train-samples", "112", "--rampup-batch-size", "8", "4", "24", "--train-tokens", str(80 * 32),
          "--lr-warmup-tokens", str(20 * 32), "--lr-decay-tokens", str(100 * 32)]


@pytest.mark.slow
def test_exit_duration_saves_and_stops_and_the_resumed_run_continues_the_same_curve(tmp_path, capsys):
    whole = str(tmp_path / "whole")
    assert main([*RAMPED, "--log-dir", whole, "--tensorboard-dir", str(tmp_path / "tb"),
                 "--log-batch-size-to-tensorboard"]) == 0
    want, lrs = _curve(whole), _curve(whole, "lr")
    assert sorted(want) == list(range(1, 8))  # --train-tokens stopped it before --train-samples
    assert list(_curve(whole, "batch_size").values()) == [8, 8, 12, 16, 16, 16, 16]
    [events] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    with open(events, "rb") as f:
        tags = f.read()
    assert b"train/batch_size" in tags and b"train/loss" in tags and b"train/tokens_per_s" not in tags
    assert not glob.glob(os.path.join(whole, "events.out.tfevents.*"))
    counts = BatchCounts(16, 32, (8, 4, 24))
    for step, lr in lrs.items():  # the rate of update `step` is Megatron's at the tokens consumed before it
        tokens = counts.samples_before(step - 1) * 32
        assert lr == pytest.approx(megatron_lr(0, tokens, max_lr=1e-3, min_lr=6e-5, warmup_steps=0, decay_steps=112,
                                               warmup_tokens=640, decay_tokens=3200, style="cosine"), rel=1e-5)

    cut, ck = str(tmp_path / "cut"), str(tmp_path / "ck")
    capsys.readouterr()
    assert main([*RAMPED, "--log-dir", cut, "--save", ck, "--exit-duration-in-mins", "1e-6"]) == 0
    assert "--exit-duration-in-mins 1e-06: stopping at step 1 of 7" in capsys.readouterr().err
    assert sorted(_curve(cut)) == [1] and os.path.isdir(os.path.join(ck, "1"))
    assert main([*RAMPED, "--log-dir", cut, "--save", ck, "--load", ck]) == 0
    got = _curve(cut)
    assert sorted(got) == sorted(want)
    np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-6)
    np.testing.assert_allclose(list(_curve(cut, "lr").values()), list(lrs.values()), rtol=1e-6)


@pytest.mark.slow
def test_the_125m_script_trains_on_8_devices_with_its_deepspeed_json(tmp_path, capsys):
    """ds_pretrain_gpt_125M.sh's arguments with only sizes, data (the bundled corpus) and run length changed:
    tensor 2 x pipeline 2 x data 2, fp16 with the JSON's loss scaling, 64 micro-batches of 2."""
    tokens = 256 * 32
    args = script_args("ds_pretrain_gpt_125M", tmp_path, [
        *_shrunk("ds_pretrain_gpt_125M"), ("--train-samples", str(256 * 100)), ("--train-tokens", str(3 * tokens)),
        ("--lr-warmup-tokens", str(2 * tokens)), ("--lr-decay-tokens", str(3 * tokens)), ("--log-interval", "1")])
    assert main([*args, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "(data, stage, model) = (2, 2, 2)" in err and "1f1b pipeline over 64 micro-batches" in err
    assert "fp16 (dynamic loss scale from 2^11, window 500, hysteresis 2, min 1), gradient clipping 1" in err
    assert "--no-async-tensor-model-parallel-allreduce changes nothing here" in err
    losses, lrs = _curve(tmp_path / "log"), _curve(tmp_path / "log", "lr")
    assert sorted(losses) == [1, 2, 3] and all(np.isfinite(list(losses.values())))
    np.testing.assert_allclose(list(lrs.values()), [0.0, 3e-4, 6e-4], rtol=1e-5)
    assert os.path.isdir(tmp_path / "ck" / "3")
    [events] = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))  # the script's --log-*-to-tensorboard
    with open(events, "rb") as f:
        tags = f.read()
    for tag in (b"train/step_time_s", b"train/batch_size", b"train/optimizer/momentum_l2",
                b"train/optimizer/variance_sqrt_abs_max", b"train/optimizer/weight_l1", b"train/loss_scale"):
        assert tag in tags, tag
    assert b"train/mem_gb" not in tags  # no --log-memory-to-tensorboard


def _ds_json(tmp_path, **fields):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_the_deepspeed_json_sets_what_deepspeed_takes_from_it_and_names_what_it_replaced(tmp_path):
    path = _ds_json(tmp_path, train_batch_size=64, train_micro_batch_size_per_gpu=4, zero_optimization={"stage": 2},
                    fp16={"enabled": True, "initial_scale_power": 12}, gradient_clipping=0.5,
                    optimizer={"type": "AdamW", "params": {"lr": 1.0, "betas": [0.8, 0.9], "eps": 1e-6}},
                    steps_per_print=5, flops_profiler={"enabled": False})
    argv = ["--deepspeed", "--deepspeed_config", path, "--log-dir", str(tmp_path / "log")]
    cfg = _cfg(*argv)
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.parallel.zero_stage) == (64, 4, 2)
    assert (cfg.precision.dtype, cfg.precision.initial_loss_scale, cfg.precision.loss_scale_window) == \
        ("float16", 2.0 ** 12, 1000)
    assert (cfg.optim.clip_grad, cfg.optim.adam_beta1, cfg.optim.adam_beta2, cfg.optim.adam_eps) == \
        (0.5, 0.8, 0.9, 1e-6)
    assert cfg.optim.lr == 6e-4  # Megatron's scheduler sets the rate from --lr
    set_line, unused = megatron.header_notes(build_parser().parse_args(argv), cfg)
    assert "global batch 64, micro-batch 4, ZeRO-2, fp16 (dynamic loss scale from 2^12" in set_line
    assert "--clip-grad 1" in set_line and "--adam-beta1 0.9" in set_line
    assert unused.startswith(f"jax3d: --deepspeed_config {path}: unused: ") and "steps_per_print (" in unused
    assert "optimizer.params.lr (" in unused and "flops_profiler (" in unused


@pytest.mark.parametrize("fields, flags, message", [
    ({"train_batch_size": 64}, ["--global-batch-size", "32"],
     "--global-batch-size 32 and --deepspeed_config .*'s train_batch_size 64 disagree"),
    ({"train_micro_batch_size_per_gpu": 2}, ["--micro-batch-size", "4"], "train_micro_batch_size_per_gpu 2 disagree"),
    ({"zero_optimization": {"stage": 3}}, ["--zero-stage", "1"], "zero_optimization.stage 3 disagree"),
    ({"bf16": {"enabled": True}}, ["--fp16"], "--fp16 and --deepspeed_config .*, which enables bf16, disagree"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], "enables both fp16 and bf16"),
    ({"train_batch_size": "auto"}, [], "train_batch_size \"auto\""),
    ({"train_batch_size": 1.5}, [], "train_batch_size to 1.5; it must be a whole number"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, [], "offloads to the cpu"),
    ({"curriculum_learning": {"enabled": True}}, [], "curriculum learning"),
    ({"optimizer": {"type": "Lamb"}}, [], "'Lamb' optimizer"),
])
def test_a_deepspeed_json_that_disagrees_or_asks_for_more_is_one_sentence(fields, flags, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        _cfg("--deepspeed", "--deepspeed_config", _ds_json(tmp_path, **fields), *flags)


def test_bad_or_missing_json_is_one_sentence_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_batch_size": 8,}')
    for path, words in ((str(bad), "is not valid JSON (Expecting property name"), ("nope.json", "does not exist")):
        assert main(["--deepspeed", "--deepspeed_config", path, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err


def test_deepspeeds_accumulation_rule_is_checked_once_the_data_parallel_size_is_known(tmp_path):
    path = _ds_json(tmp_path, train_batch_size=32, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4)
    ns = build_parser().parse_args(["--deepspeed", "--deepspeed_config", path])
    cfg = config_from_args(ns)
    assert megatron.after_plan(ns, cfg, 4) is not None  # 32 = 2 x 4 x 4
    with pytest.raises(ConfigError, match="gradient_accumulation_steps 4 and the global batch 32 = micro-batch 2 x "
                                          "accumulation x 2 data-parallel ranks disagree; set it to 8"):
        megatron.after_plan(ns, cfg, 2)


@pytest.mark.parametrize("argv, message", [
    (["--train-iters", "10", "--train-samples", "100"], "--train-iters and --train-samples both"),
    (["--train-samples", "100", "--lr-warmup-iters", "2"], "pass --lr-warmup-samples instead"),
    (["--lr-decay-samples", "100"], "needs a run counted in samples"),
    (["--rampup-batch-size", "4", "4", "10"], "needs a run counted in samples"),
    (["--train-samples", "100", "--rampup-batch-size", "5", "4", "10", "--global-batch-size", "16"],
     "--rampup-batch-size 5 4 10 must start between 1 and the global batch 16 and reach it"),
    (["--no-pipeline-parallel", "--pipeline-model-parallel-size", "2"], "disagree; drop one"),
    (["--enable-zbh1-exact-semantics"], "refines --enable-zbh1-pipeline"),
    (["--optimizer", "sgd"], "SGD, which jax3d does not build"),
    (["--recompute-method", "block"], "block recompute"),
    (["--train-samples", "4", "--global-batch-size", "16"], "less than one global batch"),
    (["--lr-warmup-tokens", "100", "--lr-decay-tokens", "50", "--train-samples", "160"], "--lr-decay-tokens 50 must exceed"),
])
def test_what_megatron_refuses_is_refused_in_one_sentence(argv, message):
    with pytest.raises(ConfigError, match=message):
        cfg = settle(_cfg(*argv))  # the counts, as the plan settles them
        from jax3d.train.optimizer import lr_schedule
        lr_schedule(cfg.optim, cfg.train.train_iters)


def test_switches_that_act_set_what_they_name():
    cfg = settle(_cfg("--enable-zbh1-pipeline", "--no-pipeline-parallel", "--exit-duration-in-mins", "30",
                      "--tensorboard-dir", "tb", "--log-timers-to-tensorboard", "--train-samples", "320",
                      "--global-batch-size", "32", "--lr-warmup-samples", "64"))
    assert (cfg.parallel.pipeline_schedule, cfg.parallel.pipeline_parallel) == ("zb-h1", 1)
    assert (cfg.train.exit_duration_in_mins, cfg.train.tensorboard_dir, cfg.train.tensorboard_log) == \
        (30.0, "tb", ("timers",))
    assert (cfg.train.train_iters, cfg.optim.lr_decay_samples, cfg.optim.counted_batch) == (10, 320, (32, 128))


def test_override_opt_param_scheduler_keeps_the_command_lines_schedule_on_resume(tmp_path):
    from jax3d.cli.train_flags import given_flags

    assert "lr_warmup_iters" not in given_flags(["--lr", "1e-3"])
    assert {"lr", "min_lr", "lr_warmup_iters", "lr_decay_style"} <= given_flags(["--override-opt_param-scheduler"])
    path = _ds_json(tmp_path, train_batch_size=64, fp16={"enabled": True})
    assert {"global_batch_size", "fp16", "loss_scale_window", "clip_grad"} <= \
        given_flags(["--deepspeed", "--deepspeed_config", path])


def test_the_doc_holds_the_table():
    with open(os.path.join(ROOT, "docs", "megatron-deepspeed.md")) as f:
        assert megatron.doc_table() in f.read(), "regenerate the table: python -m jax3d.cli.megatron"
    decisions = [f.decision for f in megatron.FLAGS]
    assert set(decisions) == {megatron.ACT, megatron.ACCEPTED, megatron.REFUSED}


def test_a_sentencepiece_tokenizer_preprocesses_trains_and_is_kept_in_the_checkpoint(tmp_path):
    import sentencepiece

    from jax3d.checkpoint.read import read_meta
    from jax3d.cli.data import preprocess_main
    from jax3d.data.tokenizers import build_tokenizer

    text = [f"Document {i}: the pipeline sends activations forward and gradients back, {i * 7} times." for i in range(400)]
    (tmp_path / "corpus.txt").write_text("\n".join(text))
    sentencepiece.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                             vocab_size=300, model_type="bpe", pad_id=3, minloglevel=2)
    model = str(tmp_path / "sp.model")
    tok = build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=model)
    assert tok.vocab_size == 300 and tok.detokenize(tok.tokenize(text[3])) == text[3] and tok.eod == 2
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    prefix = str(tmp_path / "data" / "corpus")
    assert preprocess_main(["--input", str(tmp_path / "corpus.jsonl"), "--output-prefix", prefix, "--tokenizer-type",
                            "GPTSentencePieceTokenizer", "--tokenizer-model", model, "--append-eod",
                            "--no-progress"]) == 0
    ck = str(tmp_path / "ck")
    assert main(["--preset", "gpt-tiny", "--seq-length", "32", "--train-iters", "2", "--eval-interval", "0",
                 "--no-progress", "--data-path", f"{prefix}_text_document", "--tokenizer-type",
                 "GPTSentencePieceTokenizer", "--tokenizer-model", model, "--save", ck,
                 "--log-dir", str(tmp_path / "log")]) == 0
    record = read_meta(ck, 2)["tokenizer"]
    assert record["type"] == "GPTSentencePieceTokenizer" and record["vocab_size"] == 300
    assert record["tokenizer_model"] == os.path.join(ck, "tokenizer", "sp.model")
    assert set(record["fingerprints"]) == {"tokenizer_model"}


# Megatron's trainers default --tokenizer-type (pretrain_gpt.py: GPT2BPETokenizer, pretrain_bert.py:
# BertWordPieceLowerCase); the Llama script passes GPTSentencePieceTokenizer. What each run must read with.
SCRIPT_TOKENIZERS = {"ds_pretrain_gpt_125M": "GPT2BPETokenizer", "ds_pretrain_bert": "BertWordPieceLowerCase",
                     "pretrain_llama2_distributed": "GPTSentencePieceTokenizer"}


@pytest.fixture(scope="module")
def script_files(tmp_path_factory):
    """Small stand-ins for the three scripts' files, {script: {flag: path}}: a GPT-2 style vocab.json and
    merges.txt with a document dataset, a BERT vocab.txt with a sentence-split dataset, and a SentencePiece model
    with a sentence-split dataset (pretrain_llama2_distributed.sh's own _text_sentence)."""
    import sentencepiece

    from jax3d.data import TokenizerSpec, preprocess_jsonl, train_tokenizer
    from jax3d.data.synthetic import synthetic_documents, write_jsonl

    d = tmp_path_factory.mktemp("script_files")
    docs = synthetic_documents(300, seed=7, min_sentences=2, max_sentences=6)
    corpus = str(d / "corpus.jsonl")
    write_jsonl(corpus, docs)
    (d / "corpus.txt").write_text("\n".join(docs))
    gpt2 = train_tokenizer([], str(d / "gpt2"), "bpe", 400, texts=iter(docs))
    bert = train_tokenizer([], str(d / "bert"), "wordpiece", 400, texts=iter(docs))
    sentencepiece.SentencePieceTrainer.train(input=str(d / "corpus.txt"), model_prefix=str(d / "sp"),
                                             vocab_size=120, model_type="bpe", minloglevel=2)
    sp = {"tokenizer_model": str(d / "sp.model")}

    def data(name, kind, files, sentences):
        spec = TokenizerSpec(kind, **files)
        return preprocess_jsonl(corpus, str(d / "data" / name), spec, append_eod=kind != "BertWordPieceLowerCase",
                                split_sentences_=sentences, progress=False).outputs[0]

    return {"ds_pretrain_gpt_125M": {"--vocab-file": gpt2["vocab_file"], "--merge-file": gpt2["merge_file"],
                                     "--data-path": data("gpt", "GPT2BPETokenizer", gpt2, False)},
            "ds_pretrain_bert": {"--vocab-file": bert["vocab_file"],
                                 "--data-path": data("bert", "BertWordPieceLowerCase", bert, True)},
            "pretrain_llama2_distributed": {"--tokenizer-model": sp["tokenizer_model"],
                                            "--data-path": data("llama", "GPTSentencePieceTokenizer", sp, True)}}


@pytest.mark.parametrize("name", sorted(SCRIPT_TOKENIZERS))
def test_a_scripts_tokenizer_flags_read_as_its_trainer_reads_them(name, script_files, tmp_path):
    """The scripts' own tokenizer flags, their files replaced: no --tokenizer-type (GPT, BERT) is Megatron's
    per-trainer default, which reads text as that tokenizer built by name does."""
    from jax3d.data.tokenizers import build_tokenizer
    from jax3d.train.inputs import tokenizer_and_paths, with_default_tokenizer

    files = script_files[name]
    cfg = config_from_args(build_parser().parse_args(script_args(name, tmp_path, _shrunk(name), (), files)))
    want = SCRIPT_TOKENIZERS[name]
    assert with_default_tokenizer(cfg).data.tokenizer_type == want
    tok, paths = tokenizer_and_paths(cfg)
    keys = {"--vocab-file": "vocab_file", "--merge-file": "merge_file", "--tokenizer-model": "tokenizer_model"}
    reference = build_tokenizer(want, **{keys[f]: p for f, p in files.items() if f in keys})
    text = "The pipeline sends activations forward. Gradients come back!"
    assert type(tok).__name__ == want and tok.tokenize(text) == reference.tokenize(text)
    assert paths[-1] == files["--data-path"]


@pytest.mark.slow
@pytest.mark.parametrize("name, run_length", [
    ("ds_pretrain_gpt_125M", [("--train-samples", str(256 * 100)), ("--train-tokens", str(2 * 256 * 32)),
                              ("--lr-warmup-tokens", str(256 * 32)), ("--lr-decay-tokens", str(2 * 256 * 32))]),
    ("pretrain_llama2_distributed", [("--train-iters", "2"), ("--lr-warmup-iters", "1"), ("--save-interval", "2")]),
    ("ds_pretrain_bert", [("--train-iters", "2"), ("--lr-warmup-iters", "1"), ("--lr-decay-iters", "2")]),
])
def test_a_script_trains_on_8_devices_with_its_own_tokenizer_flags(name, run_length, script_files, tmp_path, capsys):
    """The three scripts of issue 54 as written but for sizes, paths and run length: no tokenizer flag added.
    The checkpoint records the tokenizer Megatron's trainer would read with, built from the files given."""
    from jax3d.checkpoint.read import list_steps, read_meta
    from jax3d.checkpoint.record import file_fingerprint
    from jax3d.data import IndexedDataset

    files = script_files[name]
    args = script_args(name, tmp_path, [*_shrunk(name), *run_length, ("--log-interval", "1")], (), files)
    assert not {"--tokenizer-type", "--tokenizer-file"} & set(args) - set(script(name)["args"])
    assert main([*args, "--no-progress"]) == 0
    losses = _curve(tmp_path / "log")
    assert sorted(losses) == [1, 2] and all(np.isfinite(list(losses.values())))
    record = read_meta(str(tmp_path / "ck"), list_steps(str(tmp_path / "ck"))[-1])["tokenizer"]
    assert record["type"] == SCRIPT_TOKENIZERS[name]
    keys = {"--vocab-file": "vocab_file", "--merge-file": "merge_file", "--tokenizer-model": "tokenizer_model"}
    assert record["fingerprints"] == {keys[f]: file_fingerprint(p) for f, p in files.items() if f in keys}
    if name != "ds_pretrain_gpt_125M":  # sentence-split data, as the script's _text_sentence prefix says
        ds = IndexedDataset(files["--data-path"])
        assert len(ds) > ds.num_documents
