"""Checkpoints: resumed runs equal uninterrupted ones, on the same layout (bit-exact) and on others
(to round-off), across processes; killed saves never count; bad checkpoints fail with one sentence."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.checkpoint.checkpointer import Checkpointer, TrainingInterrupted
from jax3d.checkpoint.read import list_steps, read_meta
from jax3d.train.step import build_steps
from tests.helpers import ROOT, free_port, subprocess_env, tiny_config
from jax3d.parallel.plan import Plan
from tests.helpers import as_plan

GB = 16
WORKER = os.path.join(ROOT, "tests", "checkpoint_worker.py")


def layout(data, stage, model, zero=0, schedule="1f1b", model_kw=None):
    """The tiny test model (4 layers, so 4 stages fit; dropout on, whose masks follow each sample, not the
    layout) on one (data, stage, model) layout; micro-batch 2 of a global batch of 16."""
    return tiny_config(data=data, stage=stage, model=model, zero=zero, micro=2, global_batch=GB,
                       model_kw={"num_layers": 4, "hidden_dropout": 0.1, "attention_dropout": 0.1, **(model_kw or {})},
                       pipeline_schedule=schedule)


def host_batch(cfg, i) -> dict:
    """Global batch number i, a pure function of i (and the model shape): {key: (GB, ...) array}."""
    m = cfg.model
    rs = np.random.RandomState(1000 + i)
    if m.model_type == "gpt":
        return {"text": rs.randint(0, m.vocab_size, (GB, m.seq_length + 1)).astype(np.int32)}
    s = m.seq_length
    pad = (np.arange(s)[None, :] < rs.randint(s // 2, s + 1, (GB, 1))).astype(np.int32)
    return {"text": rs.randint(0, m.vocab_size, (GB, s)).astype(np.int32),
            "types": (np.arange(s)[None, :] >= s // 2).astype(np.int32).repeat(GB, 0),
            "labels": rs.randint(0, m.vocab_size, (GB, s)).astype(np.int32),
            "loss_mask": (rs.rand(GB, s) < 0.3).astype(np.int32) * pad,
            "padding_mask": pad,
            "is_random": rs.randint(0, 2, (GB,)).astype(np.int32)}


def global_batch_array(steps, i) -> dict:
    """Batch i laid out (accum, rows, ...) on the step's batch sharding; works across processes."""
    out = {}
    for k, v in host_batch(steps.cfg, i).items():
        v = v.reshape(steps.accum_steps, -1, *v.shape[1:])
        out[k] = jax.make_array_from_callback(v.shape, steps.batch_sharding(), lambda idx, v=v: v[idx])
    return out


def train(steps, state, start, end, ck=None):
    """Steps start+1 .. end on the test batches; saves through `ck` like the train loop does."""
    losses = []
    for i in range(start, end):
        state, m = steps.train_step(state, global_batch_array(steps, i))
        losses.append(float(m["loss"]))
        if ck is not None:
            ck.maybe_save(i + 1, state, {"consumed_samples": (i + 1) * GB})
    return np.array(losses), state


def uninterrupted(tmp_path_factory, cfg, mesh_cfg, mesh, name):
    """20 steps straight, saving step 10 asynchronously while steps 11-20 run (they donate the state)."""
    d = str(tmp_path_factory.mktemp(name))
    cfg = cfg.replace(train={"save": d, "save_interval": 10})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    ck = Checkpointer(cfg, to_logical=steps.logical_state)
    losses, state = train(steps, steps.init_state(cfg.train.seed), 0, 20, ck)
    ck.wait()
    return {"dir": d, "losses": losses, "params": jax.device_get(state.params), "cfg": cfg}


