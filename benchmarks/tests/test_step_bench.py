"""The benchmarks' harness: `throughput.py --tune` settings parsed from "FIELD=V,..." equal the Tuning
built directly, bad settings are refused with one sentence, a run reaches its child process intact and
its settings and left-out kernels the step it traces, a BERT shape gets a batch in Megatron's layout, and
the GPU clock log reads `nvidia-smi` over a run's timed steps."""
import os

import pytest

from benchmarks import harness, profile_step
from jax3d.kernels import KERNELS, fused_gelu, fused_norm, fused_qkv, fused_xent


def test_parsed_settings_equal_the_tuning_built_directly():
    assert harness.kernel_tuning("fused_xent", "block=2048,warps=4") == fused_xent.Tuning(block=2048, warps=4)
    run = harness.Run("125m-b32", tunings=(("fused_xent", "block=2048"),))
    assert run.label() == "125m-b32 fused_xent[block=2048]"
    assert harness.Run("tiny", ablate=KERNELS).label() == "tiny -every kernel"
    assert set(harness.KERNEL_CALLS) == set(KERNELS)


def test_a_runs_settings_reach_the_kernels_it_traces():
    """A run's kernel policy on one GPU runs the kernels it names with its Tuning, those it leaves out not at all,
    and the rest at their defaults; elsewhere, none. The model's config carries none of it."""
    run = harness.Run("tiny", ablate=("fused_qkv",), tunings=(("fused_xent", "block=2048"),))
    assert harness.config_for(run) == harness.config_for(harness.Run("tiny"))
    policy = harness.kernel_policy(run, "gpu", 1)
    assert policy.tuning("fused_xent") == fused_xent.Tuning(block=2048)
    assert policy.tuning("fused_qkv") is None and not policy.takes("fused_qkv", None)
    assert policy.tuning("fused_gelu") is fused_gelu.DEFAULT and policy.tuning("fused_norm") is fused_norm.DEFAULT
    default = harness.kernel_policy(harness.Run("tiny"), "gpu", 1)
    assert all(default.tuning(k.__name__.rsplit(".", 1)[-1]) is k.DEFAULT
               for k in (fused_gelu, fused_norm, fused_qkv, fused_xent))
    assert harness.kernel_policy(run, "cpu", 1).tunings == ()
    with pytest.raises(ValueError, match="no kernel fused_nope"):
        harness.kernel_policy(harness.Run("tiny", ablate=("fused_nope",)), "gpu", 1)


def test_a_run_survives_the_trip_to_its_process():
    """run_isolated hands the child process the run as JSON: the same run comes back, tuples and all."""
    run = harness.Run("125m-b32", ablate=("fused_gelu",), tunings=(("fused_xent", "block=2048"),))
    back = harness.Run.from_json(run.to_json())
    assert back == run and hash(back) == hash(run)


@pytest.mark.parametrize("module, fields, match", [("fused_nope", "rows=1", "no kernel"),
                                                   ("fused_xent", "", "no FIELD=INTEGER given"),
                                                   ("fused_xent", "blocks=2048", "not FIELD=INTEGER"),
                                                   ("fused_xent", "block=big", "not FIELD=INTEGER"),
                                                   ("fused_xent", "block=1,block=2", "given twice"),
                                                   ("fused_xent", "block=3000", "power of two"),
                                                   ("fused_norm", "rows_fwd=3", "power of two"),
                                                   ("fused_norm", "bwd_programs=0", "at least 1")])
def test_bad_settings_are_refused(module, fields, match):
    with pytest.raises(ValueError, match=match):
        harness.kernel_tuning(module, fields)


def test_kernels_used_reads_the_compiled_step():
    hlo = 'custom-call(...), name="fused_gelu_fwd" ... metadata={op_name="jit(f)/fused_xent/pallas_call"}'
    assert harness.kernels_used(hlo) == ["fused_gelu", "fused_xent"]
    assert harness.kernels_used("fusion(...) dot(...)") == []


