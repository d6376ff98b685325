"""The FP8 benchmarks run on a CPU at tiny shapes, so a GPU call won't die on a typo: throughput.py's `--fp8` runs
reach the step and report against the plain run, benchmarks.fp8_loss writes both curves and issue 33's verdict,
and benchmarks.plot_loss draws them."""
import json

import numpy as np
import pytest

from benchmarks import fp8_loss, harness, plot_loss, throughput


def test_an_fp8_run_reaches_its_config_and_survives_the_trip_to_its_process():
    run = harness.Run("llama-tiny", fp8="hybrid")
    assert harness.Run.from_json(run.to_json()) == run and run.label() == "llama-tiny fp8=hybrid"
    assert harness.config_for(run).precision.fp8 == "hybrid"
    assert harness.config_for(harness.Run("tiny")).precision.fp8 == ""


def test_throughput_runs_fp8_after_the_plain_run(monkeypatch, capsys):
    """In this process (harness.measure, not a child): the plain run, then FP8, with its ratio to the plain run
    and the count of cuBLASLt FP8 GEMMs (none on a CPU, where XLA emulates the f8 dots)."""
    monkeypatch.setattr(harness, "run_isolated", lambda run, steps: harness.measure(run, steps, warmup=0))
    monkeypatch.setattr(throughput, "run_isolated", harness.run_isolated)
    assert throughput.main(["--shape", "tiny", "--dtype", "float32", "--fp8", "hybrid", "--steps", "1"]) == 0
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["run"] for r in recs] == ["tiny", "tiny fp8=hybrid"]
    assert recs[1]["fp8"] == "hybrid" and recs[1]["fp8_gemms"] == 0 and recs[1]["vs_first"] > 0
    assert "gemm_kinds" not in recs[0] and sum(recs[1]["gemm_kinds"].values()) > 0
    assert np.isfinite(recs[1]["loss"])


def test_the_cast_kernels_ablation_is_an_fp8_run_and_needs_fp8(monkeypatch, capsys):
    """fp8_cast runs by default in FP8 GEMMs only: `--ablate fp8_cast` (or 'all' with --fp8) adds an FP8 run
    without it; without --fp8 it is refused in one sentence, and 'all' leaves it out."""
    ran = []
    monkeypatch.setattr(throughput, "run_isolated", lambda run, steps: ran.append(run) or {"run": run.label(), "error": "not run"})
    throughput.main(["--shape", "tiny", "--fp8", "hybrid", "--ablate", "fp8_cast", "--steps", "1"])  # 1: none ran
    assert ran[-1].ablate == ("fp8_cast",) and ran[-1].fp8 == "hybrid"
    ran.clear()
    throughput.main(["--shape", "tiny", "--ablate", "all", "--steps", "1"])
    assert ran and all("fp8_cast" not in r.ablate for r in ran)
    with pytest.raises(SystemExit) as e:
        throughput.main(["--shape", "tiny", "--ablate", "fp8_cast"])
    assert e.value.code == 2 and "add --fp8 hybrid" in capsys.readouterr().err


def test_xla_flag_runs_take_the_first_fp8_format_and_recompute(monkeypatch):
    """`--xla-flags` adds a run per string; with --fp8 it is an FP8 run (to time the FP8 step under XLA's
    options), without it a plain one."""
    ran = []
    monkeypatch.setattr(throughput, "run_isolated", lambda run, steps: ran.append(run) or {"run": run.label(), "error": "not run"})
    throughput.main(["--shape", "tiny", "--fp8", "e4m3", "hybrid", "--recompute", "full", "none",
                     "--xla-flags=--xla_gpu_autotune_level=0", "--steps", "1"])
    flagged = [r for r in ran if r.xla_flags]
    assert [(r.xla_flags, r.fp8, r.recompute) for r in flagged] == [("--xla_gpu_autotune_level=0", "e4m3", "full")]
    ran.clear()
    throughput.main(["--shape", "tiny", "--xla-flags=--xla_gpu_autotune_level=0", "--steps", "1"])
    assert [(r.xla_flags, r.fp8) for r in ran if r.xla_flags] == [("--xla_gpu_autotune_level=0", "")]


def test_the_verdict_is_issue_33s_rules():
    bf16 = np.linspace(4.0, 3.0, 200)
    v = fp8_loss.verdict(list(bf16), list(bf16 * 1.005))
    assert v["final_ok"] and v["no_divergence"] and v["final_rel"] == pytest.approx(0.005)
    spike = bf16.copy()
    spike[150] *= 1.06  # one step 6% above bf16's after step 100
    v = fp8_loss.verdict(list(bf16), list(spike))
    assert v["final_ok"] and not v["no_divergence"] and v["worst_step_rel_after_100"] == pytest.approx(0.06)
    assert not fp8_loss.verdict(list(bf16), list(bf16 * 1.02))["final_ok"]


@pytest.mark.slow
def test_fp8_loss_writes_both_curves_and_the_plot_draws_them(tmp_path):
    out = tmp_path / "run"
    assert fp8_loss.main(["--preset", "gpt-tiny", "--seq", "32", "--batch", "8", "--micro-batch", "1",
                          "--steps", "4", "--eval-interval", "2", "--out", str(out)]) == 0
    result = json.loads((out / "fp8_loss.json").read_text())
    for name in ("bf16", "fp8"):
        assert len(result[name]["loss"]) == 4 and [s for s, _ in result[name]["val"]] == [2, 4]
    assert result["bf16"]["loss"][0] == pytest.approx(result["fp8"]["loss"][0], abs=1e-2)  # same model and data
    assert set(result["verdict"]) >= {"final_rel", "final_ok", "no_divergence"}
    svg = tmp_path / "loss.svg"
    assert plot_loss.main([str(out / "fp8_loss.json"), "--out", str(svg)]) == 0
    text = svg.read_text()
    assert text.startswith("<svg") and text.count("<polyline") == 4 and "final loss bf16" in text