def resume(ref, cfg, mesh_cfg, mesh, step=10):
    cfg = cfg.replace(train={"load": ref["dir"], "ckpt_step": step})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state, consumed = Checkpointer(cfg).restore(steps)
    assert int(state.step) == step and consumed == step * GB
    assert jax.tree.structure(state) == jax.tree.structure(steps.abstract_state)
    for leaf, sh in zip(jax.tree.leaves(state), jax.tree.leaves(steps.state_shardings)):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    losses, state = train(steps, state, step, 20)
    return losses, jax.device_get(state.params)


# ---- exact resume on the same layout ------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_ref(tmp_path_factory):
    """The reference run: (data, stage, model) = (2, 2, 2), ZeRO-1, 1F1B."""
    return uninterrupted(tmp_path_factory, *layout(2, 2, 2, zero=1, schedule="1f1b"), "gpt_ref")


def test_resume_pipelined_is_bit_exact(gpt_ref):
    assert list_steps(gpt_ref["dir"]) == [10, 20]
    # with its checksums, which the restore verifies
    assert all(os.path.isfile(os.path.join(gpt_ref["dir"], s, "jax3d_crc32.0.json")) for s in ("10", "20"))
    losses, params = resume(gpt_ref, *layout(2, 2, 2, zero=1, schedule="1f1b"))
    np.testing.assert_array_equal(losses, gpt_ref["losses"][10:])
    jax.tree.map(np.testing.assert_array_equal, params, gpt_ref["params"])


def test_resume_bert_is_bit_exact(tmp_path_factory):
    cfg, mesh_cfg, mesh = layout(2, 1, 2, zero=2, model_kw=dict(model_type="bert", num_layers=2))
    ref = uninterrupted(tmp_path_factory, cfg, mesh_cfg, mesh, "bert_ref")
    losses, params = resume(ref, cfg, mesh_cfg, mesh)
    np.testing.assert_array_equal(losses, ref["losses"][10:])
    jax.tree.map(np.testing.assert_array_equal, params, ref["params"])
    meta = read_meta(ref["dir"], 10)
    assert meta["config"]["model"]["model_type"] == "bert" and meta["loader"]["consumed_samples"] == 10 * GB


# ---- restore onto other layouts -----------------------------------------------------------------------

@pytest.mark.parametrize("target", [(8, 1, 1, 0, "1f1b"), (1, 1, 8, 0, "1f1b"), (1, 4, 2, 1, "zb-h1"),
                                    (4, 1, 2, 3, "1f1b")],
                         ids=["dp8-zero0", "tp8", "pp4-tp2-zbh1", "dp4-tp2-zero3"])
def test_reshard_resume(gpt_ref, target):
    data, stage, model, zero, schedule = target
    losses, params = resume(gpt_ref, *layout(data, stage, model, zero=zero, schedule=schedule))
    np.testing.assert_allclose(losses, gpt_ref["losses"][10:], rtol=1e-4, atol=1e-4)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4), params, gpt_ref["params"])


@pytest.mark.slow
def test_two_process_restore_and_save(gpt_ref, tmp_path):
    """2 processes x 4 CPU devices restore step 10 onto (2, 1, 4), train to 20 and save it together."""
    port, save, out = free_port(), str(tmp_path / "mp"), str(tmp_path / "losses.json")
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, WORKER, "multiproc", str(port), str(i), gpt_ref["dir"], save, out],
                              env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    with open(out) as f:
        np.testing.assert_allclose(json.load(f), gpt_ref["losses"][10:], rtol=1e-4, atol=1e-4)
    # What the two processes saved restores on one process, onto the reference layout; each process summed half
    # of the files, and all of them are checked.
    assert list_steps(save) == [20]
    sums = [json.load(open(os.path.join(save, "20", f"jax3d_crc32.{p}.json"))) for p in (0, 1)]
    with open(os.path.join(save, "20", "jax3d_files.json")) as f:
        assert sorted([*sums[0], *sums[1]]) == sorted(json.load(f)) and sums[0] and sums[1]
    cfg, mesh_cfg, mesh = layout(8, 1, 1)
    steps = build_steps(Plan(cfg.replace(train={"load": save}), mesh_cfg), mesh)
    state, consumed = Checkpointer(steps.cfg).restore(steps)
    assert int(state.step) == 20 and consumed == 20 * GB
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
                 jax.device_get(state.params), gpt_ref["params"])


