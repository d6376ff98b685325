"""Every flag of Megatron-DeepSpeed's megatron/arguments.py (tests/fixtures/megatron_ds_arguments.txt, written by the
script beside it) is known to train.py, as a flag of its own or as a row of jax3d.cli.megatron's table with one
of the three decisions; and the rows that ACT do what they say."""
import glob
import os
import subprocess
import sys

import pytest

from jax3d.cli import megatron
from jax3d.cli.train import main
from jax3d.cli.train_flags import build_parser, config_from_args, given_flags
from jax3d.config import ConfigError
from jax3d.train.metrics import tensorboard_scalars
from jax3d.train.profile import StepTrace
from tests.helpers import ROOT

DATA = os.path.join(ROOT, "tests", "fixtures")
LIST = os.path.join(DATA, "megatron_ds_arguments.txt")
# Decided on other branches of issue 54 (each with its own tests); emptied when they merge.
TINY = ["--preset", "gpt-tiny", "--num-layers", "2", "--seq-length", "32", "--eval-interval", "0", "--no-progress",
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]


def read_list(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def undecided(names) -> list[str]:
    """The names train.py's parser does not know as they are spelt: `_option_string_actions`, not a parse, as
    argparse's allow_abbrev would take a prefix of a known flag."""
    known = build_parser()._option_string_actions
    return [n for n in names if n not in known]


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_the_list_is_every_option_string_of_megatron_deepspeeds_arguments():
    with open(LIST) as f:
        text = f.read()
    names = read_list(text)
    assert "f4157bea69f3df8c6cb66f2ebcda66ba03d1288e: 314 add_argument calls, 316 strings" in text.splitlines()[0]
    assert len(names) == len(set(names)) == 316 and {"--local-rank", "--local_rank", "--use-flash-attn-v1"} <= set(names)


def test_the_script_reads_the_add_argument_calls_with_ast(tmp_path):
    src = tmp_path / "arguments.py"
    src.write_text("def f(parser):\n"
                   "    g = parser.add_argument_group(title='--not-a-flag')\n"
                   "    g.add_argument('--a-b', '--a_b', type=int,\n"
                   "                   help='--not-one-either')\n"
                   "    g.add_argument(\"--c\", action='store_true')\n"
                   "    # g.add_argument('--commented-out')\n")
    out = subprocess.run([sys.executable, os.path.join(DATA, "megatron_ds_arguments.py"), str(src), "a test"],
                         capture_output=True, text=True, check=True).stdout
    assert read_list(out) == ["--a-b", "--a_b", "--c"]
    assert "at a test: 2 add_argument calls, 3 strings" in out


def test_every_flag_of_megatron_deepspeed_has_a_decision():
    with open(LIST) as f:
        names = read_list(f.read())
    assert undecided(names) == []
    names_in_table = [n for f in megatron.FLAGS for n in f.names]
    assert len(names_in_table) == len(set(names_in_table))  # one row a flag
    for f in megatron.FLAGS:
        assert f.decision in (megatron.ACT, megatron.ACCEPTED, megatron.REFUSED), f.names
        assert f.help and (f.what if f.decision == megatron.ACCEPTED else True), f.names
        if f.decision == megatron.REFUSED or f.asks is not None:
            assert f.feature and f.fix, f.names


def test_a_flag_added_upstream_without_a_decision_is_caught(tmp_path):
    """A copy of the list with a flag added (and a prefix of a known flag, which argparse would take for it)."""
    with open(LIST) as f:
        copy = f.read() + "--a-flag-added-upstream\n--use-distributed\n"
    assert undecided(read_list(copy)) == ["--a-flag-added-upstream", "--use-distributed"]


def test_use_distributed_optimizer_is_zero_1_unless_a_stage_is_given():
    assert _cfg().parallel.zero_stage is None  # the plan picks 1 with data parallelism, else 0
    assert _cfg("--use-distributed-optimizer").parallel.zero_stage == 1
    assert _cfg("--use-distributed-optimizer", "--zero-stage", "3").parallel.zero_stage == 3
    with pytest.raises(ConfigError, match="--use-distributed-optimizer shards the optimizer state over data "
                                          "parallelism and --zero-stage 0 keeps it whole; drop one"):
        _cfg("--use-distributed-optimizer", "--zero-stage", "0")


def test_recompute_activations_is_selective_recompute():
    assert (_cfg().model.recompute, _cfg("--recompute-activations").model.recompute) == ("none", "selective")
    assert _cfg("--recompute-activations", "--recompute-granularity", "selective").model.recompute == "selective"
    with pytest.raises(ConfigError, match="ask for different recomputation"):
        _cfg("--recompute-activations", "--checkpoint-activations")


def test_megatrons_other_names_set_train_flags():
    cfg = _cfg("--encoder-num-layers", "3", "--encoder-seq-length", "48")
    assert (cfg.model.num_layers, cfg.model.seq_length) == (3, 48)
    assert {"num_layers", "seq_length"} <= given_flags(["--encoder-num-layers", "3", "--encoder-seq-length", "48"])
    with pytest.raises(ConfigError, match="--encoder-num-layers 3 and --num-layers 2 set the same thing"):
        _cfg("--encoder-num-layers", "3", "--num-layers", "2")
    for tag in ("global_step7", "7"):
        ns = build_parser().parse_args(["--load", "ck", "--load-tag", tag])
        assert config_from_args(ns).train.ckpt_step == 7 and ns.ckpt_step == 7  # train.py reads ns.ckpt_step
    with pytest.raises(ConfigError, match="--load-tag latest names no step"):
        _cfg("--load", "ck", "--load-tag", "latest")
    cfg = _cfg("--aml-data-download-path", "/mnt/data", "--data-path", "0.3", "a/b", "0.7", "c")
    assert cfg.data.data_path == ("0.3", "/mnt/data/a/b", "0.7", "/mnt/data/c")


def test_schedule_switches_say_where_a_resumed_run_takes_its_schedule():
    assert "lr_warmup_iters" not in given_flags(["--lr", "1e-3"])
    assert {"lr", "min_lr", "lr_warmup_iters", "lr_decay_style"} <= given_flags(["--no-load-lr-state"])
    kept = given_flags(["--lr", "1e-3", "--seed", "3", "--use-checkpoint-opt_param-scheduler"])
    assert "seed" in kept and not kept & {"lr", "min_lr", "lr_decay_iters"}
    with pytest.raises(ConfigError, match="take the learning-rate schedule from different places"):
        _cfg("--use-checkpoint-opt_param-scheduler", "--override-opt_param-scheduler")


def test_checkpoint_switches_need_what_they_read(tmp_path, capsys):
    with pytest.raises(ConfigError, match="--use-checkpoint-args reads the model's arguments from --load"):
        _cfg("--use-checkpoint-args")
    # jax3d takes the model from --load's checkpoint on every run: the flag leaves the config as it was
    assert _cfg("--load", "ck", "--use-checkpoint-args") == _cfg("--load", "ck")
    with pytest.raises(ConfigError, match="--exit-signal-handler saves a checkpoint to --save on SIGTERM"):
        _cfg("--exit-signal-handler")
    assert _cfg("--save", str(tmp_path / "s"), "--exit-signal-handler") == _cfg("--save", str(tmp_path / "s"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([*TINY, "--load", str(empty), "--exit-on-missing-checkpoint", "--log-dir", str(tmp_path / "log")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no checkpoint and --exit-on-missing-checkpoint stops" in err


@pytest.mark.parametrize("argv, message", [
    (["--dataloader-type", "cyclic"], "the cyclic sampler"),
    (["--checkpoint-num-layers", "2"], "recompute units of more than one layer"),
    (["--DDP-impl", "FSDP"], "PyTorch FSDP, which jax3d does not build; pass --zero-stage 3"),
    (["--kd"], "knowledge distillation"),
    (["--num-layers-teacher", "4"], "knowledge distillation"),
    (["--random-ltd"], "random layer-token drop"),
    (["--skip-train"], "run launch/evaluate.py"),
    (["--vision-pretraining-type", "dino"], "vision models"),
    (["--retro-add-retriever"], "RETRO"),
    (["--ict-head-size", "128"], "ICT, biencoder and REALM"),
    (["--mos"], "knowledge distillation"),
    (["--num-experts-switch", "8"], "a mixture of experts"),
    (["--batch-size", "4"], "pass --micro-batch-size"),
])
def test_a_flag_asking_for_a_feature_stops_in_one_sentence(argv, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*argv)


def test_values_that_ask_for_nothing_are_accepted_and_meaningless_flags_are_named_once():
    base = _cfg()
    for argv in (["--dataloader-type", "single"], ["--checkpoint-num-layers", "1"], ["--img-h", "224"],
                 ["--kd-temp", "1.0"], ["--DDP-impl", "torch"], ["--remote-device", "none"], ["--mask-prob", "0.15"],
                 ["--short-seq-prob", "0.1"]):
        assert _cfg(*argv) == base, argv
    ns = build_parser().parse_args(["--no-bias-gelu-fusion", "--local_rank", "0", "--wandb-project", "p",
                                    "--use-cpu-initialization", "--empty-unused-memory-level", "1"])
    notes = megatron.header_notes(ns, config_from_args(ns))
    assert [n.split(" changes nothing here: ")[0] for n in notes] == [
        "jax3d: --no-bias-gelu-fusion", "jax3d: --use-cpu-initialization", "jax3d: --local-rank 0",
        "jax3d: --empty-unused-memory-level 1", "jax3d: --wandb-project p"]
    assert "the metrics go to --log-dir's metrics.jsonl" in notes[-1]


def test_mask_prob_and_short_seq_prob_reach_berts_samples():
    """The share of tokens BERT's samples mask follows --mask-prob (the bundled corpus, 32 samples)."""
    import numpy as np
    from jax3d.train.inputs import build_inputs

    shares = []
    for p in ("0.15", "0.4"):
        cfg = _cfg("--model", "bert", "--seq-length", "64", "--mask-prob", p, "--short-seq-prob", "0.2")
        assert (cfg.data.mask_prob, cfg.data.short_seq_prob) == (float(p), 0.2)
        train = build_inputs(cfg, 32, 0).train
        samples = [train[i] for i in range(32)]
        shares.append(sum(s["loss_mask"].sum() for s in samples) / sum(s["padding_mask"].sum() for s in samples))
    np.testing.assert_allclose(shares, [0.15, 0.4], atol=0.04)
    assert {"mask_prob"} <= given_flags(["--mask-prob", "0.2"])  # a resumed run keeps the checkpoint's otherwise
    with pytest.raises(ConfigError, match="--mask-prob 0.0 must be above 0 and at most 1"):
        _cfg("--mask-prob", "0")


def test_no_log_flags_leave_their_scalars_out_of_tensorboard():
    cfg = _cfg("--tensorboard-dir", "tb", "--no-log-learnig-rate-to-tensorboard", "--log-timers-to-tensorboard")
    assert cfg.train.tensorboard_log == ("timers", "no_learning_rate")
    record = {"loss": 2.0, "lr": 1e-3, "loss_scale": 1.0, "step_time_s": 0.1, "mem_gb": 3.0}
    assert tensorboard_scalars(record, cfg.train.tensorboard_log) == {"loss": 2.0, "loss_scale": 1.0,
                                                                      "step_time_s": 0.1}
    assert set(tensorboard_scalars(record, ("no_loss_scale",))) == {"loss", "lr"}


def test_profile_traces_the_steps_it_names(tmp_path):
    """--profile pt --profile_steps 2,3: a jax.profiler trace of this process's steps 2 and 3 in --log-dir."""
    assert _cfg("--profile", "pt").train.profile_steps == (2, 3)  # Megatron's default steps
    assert _cfg("--profile", "pt-full", "--profile_steps", "1,4", "--profile-ranks", "0").train.profile_ranks == (0,)
    assert _cfg("--profile_steps", "1,4").train.profile_steps == ()  # without --profile nothing is traced
    with pytest.raises(ConfigError, match="--profile_steps 3,2 must be FIRST,LAST"):
        _cfg("--profile", "pt", "--profile_steps", "3,2")
    log_dir = str(tmp_path / "log")
    assert main([*TINY, "--train-iters", "4", "--log-dir", log_dir, "--profile", "pt", "--profile_steps", "2,3"]) == 0
    assert glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.xplane.pb"))
    # a process not among --profile-ranks traces nothing
    trace = StepTrace((1, 2), (1,), str(tmp_path / "other"))
    for _ in range(3):
        trace.before_step()
        trace.after_step(None)
    assert not trace.tracing and not os.path.exists(tmp_path / "other")


def test_kill_switch_file_stops_before_the_next_step_without_a_save(tmp_path, capsys):
    switch, ck = tmp_path / "stop", tmp_path / "ck"
    assert _cfg("--kill-switch-file", str(switch)).train.kill_switch_file == str(switch)
    switch.write_text("")
    assert main([*TINY, "--train-iters", "3", "--save", str(ck), "--log-dir", str(tmp_path / "log"),
                 "--kill-switch-file", str(switch)]) == 0
    assert f"--kill-switch-file {switch} exists: stopping before step 1 without saving" in capsys.readouterr().err
    assert not os.path.exists(ck) or os.listdir(ck) == []