def test_bert_shape_gets_a_bert_batch():
    """The benchmark's BERT batch has Megatron's layout: token ids across the vocabulary, and masks,
    segment types and the sentence-order flag of 0 or 1 only."""
    import numpy as np

    steps, _state, batch, _compiled, _ = harness.build(harness.Run("bert-tiny", dtype="float32"))
    assert steps.cfg.model.model_type == "bert"
    for key in ("types", "loss_mask", "padding_mask", "is_random"):
        assert set(np.unique(np.asarray(batch[key]))) <= {0, 1}, key
    assert np.asarray(batch["text"]).max() > 1


def test_gpu_busy_counts_overlapping_kernels_once():
    # (name, hlo_op, scope, microseconds, start): two overlapping kernels, a gap of 5, one more.
    kernels = [("a", "", "", 10.0, 0.0), ("b", "", "", 10.0, 5.0), ("c", "", "", 10.0, 20.0)]
    assert profile_step._busy(kernels) == round(25 / 30, 4)
    assert profile_step._busy(kernels[:1]) == 1.0


def test_profile_groups_a_kernels_instances():
    # The same fusion kind in the same scope (two layers' instances, numbered apart) is one row.
    kernels = [("k", "loop_reduce_fusion.3", "jit(f)/layer/reduce_sum", 30.0, 0.0),
               ("k", "loop_reduce_fusion.17", "jit(f)/layer/reduce_sum", 10.0, 40.0),
               ("k", "loop_add_fusion.2", "jit(f)/layer/add", 5.0, 60.0)]
    out = profile_step._summarise(kernels, steps=1)
    assert out["top"][0] == {"class": "elementwise_norm", "op": "loop_reduce_fusion", "scope": "layer/reduce_sum",
                             "per_step": 2.0, "ms": 0.04}
    assert [(r["op"], r["per_step"]) for r in out["top"]] == [("loop_reduce_fusion", 2.0), ("loop_add_fusion", 1.0)]


def test_cpu_products_are_classed_as_matmul_and_attention():
    """On a CPU the products run as library fusions named by neither kernel nor HLO op as a GEMM (before, the
    whole tiny profile read 0 ms of matmul); their scope names the einsum. (Names as a CPU trace of
    `profile_step.py --shape tiny` gives them.)"""
    c = profile_step.classify
    assert c("ynn_fusion.4", "ynn_fusion.4", "forward_backward/jvp(Block)/mlp/mlp/btd,df->btf/dot_general") == "matmul"
    assert c("ynn_fusion", "ynn_fusion", "transpose(jvp(Block))/attention/attn/vmap(BTNH,BSNH->BNTS)/dot_general") \
        == "attention"
    assert c("ynn_fusion.9", "ynn_fusion.9", "jvp(Block)/attention/attn/vmap()/reduce_max") == "elementwise_norm"
    # an elementwise fusion that took the product's name stays elementwise, on any platform
    assert c("convert_bitcast_fusion", "convert_bitcast_fusion", "jvp()/btd,vd->btv/dot_general") == "elementwise_norm"


def test_clock_summary_takes_the_median_inside_the_window():
    samples = [(0.5, 1980, 120), (1.0, 1500, 690), (1.5, 1600, 700), (2.0, 1400, 695), (3.0, 1980, 130)]
    assert harness.clock_summary(samples, 1.0, 2.0) == {"sm_clock_mhz": 1500, "power_w": 695}
    assert harness.clock_summary(samples, 3.5, 4.0) == {}


