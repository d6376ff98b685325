"""Steps skipped for non-finite gradients: told on the console as the loop learns of them, and a run whose last
N steps were all skipped stops (exit 3) with its good checkpoints kept; fp16's loss scale keeps room to come down."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax3d.checkpoint.read import check_files, list_steps
from jax3d.cli.train import main
from jax3d.config import PrecisionConfig
from jax3d.parallel.precision import LossScaling
from jax3d.train.skipped import SkippedStepsStop, SkipWatch, overflows_to_floor
from jax3d.train.state import initial_loss_scale, update_loss_scale

BASE = ["--preset", "gpt-tiny", "--seed", "1", "--seq-length", "32", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1"]


@pytest.mark.parametrize("kw", [{}, {"hysteresis": 1}, {"hysteresis": 3, "min_loss_scale": 4.0},
                                {"initial_loss_scale": 2.0**16}])
def test_overflows_to_floor_follow_the_loss_scale_rule(kw):
    """Counted against the step's own rule (update_loss_scale): overflows in a row until the scale is at its floor."""
    p = PrecisionConfig(dtype="float16", **kw)
    scaling = LossScaling.of(p)
    ls, n = initial_loss_scale(scaling), 0
    while float(ls.scale) > p.min_loss_scale:
        ls, n = update_loss_scale(ls, jnp.bool_(False), scaling), n + 1
    assert overflows_to_floor(scaling) == n
    if not kw:  # Megatron's defaults: 2^32 and hysteresis 2 take 17 to reach 2^16 and 33 to reach 1
        assert n == 33
    assert overflows_to_floor(LossScaling.of(PrecisionConfig(dtype="bfloat16"))) == 0


def _metrics(total, scale=1.0):
    return {"skipped": np.int32(total), "grad_norm": np.float32(np.inf if total else 1.0), "loss_scale": np.float32(scale)}


def test_the_watch_tells_each_run_of_skipped_steps_once_read_and_stops_at_the_limit():
    lines = []
    watch = SkipWatch(LossScaling.of(PrecisionConfig()), 4, skipped_before=5, say=lines.append)
    totals = {1: 5, 2: 6, 3: 7, 4: 8, 5: 8, 6: 9, 7: 9, 8: 10, 9: 11, 10: 12, 11: 13}  # running totals
    for step in range(1, 12):
        watch.add(step, _metrics(totals[step]))
    watch.read_through(1)
    assert lines == [] and watch.streak == 0
    watch.read_through(2)  # told as soon as the step is read
    assert lines == ["jax3d: step 2: gradients are not finite (grad norm inf), so its update was skipped, as every "
                     "step's is until they are (the run stops after 4 in a row, --exit-after-skipped-iters)"]
    watch.read_through(7)
    assert lines[1:] == ["jax3d: steps 2-4 were skipped (3 in a row); step 5 applied its update",
                         lines[0].replace("step 2:", "step 6:")]  # a run of one ends without a line of its own
    with pytest.raises(SkippedStepsStop, match="steps 8-11 were all skipped for non-finite gradients \\(4 in a row, "
                                               "--exit-after-skipped-iters 4\\)") as e:
        watch.read_through(11)
    assert e.value.exit_code == 3


def test_a_diverged_run_says_so_and_stops_before_it_rotates_good_checkpoints_away(tmp_path, capsys):
    """--lr 1e4 without clipping: the first steps apply, then every step overflows. It trained on to exit 0 in
    silence before, and --keep-checkpoints 2 kept only steps the run had skipped to."""
    ck = str(tmp_path / "ck")
    argv = [*BASE, "--lr", "1e4", "--clip-grad", "0", "--train-iters", "10", "--save", ck, "--save-interval", "1",
            "--keep-checkpoints", "2", "--exit-after-skipped-iters", "3", "--log-dir", str(tmp_path / "log")]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err
    told = [line for line in err.splitlines() if "skipped" in line]
    first = int(told[0].split(":")[1].split()[1])  # where the blown-up weights first overflow (step 4 here)
    assert 1 < first < 8, err
    assert told == [
        f"jax3d: step {first}: gradients are not finite (grad norm nan), so its update was skipped, as every step's "
        "is until they are (the run stops after 3 in a row, --exit-after-skipped-iters)",
        f"jax3d: not saving step {first} yet: step {first} was skipped, so the save waits for a step that applies its "
        "update",
        f"jax3d: steps {first}-{first + 2} were all skipped for non-finite gradients (3 in a row, "
        f"--exit-after-skipped-iters 3), so the run stops, keeping the checkpoints in {ck} (the newest is step "
        f"{first - 1}); lower --lr, or set --clip-grad, and resume from a checkpoint of before the trouble"]
    # the last step that applied its update and the one before it, nothing saved after them
    assert list_steps(ck) == [first - 2, first - 1]
    check_files(ck, first - 1)


def test_an_fp16_run_skips_its_first_steps_while_the_loss_scale_comes_down_and_goes_on(tmp_path, capsys):
    assert main([*BASE, "--fp16", "--lr", "1e-3", "--train-iters", "30", "--log-dir", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    told = [line for line in err.splitlines() if "skipped" in line]
    assert len(told) == 2, err
    assert told[0].startswith("jax3d: step 1: gradients overflowed (grad norm ") and told[0].endswith(
        "at loss scale 2^32, so its update was skipped and the scale comes down; in fp16 a few such steps at the start "
        "of a run, and one now and then after the scale has grown, are normal (the run stops after 50 in a row, "
        "--exit-after-skipped-iters)")
    assert told[1].startswith("jax3d: steps 1-") and "applied its update at loss scale 2^" in told[1]


def test_a_limit_that_leaves_fp16_no_room_is_refused(capsys):
    assert main([*BASE, "--fp16", "--exit-after-skipped-iters", "20", "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --exit-after-skipped-iters 20 would stop an --fp16 run before its loss scale can come down: from 2^32 "
        "to --min-loss-scale 1 takes 33 overflows in a row with --hysteresis 2; pass more than 33, or 0 to never stop")