# ---- safety -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint(tmp_path):
    d = str(tmp_path / "ck")
    env = subprocess_env()
    p = subprocess.Popen([sys.executable, WORKER, "crash", d], env=env, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout.readline().strip() == "SAVED 1"
        deadline, partial = time.time() + 120, []
        while time.time() < deadline and not partial:
            partial = [n for n in os.listdir(d) if n.startswith("2.") and "tmp" in n]
            time.sleep(0.002)
        assert partial, f"never saw step 2 being written: {os.listdir(d)}"
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    finally:
        p.kill()
    names = os.listdir(d)
    assert "2" not in names and any(n.startswith("2.") for n in names), names  # killed mid-write
    assert list_steps(d) == [1]
    cfg, mesh_cfg, mesh = tiny_config(model_kw=dict(num_layers=4, hidden_size=512, num_attention_heads=8,
                                                    vocab_size=32768, seq_length=16), micro=1, global_batch=1)
    cfg = cfg.replace(train={"load": d, "save": d, "save_interval": 1})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    ck = Checkpointer(cfg)
    state, consumed = ck.restore(steps)
    assert int(state.step) == 0 and consumed == 1  # step 1's save held the state of step 0
    init = jax.device_get(steps.init_state(0).params)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), init)
    ck.save(2, state, {"consumed_samples": 2}, wait=True)  # a new save in the directory clears the debris
    assert sorted(os.listdir(d)) == ["1", "2"] and list_steps(d) == [1, 2]


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    """A 2-step checkpoint of the tiny GPT at (8, 1, 1); returns its config and Steps."""
    d = str(tmp_path_factory.mktemp("small"))
    cfg, mesh_cfg, mesh = layout(8, 1, 1)
    cfg = cfg.replace(train={"save": d, "save_interval": 1})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    ck = Checkpointer(cfg)
    train(steps, steps.init_state(0), 0, 2, ck)
    ck.wait()
    return cfg, mesh_cfg, mesh, steps


def _restore(cfg, steps, **train_kw):
    return Checkpointer(cfg.replace(train=train_kw)).restore(steps)


def test_model_config_mismatch_names_the_field(small_ckpt):
    cfg, mesh_cfg, mesh, _ = small_ckpt
    d = cfg.train.save
    other = layout(8, 1, 1, model_kw=dict(hidden_size=128))
    steps = build_steps(*as_plan(other))
    with pytest.raises(ConfigError, match="--hidden-size 64 but this run has --hidden-size 128"):
        _restore(other[0], steps, load=d)
    other = layout(8, 1, 1, model_kw=dict(vocab_size=512))
    with pytest.raises(ConfigError, match="--vocab-size 256 .*--vocab-size 512"):
        _restore(other[0], build_steps(*as_plan(other)), load=d)


def test_a_preset_that_differs_from_the_checkpoint_is_named_before_the_layout_check(small_ckpt):
    """--load with --preset gpt-125m: the preset's layer count is what differs (the run blamed the
    checkpoint's --max-position-embeddings, a flag never given, for a layout that could not fit)."""
    from jax3d.cli.train_flags import build_parser, config_from_args
    from jax3d.train.resume import adopt_saved_model

    d = small_ckpt[0].train.save
    argv = ["--load", d, "--preset", "gpt-125m"]
    cfg = config_from_args(build_parser().parse_args(argv))
    with pytest.raises(ConfigError, match=f"checkpoint {d} was saved with --num-layers 4 but this run has --num-layers 12"):
        adopt_saved_model(cfg, d, -1, {"load", "preset"})
    same, _ = adopt_saved_model(config_from_args(build_parser().parse_args(["--load", d, "--seq-length", "16"])), d,
                                -1, {"load", "seq_length"})
    assert same.model.num_layers == 4 and same.model.seq_length == 16  # a free field may differ


