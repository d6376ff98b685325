"""Every preset builds and dry-runs, and the parameter count the run header prints is the real tree's."""
import json
import re

import pytest

from jax3d.models.presets import preset_names
from jax3d.run import main


@pytest.mark.parametrize("name", preset_names())
def test_preset_dry_runs_and_header_counts_the_real_tree(name, capsys):
    # Two layers and short sequences keep the compile quick; every other shape is the preset's own.
    argv = ["--preset", name, "--dry-run", "--num-layers", "2", "--seq-length", "64", "--micro-batch-size", "1",
            "--global-batch-size", "8", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--zero-stage", "0", "--vocab-size", "30720"]
    assert main(argv) == 0
    out = capsys.readouterr()
    report = json.loads(out.out.strip().splitlines()[-1])
    printed = float(re.search(r"\(([\d.]+)M params\)", out.err).group(1))
    # ZeRO-0 on (8, 1, 1): every device holds the whole fp32 parameter tree the step really compiled.
    assert report["params"] == 4 * report["num_params"]
    assert abs(printed - report["num_params"] / 1e6) < 0.05
    assert report["mesh"] == {"data": 8, "stage": 1, "model": 1} and report["peak"] > report["params"]
