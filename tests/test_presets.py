"""Every preset resolves and traces its train step, and the parameter count the run header prints is the real
tree's; a GPT and a BERT preset go the whole way through `--dry-run`.

Tracing (`lower`) checks every shape of the step; compiling adds only XLA's time, the same for each preset,
so two presets pay it.
"""
import json
import math

import jax
import pytest

from jax3d.cli.train_flags import build_parser, config_from_args
from jax3d.models.presets import PRESETS, preset_names
from jax3d.parallel.plan import resolve
from jax3d.cli.train import header, main
from jax3d.train.dry_run import per_device_bytes
from jax3d.train.step import abstract_batch, abstract_state, build_steps

# (8, 1, 1) with ZeRO-0: every device holds the whole fp32 parameter tree.
LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--zero-stage", "0"]




@pytest.mark.parametrize("name", preset_names())
def test_preset_traces_and_header_counts_the_real_tree(name):
    """At the preset's own shape and vocabulary; one sample a step keeps the trace small."""
    argv = ["--preset", name, "--vocab-size", str(PRESETS[name][4]), "--micro-batch-size", "1",
            "--global-batch-size", "8", *LAYOUT]
    plan = resolve(config_from_args(build_parser().parse_args(argv)), 8)
    steps = build_steps(plan.cfg, plan.mesh, plan.mesh.build())
    state = abstract_state(steps)
    count = sum(math.prod(a.shape) for a in jax.tree.leaves(state.params))
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"  # the real tree's count, rounded
    assert f"({size} params)" in header(plan, steps.model.num_params())
    assert per_device_bytes(state.params, steps.state_shardings.params) == 4 * count
    steps.train_step.lower(state, abstract_batch(steps, steps.model.sample_shapes()))


@pytest.mark.parametrize("name", ["gpt-125m", "bert-base"])
def test_preset_dry_runs_through_the_command_line(name, capsys):
    # Two layers and short sequences keep the compile quick; every other shape is the preset's own.
    argv = ["--preset", name, "--dry-run", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--vocab-size", "30720", *LAYOUT]
    assert main(argv) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    assert report["params"] == 4 * report["num_params"]
    assert f"({report['num_params'] / 1e6:.1f}M params)" in out.err
    assert report["mesh"] == {"data": 8, "stage": 1, "model": 1} and report["peak"] > report["params"]