def test_free_fields_may_differ(small_ckpt):
    cfg, _, _, _ = small_ckpt
    other = layout(8, 1, 1, model_kw=dict(hidden_dropout=0.0, recompute="full", scan_layers=True))
    state, consumed = _restore(other[0], build_steps(*as_plan(other)), load=cfg.train.save)
    assert int(state.step) == 2 and consumed == 2 * GB


def test_load_errors_are_one_sentence(small_ckpt, tmp_path):
    cfg, _, _, steps = small_ckpt
    d = cfg.train.save
    with pytest.raises(ConfigError, match="--ckpt-step 7 is not a complete checkpoint .* steps \\[1, 2\\]"):
        _restore(cfg, steps, load=d, ckpt_step=7)
    missing = str(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="--ckpt-step -3 is not a step"):
        _restore(cfg, steps, load=d, ckpt_step=-3)
    with pytest.raises(ConfigError, match="--load .* does not exist"):
        _restore(cfg, steps, load=missing)
    assert _restore(cfg, steps, load=missing, save=missing) == (None, 0)  # the restart pattern
    state, _ = _restore(cfg, steps, load=d, ckpt_step=1)
    assert int(state.step) == 1


def test_damaged_checkpoint_is_a_config_error(small_ckpt, tmp_path):
    import shutil
    cfg, _, _, steps = small_ckpt
    d = str(tmp_path / "damaged")
    shutil.copytree(cfg.train.save, d)
    for root, _, files in os.walk(os.path.join(d, "2", "params")):
        for f in files:
            with open(os.path.join(root, f), "wb") as fh:
                fh.write(b"garbage")
    with pytest.raises(ConfigError, match="step 2 is damaged: 2/params/.* holds 7 bytes where"):
        _restore(cfg, steps, load=d)  # the file list kept with the step names the first file
    for record in ("jax3d_files.json", "jax3d_crc32.0.json"):  # as in a checkpoint written before file lists
        os.remove(os.path.join(d, "2", record))
    with pytest.raises(ConfigError, match="step 2 could not be restored") as e:
        _restore(cfg, steps, load=d)
    assert "See full" not in str(e.value) and "bound method" not in str(e.value)
    meta_file = os.path.join(d, "1", "meta", "metadata")
    with open(meta_file) as fh:
        meta = json.load(fh)
    with open(meta_file, "w") as fh:
        json.dump({k: v for k, v in meta.items() if k != "config"}, fh)
    with pytest.raises(ConfigError, match="step 1 has damaged metadata \\(no config.model, config.parallel\\)"):
        _restore(cfg, steps, load=d, ckpt_step=1)
    meta["config"]["model"]["num_layers"] = "two"  # a TypeError in every reader before
    with open(meta_file, "w") as fh:
        json.dump(meta, fh)
    with pytest.raises(ConfigError, match="step 1 has damaged metadata \\(--num-layers 'two' must be a whole number\\)"):
        _restore(cfg, steps, load=d, ckpt_step=1)
    with open(meta_file, "w") as fh:
        fh.write("{not json")
    with pytest.raises(ConfigError, match="step 1 is unreadable"):
        _restore(cfg, steps, load=d, ckpt_step=1)


def _flip_a_bit(path: str, at: int = -1) -> None:
    with open(path, "r+b") as f:
        f.seek(at % os.path.getsize(path))
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))