def test_child_reports_when_its_result_line_arrived():
    import sys
    import time

    code = "import time; print('noise'); time.sleep(0.3); print('RESULT {\"x\": 1}'); time.sleep(0.3)"
    before = time.perf_counter()
    rec, at = harness._child_at([sys.executable, "-c", code], None, "probe")
    assert rec == {"x": 1} and before + 0.3 <= at <= time.perf_counter() - 0.3
    rec, at = harness._child_at([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                                   None, "probe")
    assert at is None and rec == {"run": "probe", "error": "exit 3: boom"}


def test_gpu_log_reads_nvidia_smi_and_stops_it(tmp_path, monkeypatch):
    """A stand-in `nvidia-smi` that prints a clock and a power each 20 ms until killed."""
    import time

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nwhile true; do echo '1500, 690.5'; echo 'garbage'; sleep 0.02; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with harness.GpuLog() as log:
        start = time.perf_counter()
        time.sleep(0.5)
        end = time.perf_counter()
    assert log._proc.poll() is not None  # stopped on exit
    assert harness.clock_summary(log.samples, start, end) == {"sm_clock_mhz": 1500, "power_w": 690}
    assert log.summary(start, end) == {"sm_clock_mhz": 1500, "power_w": 690}


def _mib(text: str, before: str) -> float:
    """The size printed just after `before` in one of the benchmarks' sentences, in MiB."""
    import re
    value, unit = re.search(re.escape(before) + r"([\d.]+) (GiB|MiB)", text).groups()
    return float(value) * (1024 if unit == "GiB" else 1)


def test_profile_step_refuses_a_shape_this_cpu_cannot_hold(monkeypatch, capsys):
    """On a CPU with too little free memory the profile stops with one sentence giving the train step's peak,
    which is the peak of the step the profile would run (before, a GPU shape here was OOM-killed, exit 137,
    with nothing printed)."""
    import jax3d.train.memory as memory
    from jax3d.train.memory import step_peak_bytes

    monkeypatch.setattr(memory, "host_available_bytes", lambda **_: 2**20)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main adds to it; put back afterwards
    assert profile_step.main(["--shape", "tiny"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: profile_step.py --shape tiny is a GPU benchmark") and len(err.splitlines()) == 1
    assert "try --shape tiny on a CPU" in err and _mib(err, "the host has ") == 1.0
    want = step_peak_bytes(harness.build(harness.Run("tiny"))[3]) / 2**20
    assert abs(_mib(err, "needs ") - want) <= 0.05


def test_measure_refuses_a_shape_this_cpu_cannot_hold(monkeypatch):
    """throughput.py's runs (harness.measure in a child process) report a step that can't fit this CPU as
    an error line; before, a GPU shape here was OOM-killed with nothing printed. With the host's memory the
    same run is timed."""
    import jax3d.train.memory as memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda **_: 2**20)
    rec = harness.measure(harness.Run("tiny"), steps_timed=1, warmup=0)
    assert set(rec) == {"who", "run", "error"} and "the host has 1.0 MiB free" in rec["error"]
    monkeypatch.undo()
    assert harness.measure(harness.Run("tiny"), steps_timed=1, warmup=0)["tokens_per_s"] > 0


def test_stage_times_refuses_a_stage_this_cpu_cannot_hold_and_runs_one_it_can(monkeypatch, capsys):
    """stage_times.py with too little free memory stops with one sentence; with the host's memory, the CPU run
    docs/pipeline-costs.md makes still counts its matmuls as that page's table does (6, 12, 8, 4, 17)."""
    import json

    import jax3d.train.memory as memory
    from benchmarks import stage_times

    args = ["--preset", "gpt-125m", "--stages", "12", "--micro-batch-size", "1", "--seq-length", "64", "--reps", "1"]
    with monkeypatch.context() as m:
        m.setattr(memory, "host_available_bytes", lambda **_: 2**20)
        assert stage_times.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stage_times.py --preset gpt-125m is a GPU benchmark") and len(err.splitlines()) == 1
    assert _mib(err, "needs at least ") > 1.0
    assert stage_times.main(args) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[0])
    assert out["gemms"] == {"F": 6, "BW_fused": 12, "B": 8, "W": 4, "plain_fwd_bwd": 17}
