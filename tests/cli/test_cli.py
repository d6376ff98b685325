"""launch/train.py end to end: bad input fails cleanly, and the layout never changes the loss curve."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jax3d.cli.train import main
from tests.helpers import ROOT, free_port, subprocess_env

TRAIN = os.path.join(ROOT, "launch", "train.py")
# 32-token sequences and 10 steps keep each run short; the raised learning rate keeps the reference's loss
# falling by more than the 0.5 the layout tests ask of it.
BASE = ["--preset", "gpt-tiny", "--seed", "1", "--train-iters", "10", "--seq-length", "32", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "1", "--eval-interval", "0",
        "--no-progress"]
LAYERS = ["--num-layers", "4"]  # so that 4 pipeline stages fit


def _losses(log_dir):
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return np.array([json.loads(line)["loss"] for line in f if '"loss"' in line])


@pytest.mark.parametrize("argv, message", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size 3"),
    (["--preset", "gpt-9b"], "unknown --preset"),
    (["--num-attention-heads", "6", "--tensor-model-parallel-size", "4"], "--num-attention-heads 6 is not divisible"),
    (["--global-batch-size", "30"], "--global-batch-size 30 is not divisible"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--pipeline-model-parallel-layout", "3,x"], "must be comma-separated layer counts"),
    (["--coordinator-address", "localhost:1", "--num-processes", "2", "--process-id", "5"],
     "--process-id 5 must be below --num-processes 2"),
    (["--process-id", "1"], "--process-id 1 is no run jax3d can join"),  # it ran as one process
    (["--seq-length", "256", "--max-position-embeddings", "128"], "error: --seq-length 256 exceeds --max-position-embeddings 128"),
    (["--data-path", "/nonexistent/corpus", "--tokenizer-type", "GPT2BPETokenizer"], "error:"),
    (["--compilation-cache-dir", TRAIN], f"--compilation-cache-dir {TRAIN} is a file; pass a directory"),
])
def test_bad_input_fails_with_one_sentence(argv, message, tmp_path):
    out = subprocess.run([sys.executable, TRAIN, *argv, "--log-dir", str(tmp_path)], capture_output=True,
                         text=True, env=subprocess_env(), timeout=300)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert message in out.stderr
    assert len([l for l in out.stderr.splitlines() if l.startswith("error:")]) == 1


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch-size", "0"], "--micro-batch-size 0 must be at least 1"),
    (["--global-batch-size", "0"], "--global-batch-size 0 must be at least 1"),
    (["--lr", "-1"], "--lr -1.0 must not be negative"),
    (["--save-interval", "-1"], "--save-interval -1 must not be negative"),
    (["--keep-checkpoints", "-2"], "--keep-checkpoints -2 must not be negative"),
    (["--adam-beta2", "1.5"], "--adam-beta2 1.5 must be in [0, 1)"),
    (["--save", "README.md"], "--save README.md is a file, not a directory"),
    (["--log-dir", "README.md/run"], "--log-dir README.md/run lies inside"),
    (["--save", "/sys/jax3d-ckpt"], "--save /sys/jax3d-ckpt cannot be written"),  # not even by root
    (["--vocab-file", "v.json", "--merge-file", "m.txt"], "--data-path is not given, so --vocab-file, --merge-file"),
    (["--layernorm-epsilon", "-1"], "--layernorm-epsilon -1.0 must be positive"),  # these trained to NaN
    (["--fp16", "--initial-loss-scale", "0"], "--initial-loss-scale 0.0 must be positive"),
    (["--adam-eps", "-1"], "--adam-eps -1.0 must be positive"),
    (["--hysteresis", "0"], "--hysteresis 0 must be at least 1"),
    (["--ffn-hidden-size", "-8"], "--ffn-hidden-size -8 must be at least 1"),  # a traceback from XLA
    (["--min-lr", "1", "--lr", "0.001"], "--min-lr 1.0 is above --lr 0.001"),
    (["--pipeline-model-parallel-layout", "0,2"], "leaves a stage without layers"),
    (["--recompute", "none", "--checkpoint-activations"], "ask for different recomputation"),  # one won silently
    (["--bf16", "--loss-scale", "128"], "--loss-scale 128.0 scales fp16 gradients"),
    (["--ckpt-step", "2"], "--ckpt-step 2 picks a step of --load, which is not given"),  # trained from scratch
])
def test_out_of_range_values_are_refused_not_replaced(argv, message, monkeypatch):
    """A zero batch size is not silently taken as "the preset's", nor a negative interval as "never"."""
    from jax3d.cli.train_flags import build_parser, config_from_args
    from jax3d.config import ConfigError

    monkeypatch.chdir(ROOT)
    with pytest.raises(ConfigError) as e:
        config_from_args(build_parser().parse_args(argv))
    assert message in str(e.value)


def test_virtual_stages_select_the_interleaved_schedule():
    """As in Megatron, --num-layers-per-virtual-pipeline-stage alone means the interleaved schedule; a
    schedule given beside it is kept (and refused by the layout check when it is not interleaved). The
    command line leaves the choice open; the plan makes it."""
    from jax3d.cli.train_flags import build_parser, config_from_args
    from jax3d.parallel.plan import resolve

    def config(*argv):
        return config_from_args(build_parser().parse_args(["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                                           "--tensor-model-parallel-size", "1", *argv]))

    def schedule(*argv):
        cfg = config(*argv)
        assert cfg.parallel.pipeline_schedule is None
        return resolve(cfg, 2, 256).cfg.parallel.pipeline_schedule

    assert schedule() == "1f1b"
    assert schedule("--num-layers-per-virtual-pipeline-stage", "1") == "interleaved"
    given = config("--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-schedule", "gpipe")
    assert given.parallel.pipeline_schedule == "gpipe"


def _run(tmp_path, name, *extra):
    log_dir = str(tmp_path / name)
    assert main([*BASE, "--log-dir", log_dir, *extra]) == 0
    return _losses(log_dir)


@pytest.fixture(scope="module")
def layout_losses(tmp_path_factory):
    """Loss curve of the 4-layer tiny GPT on a (tp, pp, schedule, zero) layout, each trained once for the
    module: the (8, 1, 1) reference serves every comparison, and the tp=2 run the two-process test."""
    runs = {}

    def get(tp, pp=1, schedule="1f1b", zero=None):  # zero None: the default, ZeRO-1 with data parallelism
        key = (tp, pp, schedule, zero)
        if key not in runs:
            extra = ["--num-layers-per-virtual-pipeline-stage", "1"] if schedule == "interleaved" else []
            extra += [] if zero is None else ["--zero-stage", str(zero)]
            runs[key] = _run(tmp_path_factory.mktemp("layout"), "log", *LAYERS, *extra,
                             "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                             "--pipeline-schedule", schedule)
        return runs[key]
    return get


@pytest.mark.slow
def test_data_model_layouts_give_the_same_losses(layout_losses):
    """(data, model) = (8, 1), (4, 2), (1, 8) at the same global batch; model 4 is the pipelined test's
    (4, 2, interleaved) layout."""
    ref = layout_losses(1)
    assert len(ref) == 10 and ref[-1] < ref[0] - 0.5
    for tp in (2, 8):
        np.testing.assert_allclose(layout_losses(tp), ref, atol=1e-3, err_msg=f"tp={tp}")


@pytest.mark.slow
def test_pipelined_layouts_give_the_same_losses(layout_losses):
    """The pipeline flags through the command line. GPipe, which the flags select like the others
    (test_virtual_stages_select_the_interleaved_schedule above), trains on every mesh in
    tests/pipeline/test_pipeline_loop.py."""
    ref = layout_losses(1)
    for tp, pp, schedule, zero in [(2, 2, "1f1b", 1), (1, 4, "zb-h1", 2), (4, 2, "interleaved", 3)]:
        np.testing.assert_allclose(layout_losses(tp, pp, schedule, zero), ref, atol=1e-3,
                                   err_msg=f"{tp=} {pp=} {schedule}")


@pytest.mark.slow
def test_two_processes_match_one(layout_losses, tmp_path):
    """2 processes x 4 CPU devices produce the losses of 1 process x 8."""
    ref = layout_losses(2)
    port = free_port()
    log_dir = str(tmp_path / "two")
    args = [*BASE, *LAYERS, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--pipeline-schedule", "1f1b"]
    procs = [subprocess.Popen([sys.executable, TRAIN, *args, "--cpu-devices", "4", "--num-processes", "2",
                               "--process-id", str(i), "--coordinator-address", f"127.0.0.1:{port}",
                               "--log-dir", log_dir], env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    np.testing.assert_allclose(_losses(log_dir), ref, atol=1e-5)


def test_a_second_run_reads_its_compiled_step_from_the_compilation_cache(tmp_path):
    """With --compilation-cache-dir, a second run of the same command compiles nothing it can read back (JAX logs
    the cache hit of its train step) and trains as the first did."""
    cache = tmp_path / "xla"
    # JAX then logs persistent-cache hits as warnings, and keeps every program, however quick its compile
    env = {**subprocess_env(), "JAX_LOG_COMPILES": "1", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}

    def run(name):
        log_dir = str(tmp_path / name)
        out = subprocess.run([sys.executable, TRAIN, *BASE, "--train-iters", "2", "--compilation-cache-dir", str(cache),
                              "--log-dir", log_dir], capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stderr, _losses(log_dir)

    first, losses = run("first")
    assert "Persistent compilation cache hit for 'jit_train_step'" not in first
    assert any(f.name.startswith("jit_train_step") for f in cache.iterdir())
    second, again = run("second")
    assert "Persistent compilation cache hit for 'jit_train_step'" in second
    np.testing.assert_array_equal(again, losses)


def test_no_progress_prints_one_line_per_log_interval(tmp_path, capsys):
    """Without the bar, each log interval prints a line whose losses are the logged ones."""
    log_dir = str(tmp_path / "log")
    assert main([*BASE, "--train-iters", "4", "--log-interval", "2", "--log-dir", log_dir,
                 "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]) == 0
    out = capsys.readouterr()
    lines = [l for l in out.out.splitlines() if l.startswith("step ")]
    assert [l.split(" | ")[0] for l in lines] == ["step 2/4", "step 4/4"]
    assert out.err.rstrip().endswith("no --save was given, so the trained model was not kept; add --save DIR to keep it")
    printed = [float(l.split(" | loss ")[1].split(" |")[0]) for l in lines]
    np.testing.assert_allclose(printed, _losses(log_dir), atol=1e-4)


def test_a_step_that_cannot_fit_exits_2_with_one_sentence_unless_the_check_is_off(tmp_path, monkeypatch, capsys):
    """The host is made to offer 1 MiB: the guard's sentence and exit 2; --no-memory-check trains anyway."""
    from jax3d.train import memory
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2**20)
    argv = [*BASE, "--train-iters", "1", "--log-dir", str(tmp_path), "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "emulated devices" in errors[0] and "but this host has 0.0 GiB free" in errors[0]
    assert "--recompute full" in errors[0] and "--no-memory-check" in errors[0]
    assert main([*argv, "--no-memory-check"]) == 0
    assert len(_losses(tmp_path)) == 1


def test_dry_run_reports_the_peak_the_memory_guard_checks(tmp_path, monkeypatch, capsys):
    """32 layers, so the plan scans them: --dry-run and the real run compile the same step."""
    from jax3d.config import ConfigError
    from jax3d.train import loop, memory

    checked = []

    def record(compiled, **_):
        checked.append(memory.step_peak_bytes(compiled))
        raise ConfigError("stopped after the guard's figure")

    monkeypatch.setattr(loop, "check_fits", record)
    argv = [*BASE, "--train-iters", "1", "--log-dir", str(tmp_path), "--num-layers", "32", "--hidden-size", "32",
            "--num-attention-heads", "2", "--seq-length", "32", "--tensor-model-parallel-size", "1",
            "--pipeline-model-parallel-size", "1"]
    assert main(argv) == 2
    assert main([*argv, "--dry-run"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["scan_layers"] is True and report["peak"] == checked[0]


def test_fields_adopted_from_the_checkpoint_are_blamed_on_it(tmp_path, monkeypatch, capsys):
    from jax3d.train import resume as checkpoint

    monkeypatch.setattr(checkpoint, "adopt_saved_model", lambda cfg, *a: (cfg.replace(model={"vocab_size": 128}), {"vocab_size"}))
    assert main([*BASE, "--load", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"error: the checkpoint in --load {tmp_path / 'ckpt'} has a vocabulary of 128, smaller than" in err
    # any other field the checkpoint supplied is said to come from it when a rule fails on it
    monkeypatch.setattr(checkpoint, "adopt_saved_model", lambda cfg, *a: (cfg.replace(model={"num_attention_heads": 2}),
                                                                          {"num_attention_heads"}))
    assert main([*BASE, "--tensor-model-parallel-size", "4", "--load", str(tmp_path / "ckpt"),
                 "--log-dir", str(tmp_path)]) == 2
    assert (f"error: --num-attention-heads 2 (from the checkpoint in --load {tmp_path / 'ckpt'}) is not divisible "
            "by --tensor-model-parallel-size 4; pass one of 1, 2") in capsys.readouterr().err


@pytest.mark.slow
def test_an_interleaved_run_resumes_like_the_uninterrupted_one(tmp_path):
    """The loop hands the checkpointer its steps' conversion to logical order: an interleaved run (its layers
    kept in pipeline order) saves halfway, and the resumed curve is the uninterrupted one's."""
    inter = [*LAYERS, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
             "--train-iters", "4"]
    whole = _run(tmp_path, "whole", *inter)
    d = str(tmp_path / "ckpt")
    first = _run(tmp_path, "first", *inter, "--save", d, "--save-interval", "2", "--exit-interval", "2")
    rest = _run(tmp_path, "rest", *inter, "--load", d, "--save", d, "--save-interval", "2")
    assert len(whole) == 4 and (len(first), len(rest)) == (2, 2)
    np.testing.assert_allclose(np.concatenate([first, rest]), whole, rtol=1e-6)


def test_one_process_flags_and_launchers_still_run(monkeypatch):
    """--num-processes 1 --process-id 0 (a launcher at one process) is one process, and under SLURM a
    --process-id alone leaves the rest to SLURM's environment; neither is refused. The runtime is joined
    exactly where flags or the launcher say there are several processes."""
    import jax

    from jax3d.config import ConfigError
    from jax3d.parallel.mesh import init_distributed

    joined = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a: joined.append(a))
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    init_distributed("", 1, 0)
    init_distributed("", 0, 0)
    with pytest.raises(ConfigError, match="--process-id 3 is no run jax3d can join"):
        init_distributed("", 0, 3)  # a process id past 0 with no launcher would run alone
    assert joined == []
    monkeypatch.setenv("SLURM_NTASKS", "1")
    init_distributed("", 0, 3)
    assert joined == []  # SLURM with one task: one process
    monkeypatch.setenv("SLURM_NTASKS", "4")
    init_distributed("", 0, 3)
    init_distributed("host:1234", 2, 1)
    assert joined == [(), ("host:1234", 2, 1)]  # SLURM's environment, then the flags


def test_sequence_parallel_without_tensor_parallelism_says_it_does_nothing(tmp_path, capsys):
    """As Megatron warns and turns it off: at tensor parallel 1 the flag shards nothing; at 2 no note."""
    for tp, noted in (("1", True), ("2", False)):
        assert main(["--sequence-parallel", "--tensor-model-parallel-size", tp, "--dry-run",
                     "--log-dir", str(tmp_path)]) == 0
        assert ("--sequence-parallel shards activations over tensor parallelism" in capsys.readouterr().err) == noted


def test_the_header_names_the_pipeline_and_a_schedule_without_one_is_noted(tmp_path, capsys):
    """The run's first line gives the schedule, the micro-batch count and an uneven layout; a schedule asked
    for at one stage says it changes nothing, as interleaved (which needs a pipeline) is refused."""
    assert main(["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "3,1", "--num-layers",
                 "4", "--pipeline-schedule", "zb-h1", "--dry-run", "--log-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "(4, 2, 1), as given; zb-h1 pipeline over 2 micro-batches, layers 3,1; ZeRO-1" in err
    assert "changes nothing" not in err
    assert main(["--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", "1", "--dry-run",
                 "--log-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "--pipeline-schedule zb-h1 orders a pipeline's passes" in err and " pipeline over " not in err


def test_commands_end_quietly_on_ctrl_c_a_closed_pipe_and_bad_input():
    """Every launcher's main goes through run_command: Ctrl-C is one word and exit 130, a reader that went
    away (`generate.py ... | head`) a quiet exit 141, bad input one sentence and exit 2; anything else is a
    real bug and keeps its traceback."""
    program = """
import sys
from jax3d.cli.common import run_command
from jax3d.config import ConfigError
def main(argv):
    if argv[0] == "pipe":
        for i in range(100000):
            print("line", i)
    if argv[0] == "ctrl-c":
        raise KeyboardInterrupt
    if argv[0] == "bad":
        raise ConfigError("--flag 3 must be 2")
    if argv[0] == "other-pipe":  # a pipe other than stdout: a bug, with its traceback
        raise BrokenPipeError(32, "a worker pipe")
    raise RuntimeError("a bug")
sys.exit(run_command(main, sys.argv[1:], lambda: (ConfigError,)))
"""
    def run(what, pipe=False):
        cmd = f"{sys.executable} -c '{program}' {what}" + (" | head -1; exit ${PIPESTATUS[0]}" if pipe else "")
        return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=subprocess_env(), timeout=60)
    r = run("pipe", pipe=True)
    assert (r.returncode, r.stdout, r.stderr) == (141, "line 0\n", "")
    r = run("ctrl-c")
    assert (r.returncode, r.stderr) == (130, "interrupted\n")
    r = run("bad")
    assert (r.returncode, r.stderr) == (2, "error: --flag 3 must be 2\n")
    r = run("bug")
    assert r.returncode == 1 and "Traceback" in r.stderr and "RuntimeError: a bug" in r.stderr
    r = run("other-pipe", pipe=True)
    assert r.returncode == 1 and "BrokenPipeError: [Errno 32] a worker pipe" in r.stderr


def test_a_numbered_folder_inside_a_checkpoint_directory_is_refused_and_other_folders_are_not(tmp_path, capsys):
    """`--save ck/99` became step 99 of ck, the latest, which --load then failed on. A run whose --log-dir
    sits inside its --save resumes as before, and numbered run folders outside checkpoints stay allowed."""
    from jax3d.checkpoint.read import list_steps

    ck, runs = str(tmp_path / "ck"), tmp_path / "runs"
    one = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--train-iters"]
    assert main([*BASE, *one, "1", "--save", ck, "--log-dir", f"{ck}/logs"]) == 0
    for flag, path in (("--save", f"{ck}/99"), ("--log-dir", f"{ck}/7")):
        assert main([*BASE, *one, "1", flag, path]) == 2
        assert f"error: {flag} {path} would be read as step {path[-2:].strip('/')} of the checkpoint in {ck}" \
            in capsys.readouterr().err
    assert main([*BASE, *one, "2", "--load", ck, "--save", ck, "--log-dir", f"{ck}/logs"]) == 0  # it was refused
    assert main([*BASE, *one, "3", "--load", ck, "--save", ck, "--log-dir", f"{ck}/1/logs"]) == 2
    assert f"error: --log-dir {ck}/1/logs is inside the folder of step 1 of the checkpoint in {ck}" \
        in capsys.readouterr().err
    (runs / "1").mkdir(parents=True)
    assert main([*BASE, *one, "1", "--log-dir", str(runs / "2")]) == 0
    assert main([*BASE, *one, "1", "--log-dir", f"{ck}/99/logs"]) == 2  # a numbered folder on the way there too
    assert f"error: --log-dir {ck}/99/logs needs {ck}/99, which would be read as step 99" in capsys.readouterr().err
    assert list_steps(ck) == [1, 2] and sorted(os.listdir(ck)) == ["1", "2", "logs", "tokenizer"]