def test_a_flipped_bit_is_named_by_its_checksum_and_an_old_checkpoint_still_restores(small_ckpt, tmp_path):
    """A file of the same size with one bit flipped restored and trained at NaN before checksums were kept."""
    import shutil
    from jax3d.checkpoint.read import check_files
    cfg, _, _, steps = small_ckpt
    d = str(tmp_path / "flipped")
    shutil.copytree(cfg.train.save, d)
    root = os.path.join(d, "2")
    with open(os.path.join(root, "jax3d_crc32.0.json")) as f:
        sums = json.load(f)
    with open(os.path.join(root, "jax3d_files.json")) as f:
        assert sorted(sums) == sorted(json.load(f))  # every file the size list holds has its checksum
    # the largest file of the parameters: their array data
    data = max((r for r in sums if r.startswith("params/")), key=lambda r: os.path.getsize(os.path.join(root, r)))
    _flip_a_bit(os.path.join(root, data), at=os.path.getsize(os.path.join(root, data)) // 2)
    want = f"step 2 is damaged: 2/{data} does not hold the bytes that were saved \\(CRC32 "
    with pytest.raises(ConfigError, match=want):
        check_files(d, 2)
    with pytest.raises(ConfigError, match=want):
        _restore(cfg, steps, load=d)
    ck = Checkpointer(cfg.replace(train={"load": d, "save": ""}))
    with pytest.raises(ConfigError, match=want):
        ck.step_to_restore()  # what the loop asks before it compiles
    # A step saved before checksums were kept restores as it did (this one, undamaged).
    os.remove(os.path.join(d, "1", "jax3d_crc32.0.json"))
    check_files(d, 1)
    state, _ = _restore(cfg, steps, load=d, ckpt_step=1)
    assert int(state.step) == 1


def test_a_flipped_bit_is_refused_by_load_with_one_sentence(small_ckpt, tmp_path, capsys):
    import shutil
    from jax3d.cli.train import main
    cfg = small_ckpt[0]
    d = str(tmp_path / "flipped")
    shutil.copytree(cfg.train.save, d)
    meta = os.path.join(d, "2", "meta", "metadata")
    with open(meta) as f:
        text = f.read()
    with open(meta, "w") as f:  # "2" -> "3" is one bit (0x32 -> 0x33): the same size, still JSON
        f.write(text.replace('"step": 2', '"step": 3', 1))
    assert main(["--load", d, "--train-iters", "4", "--log-dir", str(tmp_path / "log"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert re.fullmatch(f"error: checkpoint {re.escape(d)} step 2 is damaged: 2/meta/metadata does not hold the bytes "
                        "that were saved \\(CRC32 [0-9a-f]{8}, saved as [0-9a-f]{8}\\); copy the checkpoint again, or "
                        "pass another --ckpt-step or --load", err.strip()), err


def test_keep_checkpoints_and_load_without_save(small_ckpt, tmp_path):
    _, _, _, steps = small_ckpt
    d = str(tmp_path / "keep")
    cfg = steps.cfg.replace(train={"save": d, "save_interval": 1, "keep_checkpoints": 2})
    ck = Checkpointer(cfg)
    train(steps, steps.init_state(0), 0, 4, ck)
    ck.wait()
    assert list_steps(d) == [3, 4]
    ro = Checkpointer(steps.cfg.replace(train={"load": d, "save": ""}))
    state, _ = ro.restore(steps)
    assert ro.maybe_save(5, state, {"consumed_samples": 5 * GB}, force=True) is False
    assert list_steps(d) == [3, 4]


def test_sigterm_saves_then_stops(small_ckpt, tmp_path):
    _, _, _, steps = small_ckpt
    d = str(tmp_path / "sig")
    ck = Checkpointer(steps.cfg.replace(train={"save": d, "save_interval": 100}))
    ck.install_signal_handlers()
    try:
        state = steps.init_state(0)
        assert ck.maybe_save(1, state, {"consumed_samples": GB}) is False
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(TrainingInterrupted) as e:
            ck.maybe_save(2, state, {"consumed_samples": 2 * GB})
        assert e.value.exit_code == 143 and e.value.saved and e.value.step == 2
        assert list_steps(d) == [2]  # written synchronously before the exception
    finally:
        ck.uninstall_signal_handlers()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_padding_rule_is_free_but_the_padded_vocabulary_is_not():
    """--make-vocab-size-divisible-by only matters through the vocab_size it pads to, which the
    checkpoint's shapes hold: another rule giving the same size restores, another size is refused."""
    import dataclasses

    from jax3d.checkpoint.checkpointer import check_model_compatible
    from tests.helpers import tiny_model

    saved = dataclasses.asdict(tiny_model(vocab_size=512, make_vocab_size_divisible_by=128))
    check_model_compatible(saved, tiny_model(vocab_size=512, make_vocab_size_divisible_by=64), "ckpt")
    with pytest.raises(ConfigError, match="vocab-size 512"):
        check_model_compatible(saved, tiny_model(vocab_size=576, make_vocab_size_divisible_by=64), "ckpt")


def test_finished_run_stops_before_compiling(small_ckpt, monkeypatch, capsys):
    """Resuming a run whose checkpoint is at --train-iters compiles nothing (it would take minutes at scale)."""
    from jax3d.train import loop

    cfg, mesh_cfg, mesh, _ = small_ckpt
    monkeypatch.setattr(loop, "build_steps", lambda *a: pytest.fail("a finished run built its step"))
    done = cfg.replace(train={"load": cfg.train.save, "train_iters": 2})
    assert loop.train(Plan(done, mesh_cfg), mesh, None, checkpointer=Checkpointer(done)) == {}
    assert "nothing to do: the checkpoint is already at step 2 of 2" in capsys.readouterr().err


def test_fresh_run_refuses_a_save_dir_with_checkpoints(small_ckpt, monkeypatch):
    """A run that does not load its --save directory would replace the checkpoints there: it is refused
    before anything is built, and the directory keeps its steps."""
    from jax3d.train import loop

    cfg, mesh_cfg, mesh, _ = small_ckpt
    d = cfg.train.save
    monkeypatch.setattr(loop, "build_steps", lambda *a: pytest.fail("a refused run built its step"))
    for other in (cfg.replace(train={"load": ""}), cfg.replace(train={"load": str(d) + "-elsewhere"})):
        with pytest.raises(ConfigError, match=f"--save {d} already holds checkpoints .* pass --load {d}"):
            loop.train(Plan(other, mesh_cfg), mesh, None, checkpointer=Checkpointer(other))
    assert list_steps(d) == [1, 2]
    Checkpointer(cfg.replace(train={"load": d})).check_save_dir()  # continuing the run is fine


def test_rollback_drops_the_abandoned_steps_at_its_first_save(small_ckpt, tmp_path):
    """Resumed from step 1 of a directory holding 1 and 2, the run's first save (at 3) removes step 2 too:
    it belongs to the abandoned run, and --ckpt-step 2 must not later resume it."""
    import shutil

    cfg, _, _, steps = small_ckpt
    d = str(tmp_path / "roll")
    shutil.copytree(cfg.train.save, d)
    ck = Checkpointer(cfg.replace(train={"load": d, "save": d, "ckpt_step": 1, "save_interval": 100}))
    state, _ = ck.restore(steps, ck.step_to_restore())
    ck.save(3, state, {"consumed_samples": 3 * GB}, wait=True)
    assert list_steps(d) == [1, 3]


def test_resumed_run_keeps_the_steps_it_saves(small_ckpt, tmp_path):
    """Continued in its own directory from its latest step, a run keeps every step it writes (it deleted
    each earlier one at its next save), and --keep-checkpoints counts them with the loaded run's."""
    import shutil

    cfg, _, _, steps = small_ckpt
    for keep, want in ((0, [1, 2, 3, 4, 5]), (2, [4, 5])):
        d = str(tmp_path / f"keep{keep}")
        shutil.copytree(cfg.train.save, d)
        ck = Checkpointer(cfg.replace(train={"load": d, "save": d, "save_interval": 1, "keep_checkpoints": keep}))
        state, _ = ck.restore(steps, ck.step_to_restore())
        train(steps, state, 2, 5, ck)
        ck.close()
        assert list_steps(d) == want


async def _read_array_index_and_device_put():  # named as orbax's (module level: the same qualified name)
    pass


def test_a_failed_restore_leaves_no_echoes_and_a_good_one_leaves_no_filters(capsys):
    """TensorStore reads still running when a restore fails report a closed event loop (an unraisable
    exception) or an unretrieved task error, once orbax has given up: tracebacks around the one error line.
    After a failure those two are dropped and any other unraisable exception still reaches the hook that
    was there; after a success the hooks are as they were."""
    import gc
    import logging
    import warnings

    from jax3d.checkpoint.read import _quiet_after_failed_read

    class Raises:
        def __init__(self, e):
            self.e = e

        def __del__(self):
            raise self.e

    seen = []
    hook, asyncio_log, warning_filters = sys.unraisablehook, logging.getLogger("asyncio"), warnings.filters[:]
    log_filters = asyncio_log.filters[:]  # a restore that failed earlier in this process leaves its own
    sys.unraisablehook = lambda u: seen.append(str(u.exc_value))
    try:
        with _quiet_after_failed_read():
            pass
        assert asyncio_log.filters == log_filters
        with pytest.raises(ValueError):
            with _quiet_after_failed_read():
                raise ValueError("a read failed")
        Raises(RuntimeError("Event loop is closed"))
        gc.collect()
        closed = RuntimeError("Event loop is closed")
        asyncio_log.error("_GatheringFuture exception was never retrieved", exc_info=(RuntimeError, closed, None))
        read_error = ValueError('OUT_OF_RANGE: Error reading "blocks.mlp.down_kernel/0.3.0" in OCDBT database')
        asyncio_log.error("Future exception was never retrieved", exc_info=(ValueError, read_error, None))

        _read_array_index_and_device_put()  # orbax's read, never started, collected unawaited
        gc.collect()
        assert seen == [] and capsys.readouterr().err == ""
        # what is not orbax's still shows: the process may go on (a notebook) after the failed restore
        Raises(RuntimeError("something else"))
        Raises(ValueError("INTERNAL: a bug of the caller's"))
        gc.collect()
        assert seen == ["something else", "INTERNAL: a bug of the caller's"]

        async def mine():
            pass
        with pytest.warns(RuntimeWarning, match="coroutine 'test_a_failed.*mine' was never awaited"):
            mine()
            gc.collect()
    finally:
        sys.unraisablehook = hook
        warnings.filters[:] = warning_filters
        asyncio_log.filters[:] = log_filters


def test_a_step_folder_given_as_load_names_the_flags_to_pass(small_ckpt):
    """`--load ck/2` said only that it held no complete checkpoint."""
    from jax3d.checkpoint.read import saved_step_meta

    cfg, _, _, steps = small_ckpt
    step_dir = os.path.join(cfg.train.save, "2")
    want = f"--load {step_dir} is step 2 of the checkpoint in {os.path.abspath(cfg.train.save)}; pass --load"
    with pytest.raises(ConfigError, match=want):
        saved_step_meta(step_dir)
    with pytest.raises(ConfigError, match=want):
        Checkpointer(steps.cfg.replace(train={"load": step_dir, "save": ""})).restore(steps)


def test_the_fields_load_adopts_are_those_no_given_flag_sets():
    """What errors then blame on the checkpoint, also where its value equals the flag's default (a layout
    error named --num-layers 2, the default, as if the user had typed it)."""
    from jax3d.train.resume import adopted_fields

    everything = adopted_fields({"load"})
    assert {"num_layers", "hidden_size", "vocab_size", "activation"} <= everything
    assert "hidden_dropout" not in everything  # free to change in a fine-tune
    assert everything - adopted_fields({"load", "num_layers"}) == {"num_layers"}
    assert {"num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"}.isdisjoint(
        adopted_fields({"load", "preset"}))
