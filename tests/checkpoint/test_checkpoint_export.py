"""Export: the single-device tree written from a sharded checkpoint equals the restored parameters."""
import json
import os
import stat
import subprocess
import sys

import jax
import numpy as np
import pytest

from jax3d.config import ConfigError
from jax3d.checkpoint.export import export, read_safetensors
from jax3d.checkpoint.checkpointer import Checkpointer
from jax3d.train.step import build_steps
from tests.helpers import ROOT, subprocess_env, tiny_config
from jax3d.parallel.plan import Plan


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory):
    """One step of the tiny BERT saved from (data, stage, model) = (2, 1, 4), ZeRO-3 (every leaf sharded)."""
    d = str(tmp_path_factory.mktemp("exp"))
    cfg, mesh_cfg, mesh = tiny_config(data=2, model=4, zero=3, micro=2, global_batch=4,
                                      model_kw=dict(model_type="bert"))
    cfg = cfg.replace(train={"save": d})
    steps = build_steps(Plan(cfg, mesh_cfg), mesh)
    state = steps.init_state(3)
    ck = Checkpointer(cfg)
    ck.save(5, state, {"consumed_samples": 20}, wait=True)
    return d, cfg, jax.device_get(state.params)


def _assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.parametrize("split", [False, True], ids=["stacked", "per-layer"])
def test_safetensors_export_equals_checkpoint(sharded_ckpt, tmp_path, split):
    d, cfg, params = sharded_ckpt
    out = str(tmp_path / "model.safetensors")
    summary = export(d, out, split_layers=split)
    assert summary["step"] == 5 and summary["parameters"] == sum(a.size for a in jax.tree.leaves(params))
    from safetensors.numpy import load_file
    names = load_file(out).keys()
    if split:
        assert "blocks.1.attn.qkv_kernel" in names and "blocks.attn.qkv_kernel" not in names
    else:
        assert "blocks.attn.qkv_kernel" in names and "head.mlm_norm.scale" in names
    tree, meta = read_safetensors(out)
    _assert_tree_equal(tree, params)
    assert meta["model"] == json.loads(json.dumps(cfg.to_dict()["model"]))
    assert meta["layers_stacked"] is (not split) and meta["step"] == 5


def test_safetensors_export_has_a_plain_writes_mode(sharded_ckpt, tmp_path):
    """The export is readable by others like a file written with open() beside it (it was 0600 before)."""
    d, _, _ = sharded_ckpt
    old = os.umask(0o022)
    try:
        export(d, str(tmp_path / "model.safetensors"))
        (tmp_path / "plain.txt").write_text("reference")
    finally:
        os.umask(old)
    mode = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert mode["model.safetensors"] == mode["plain.txt"] == 0o644, {k: oct(v) for k, v in mode.items()}


def test_orbax_export_is_refused_inside_the_checkpoint_directory(sharded_ckpt, tmp_path):
    """`--output CK/99` would be read as step 99 of CK, and --load would then fail on it: refused, the
    directory keeps the steps it had and still restores. A folder there not named by a number, or a
    safetensors file, is harmless and allowed; anything inside a step's folder is refused."""
    import shutil

    from jax3d.checkpoint.export import load_params
    from jax3d.checkpoint.read import list_steps
    d, _, params = sharded_ckpt
    steps = list_steps(d)
    before = sorted(os.listdir(os.path.join(d, str(steps[-1]))))
    with pytest.raises(ConfigError, match=f"--output .*99 would be read as step 99 of the checkpoint in {d}"):
        export(d, os.path.join(d, "99"), fmt="orbax")
    export(d, os.path.join(d, "final"), fmt="orbax")
    export(d, os.path.join(d, "model.safetensors"))
    assert list_steps(d) == steps
    # Inside a step's folder, a later save with --keep-checkpoints would delete the export with the step.
    step_dir = os.path.join(d, str(steps[-1]))
    for out, fmt in ((os.path.join(step_dir, "model.safetensors"), "safetensors"),
                     (os.path.join(step_dir, "hf", "orbax"), "orbax")):
        with pytest.raises(ConfigError, match=f"--output .* is inside the folder of step {steps[-1]} of the "
                                              f"checkpoint in {d}, .*; put it outside {step_dir}$"):
            export(d, out, fmt=fmt)
    link = str(tmp_path / "step-link")  # a link to the step's folder is that folder
    os.symlink(step_dir, link)
    with pytest.raises(ConfigError, match=f"is inside the folder of step {steps[-1]} of the checkpoint in {d}"):
        export(d, os.path.join(link, "model.safetensors"))
    assert sorted(os.listdir(step_dir)) == before
    shutil.rmtree(os.path.join(d, "final"))
    os.remove(os.path.join(d, "model.safetensors"))
    _assert_tree_equal(load_params(d)[0], params)


def test_orbax_export_and_cli(sharded_ckpt, tmp_path):
    import orbax.checkpoint as ocp
    d, cfg, params = sharded_ckpt
    out = str(tmp_path / "orbax_out")
    env = subprocess_env()  # the exporter needs one device
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "export.py"), "--load", d, "--output", out,
                        "--format", "orbax"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1])["format"] == "orbax"
    with ocp.StandardCheckpointer() as ck:
        tree = ck.restore(os.path.join(out, "params"))
    _assert_tree_equal(jax.device_get(tree), params)
    with open(os.path.join(out, "jax3d.json")) as f:
        assert json.load(f)["model"]["model_type"] == "bert"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "export.py"), "--load", str(tmp_path / "no"),
                        "--output", str(tmp_path / "x.safetensors")], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --load") and "Traceback" not in r.stderr


def test_export_errors(sharded_ckpt, tmp_path):
    d, _, _ = sharded_ckpt
    with pytest.raises(ConfigError, match="--ckpt-step 9 is not a complete checkpoint"):
        export(d, str(tmp_path / "a.safetensors"), step=9)
    with pytest.raises(ConfigError, match="--format npz is not supported"):
        export(d, str(tmp_path / "a.npz"), fmt="npz")
    (tmp_path / "dir").mkdir()
    (tmp_path / "taken.safetensors").write_bytes(b"someone's file")
    for fmt, taken in (("safetensors", "taken.safetensors"), ("safetensors", "dir"), ("orbax", "taken.safetensors")):
        with pytest.raises(ConfigError, match=f"--output .*{taken} already exists; pass a new path"):
            export(d, str(tmp_path / taken), fmt=fmt)
    with pytest.raises(ConfigError, match="taken.safetensors/a.safetensors: its folder is a file"):
        export(d, str(tmp_path / "taken.safetensors" / "a.safetensors"))
    assert (tmp_path / "taken.safetensors").read_bytes() == b"someone's file"
    with pytest.raises(ConfigError, match="--split-layers is for safetensors"):
        export(d, str(tmp_path / "o"), fmt="orbax", split_layers=True)
    with pytest.raises(ConfigError, match="--output is empty"):
        export(d, "")
    with pytest.raises(ConfigError, match="/sys/jax3d-out/a.safetensors: its folder cannot be written"):
        export(d, "/sys/jax3d-out/a.safetensors")
