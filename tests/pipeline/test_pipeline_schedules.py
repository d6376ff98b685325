"""Schedule tables against the rules they must obey and the published bubble figures."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jax3d.pipeline import schedules as S
from jax3d.pipeline.program import lower


def _grid():
    for p in range(1, 7):
        for m in sorted({p, p + 1, 2 * p, 3 * p + 1}):
            for name in S.SCHEDULES:
                if name == "interleaved":
                    if m % p == 0:
                        for v in (2, 3):
                            yield name, p, m, v
                else:
                    yield name, p, m, 1


@pytest.mark.parametrize("name,p,m,v", list(_grid()))
def test_every_schedule_validates(name, p, m, v):
    sched = S.make_schedule(name, p, m, v)
    S.validate(sched)
    live = S.live_activations(sched).max()
    if name == "gpipe":
        assert live == m
    elif name in ("1f1b", "zb-h1"):
        assert live <= p  # grows with p, not m
    else:  # chunk activations, each 1/v of a stage's: Megatron's warm-up bound
        assert live <= (p - 1) * 2 + (v - 1) * p + 1


def test_bubble_figures_p4_m8():
    f1 = S.bubble_fraction(S.make_schedule("1f1b", 4, 8))
    assert abs(f1 - 3 / 11) < 1e-6
    assert abs(S.bubble_fraction(S.make_schedule("gpipe", 4, 8)) - 3 / 11) < 1e-6
    zb = S.make_schedule("zb-h1", 4, 8)
    fz = S.bubble_fraction(zb)
    assert fz <= 0.12 and abs(fz - 3 / 27) < 1e-6
    assert S.bubble_fraction(S.make_schedule("interleaved", 4, 8, 2)) < f1
    assert S.live_activations(zb).max() == S.live_activations(S.make_schedule("1f1b", 4, 8)).max()


@pytest.mark.parametrize("p,m", [(2, 2), (3, 7), (4, 4), (4, 16), (6, 9), (8, 8)])
def test_zb_h1_idle_time_is_a_third_of_1f1b(p, m):
    def idle(name):
        makespan, busy = S.simulate(S.make_schedule(name, p, m))
        return p * makespan - busy.sum()
    assert abs(idle("zb-h1") - idle("1f1b") / 3) < 1e-9


def test_1f1b_bubble_formula_and_peak_independent_of_m():
    for p in (2, 3, 5):
        for m in (p, 2 * p, 5 * p):
            sched = S.make_schedule("1f1b", p, m)
            assert abs(S.bubble_fraction(sched) - (p - 1) / (m + p - 1)) < 1e-9
            assert list(S.live_activations(sched)) == [p - s for s in range(p)]


def _broken(sched, edit):
    kind, mb, ch = sched.kind.copy(), sched.microbatch.copy(), sched.chunk.copy()
    edit(kind, mb, ch)
    return S.Schedule(sched.name, sched.stages, sched.microbatches, sched.virtual_stages,
                      sched.split_backward, kind, mb, ch)


def test_broken_tables_fail_validation():
    good = S.make_schedule("1f1b", 4, 8)
    # stage 1 runs F0 in the same tick as stage 0: its input is not there yet
    def same_tick(kind, mb, ch):
        kind[0, 1], mb[0, 1], ch[0, 1] = S.F, 0, 0
        kind[1, 1], mb[1, 1], ch[1, 1] = S.IDLE, -1, -1
    with pytest.raises(S.ScheduleError, match="does not come after"):
        S.validate(_broken(good, same_tick))
    # drop a backward
    t = int(np.nonzero(good.kind[:, 0] == S.B)[0][-1])
    def drop(kind, mb, ch):
        kind[t, 0], mb[t, 0], ch[t, 0] = S.IDLE, -1, -1
    with pytest.raises(S.ScheduleError, match="never runs"):
        S.validate(_broken(good, drop))
    # W in a fused schedule
    def add_w(kind, mb, ch):
        kind[0, 3], mb[0, 3], ch[0, 3] = S.W, 0, 0
    with pytest.raises(S.ScheduleError, match="not allowed"):
        S.validate(_broken(good, add_w))
    # ZB-H1 with W before its B
    zb = S.make_schedule("zb-h1", 2, 2)
    tb = int(np.nonzero((zb.kind[:, 1] == S.B) & (zb.microbatch[:, 1] == 0))[0][0])
    tw = int(np.nonzero((zb.kind[:, 1] == S.W) & (zb.microbatch[:, 1] == 0))[0][0])
    def swap(kind, mb, ch):
        kind[[tb, tw], 1] = kind[[tw, tb], 1]
    with pytest.raises(S.ScheduleError):
        S.validate(_broken(zb, swap))
    # memory bound
    with pytest.raises(S.ScheduleError, match="live activations"):
        S.validate(S.make_schedule("gpipe", 4, 8), max_live=4)


def test_bad_arguments_refused():
    with pytest.raises(S.ScheduleError, match="divisible"):
        S.make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(S.ScheduleError, match="at least --stages"):
        S.make_schedule("1f1b", 4, 3)
    with pytest.raises(S.ScheduleError, match="only supported"):
        S.make_schedule("zb-h1", 4, 8, 2)


def test_buffer_slots_do_not_grow_with_m():
    for name in ("1f1b", "zb-h1"):
        a, b = lower(S.make_schedule(name, 4, 8)), lower(S.make_schedule(name, 4, 64))
        slots = lambda x: (x.act_slots, x.grad_slots, x.res_slots, x.cut_slots)  # noqa: E731
        assert slots(a) == slots(b)
        assert a.res_slots <= 4 and a.act_slots <= 2  # an input turns into residuals at its F
    assert lower(S.make_schedule("gpipe", 4, 16)).res_slots == 16


def test_cli_prints_timeline_and_json():
    out = subprocess.run([sys.executable, "-m", "jax3d.cli.schedules", "--stages", "4",
                          "--microbatches", "8", "--schedule", "zb-h1"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 5 and out[0].startswith("stage 0: F0 F1")
    fig = json.loads(out[-1])
    assert fig["ticks"] == 27 and fig["peak_live_activations"] == 4
    assert abs(fig["bubble_fraction"] - 3 / 27) < 1e-6


def test_cli_bad_args_exit_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "jax3d.cli.schedules", "--stages", "4",
                        "--microbatches", "6", "--schedule", "interleaved", "--virtual-stages", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "divisible" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
