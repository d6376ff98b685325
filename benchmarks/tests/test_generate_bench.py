"""The generation benchmarks on a CPU with tiny shapes, so that a GPU run does not fail on a typo: generate_speed's
jax3d tokens against both transformers peers' (the compiled static cache and eager), its compile counts and
limits; profile_decode's breakdown against its own wall time; the loop-body kernel count against a hand-written HLO."""
import json
import tempfile

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _records(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


# Each batch size compiles transformers' static-cache step (torch.compile) again: the GPT-2 runs two, to check that
# the limits scale with the batch; the Llama, whose point is its family, one.
@pytest.mark.slow
@pytest.mark.parametrize("shape, args, batches", [("small", ["--small", "--trace"], [1, 2]),
                                                  ("llama-tiny", ["--shape", "llama-tiny", "--prompt-len", "16", "--new",
                                                                  "32", "--eager-new", "16", "--trace"], [2])],
                         ids=["gpt2", "llama"])
def test_generate_speed_small_agrees_with_both_peers(capsys, shape, args, batches):
    """GPT-2, and a jax3d Llama preset as HF's LlamaForCausalLM (grouped-query heads, rotary positions)."""
    from benchmarks import generate_speed

    assert generate_speed.main([*args, "--batch", *map(str, batches), "--repeats", "1"]) == 0
    head, *rows = _records(capsys)
    assert head["shape"] == shape and head["weight_gb"] > 0 and head["copy_tb_s"] > 0
    assert [r["batch"] for r in rows] == batches
    for r in rows:
        assert r["jax3d_compiles"] == {"prefill": 1, "decode": 1}
        # the kernels it reports as run: none on a CPU (XLA's attention and blocks), as profile_decode says
        assert r["jax3d_decode_kernel_ran"] is False and r["jax3d_fused_blocks_ran"] is False
        assert r["hf_static_compiled"] is True  # transformers' compiled path, not a silent eager fallback
        assert r["same_tokens_frac_static"] == 1.0 and r["same_tokens_frac_eager"] == 1.0  # fp32: token for token
        assert r["hf_top1_of_jax3d_frac"] == 1.0 and r["hf_max_logit_gap_of_jax3d"] == 0.0  # and transformers' picks
        assert r["limit_tok_s"] == pytest.approx(r["batch"] / rows[0]["batch"] * rows[0]["limit_tok_s"], rel=1e-3)
        assert r["limit_with_cache_tok_s"] < r["limit_tok_s"]
        assert r["jax3d_trace"]["kernels_per_step"] > 0
        # (nan both sides where a tiny model's decode time is lost in the CPU's noise: generate_speed.decode_rate)
        assert sum(r["jax3d_step_ms"].values()) == pytest.approx(r["batch"] * 1e3 / r["jax3d_decode_tok_s"], abs=2e-3,
                                                                 nan_ok=True)


def test_transformers_judges_its_own_greedy_tokens_first_and_other_tokens_below(tmp_path):
    """generate_speed.hf_judges, teacher-forced: transformers' greedy tokens are its top picks (gap 0); tokens it
    ranks last are none, and fall short of its top logit by the logits' range."""
    import numpy as np
    import torch

    from benchmarks.generate_speed import hf_judges
    from tests.hf_fixtures import tiny_gpt2

    model = tiny_gpt2(str(tmp_path / "hf"), vocab=200).eval()
    model.generation_config.eos_token_id = None  # six tokens a row, none of them padding
    prompts = np.random.RandomState(0).randint(0, 200, (2, 5))
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts), max_new_tokens=6, do_sample=False, pad_token_id=0)
    greedy = out[:, 5:].numpy()
    assert hf_judges(model, prompts, greedy, "cpu") == {"hf_top1_of_jax3d_frac": 1.0, "hf_max_logit_gap_of_jax3d": 0.0}
    with torch.no_grad():
        first = model(torch.tensor(prompts)).logits[:, -1]
    worst = first.argmin(dim=1).numpy()[:, None]  # one token a row: the one transformers ranks last
    judged = hf_judges(model, prompts, worst, "cpu")
    spread = (first.max(dim=1).values - first.min(dim=1).values).max().item()
    assert judged["hf_top1_of_jax3d_frac"] == 0.0
    assert judged["hf_max_logit_gap_of_jax3d"] == pytest.approx(spread, rel=1e-3)


def test_the_bf16_llama_peer_is_what_from_pretrained_gives_for_its_weights(tmp_path):
    """generate_speed's transformers model in bf16 computes what transformers' from_pretrained(dtype=bf16) makes
    of the weights it saved, logit for logit (its rotary frequencies fp32, not rounded to bf16 with the weights,
    which moved its logits more with each position)."""
    import numpy as np
    import torch
    import transformers

    from benchmarks.generate_speed import hf_model

    model = hf_model("llama-tiny", str(tmp_path / "hf"), "cpu", torch.bfloat16)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.bfloat16).eval()
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = torch.tensor(np.random.RandomState(0).randint(0, model.config.vocab_size, (1, 64)))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_profile_decode_tiny_breakdown_adds_up(capsys):
    from benchmarks import profile_decode

    assert profile_decode.main(["--shape", "tiny", "--batch", "1", "2", "--new", "6", "--hlo"]) == 0
    head, *rows = _records(capsys)
    for r in rows:
        parts = r["breakdown_ms"]
        assert parts["weights"] == head["weights_ms"]
        assert parts["weights"] + parts["cache"] + parts["else"] == pytest.approx(r["wall_ms_per_step"], abs=2e-3)
        assert r["compiles"] == {"prefill": 1, "decode": 1}
        assert r["hlo_kernels_per_step"] > 10 * 2  # a few kernels a layer at least
        assert r["kernels_per_step"] > 0


def test_profile_decode_top_kernels_are_the_traced_kernels_by_name(capsys, monkeypatch, tmp_path):
    """--top lists the traced kernels by name; the traces' folders are removed afterwards."""
    from benchmarks import profile_decode

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert profile_decode.main(["--shape", "tiny", "--batch", "2", "--new", "6", "--top", "1000"]) == 0
    _, r = _records(capsys)
    top = r["top_kernels"]
    times = [us for _, us, _ in top]
    assert times == sorted(times, reverse=True) and len({name for name, _, _ in top}) == len(top)
    # every name listed: their times add up to the kernel time of the step, their launches to its kernels
    assert sum(times) / 1e3 == pytest.approx(r["kernel_ms_total_per_step"], abs=0.01 * len(top) / 1e3 + 2e-3)
    assert sum(n for _, _, n in top) == pytest.approx(r["kernels_per_step"], abs=0.01 * len(top) + 0.1)
    assert profile_decode.main(["--shape", "tiny", "--batch", "2", "--new", "6", "--top", "3"]) == 0
    _, r3 = _records(capsys)
    assert len(r3["top_kernels"]) == 3
    assert not list(tmp_path.iterdir())


def test_a_step_too_short_to_time_is_timed_again_then_given_up(monkeypatch):
    """profile_decode.step_wall_ms: a generate whose time does not grow with the tokens asked for (as a tiny
    model's can on a CPU, within the timer's noise) is timed again with twice the repeats, twice, then gives None
    (profile_decode says so in one sentence, not a negative or infinite tokens/s); one that grows on a later try
    gives that try's time."""
    from benchmarks import profile_decode

    clock = {"t": 0.0, "calls": 0, "grows_from": 99}

    class Gen:
        def generate(self, rows, n):  # one tick a call, or n ticks once it "grows"
            clock["calls"] += 1
            clock["t"] += n if clock["calls"] > clock["grows_from"] else 1

    monkeypatch.setattr(profile_decode.time, "perf_counter", lambda: clock["t"])
    assert profile_decode.step_wall_ms(Gen(), [[1, 2]], new=4, repeats=1) is None
    assert clock["calls"] == 2 + 4 + 8  # 1 and 1 repeats, then 2 and 2, then 4 and 4
    clock.update(calls=0, grows_from=2)  # the second try sees 4 ticks for 4 tokens and 1 for 1
    assert profile_decode.step_wall_ms(Gen(), [[1, 2]], new=4, repeats=1) == (4 - 1) / (4 - 1) * 1e3
    assert clock["calls"] == 2 + 4


def test_profile_decode_refuses_a_negative_top(capsys):
    from benchmarks import profile_decode

    with pytest.raises(SystemExit) as e:
        profile_decode.main(["--shape", "tiny", "--top", "-1"])
    assert e.value.code == 2 and "--top -1: give how many kernels" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        profile_decode.main(["--shape", "tiny", "--new", "1"])
    assert e.value.code == 2 and "--new 1: give 2 or more" in capsys.readouterr().err


@pytest.mark.parametrize("tune, says", [("fused_gelu:block=8", "no decode kernel 'fused_gelu'"),
                                         ("decode_attention:blocks=8", "'blocks=8' is not FIELD=INTEGER"),
                                         ("decode_attention:block=48", "must be a power of two")])
def test_profile_decode_refuses_a_bad_tune_in_one_sentence(tune, says, capsys):
    from benchmarks import profile_decode

    with pytest.raises(SystemExit) as e:
        profile_decode.main(["--shape", "tiny", "--tune", tune])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert says in err and "Traceback" not in err


def test_loop_body_kernels_counts_into_calls_not_fusions():
    from benchmarks.profile_decode import loop_body_kernels

    hlo = """HloModule m

%fused (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}

%command_buffer (a: f32[2]) -> f32[2] {
  %a = f32[2]{0} parameter(0)
  %f1 = f32[2]{0} fusion(%a), kind=kLoop, calls=%fused
  ROOT %f2 = f32[2]{0} fusion(%f1), kind=kLoop, calls=%fused
}

%body (t: (s32[], f32[2])) -> (s32[], f32[2]) {
  %t = (s32[], f32[2]{0}) parameter(0)
  %x = f32[2]{0} get-tuple-element(%t), index=1
  %c = f32[2]{0} call(%x), to_apply=%command_buffer
  %d = f32[2]{0} custom-call(%c), custom_call_target="__cublas$gemm"
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[2]{0}) tuple(%i, %d)
}

%cond (t: (s32[], f32[2])) -> pred[] {
  %t = (s32[], f32[2]{0}) parameter(0)
  ROOT %p = pred[] constant(true)
}

ENTRY %main (x: f32[2]) -> (s32[], f32[2]) {
  %x = f32[2]{0} parameter(0)
  %z = s32[] constant(0)
  %t = (s32[], f32[2]{0}) tuple(%z, %x)
  ROOT %w = (s32[], f32[2]{0}) while(%t), condition=%cond, body=%body
}
"""
    assert loop_body_kernels(hlo) == {"fusion": 2, "custom-call": 1}


def test_decode_judge_gives_transformers_fp32_tokens_in_fp32_and_refuses_a_bad_count(capsys):
    """benchmarks.decode_judge at the tiny Llama: jax3d's fp32 decode is transformers' fp32 generate token for
    token, and transformers' fp32 logits rank each of its tokens first; bf16 sides are judged beside it."""
    from benchmarks import decode_judge

    assert decode_judge.main(["--shape", "llama-tiny", "--prompt-len", "16", "--new", "8"]) == 0
    head, *rows = _records(capsys)
    assert head["layers"] == 4 and head["new"] == 8
    by_side = {r.pop("side"): r for r in rows}
    assert sorted(by_side) == ["jax3d_bfloat16", "jax3d_float32", "transformers_bfloat16", "transformers_float32"]
    exact = {"same_tokens_as_transformers_fp32": 1.0, "fp32_top1_frac": 1.0, "fp32_max_logit_gap": 0.0}
    assert by_side["jax3d_float32"] == exact and by_side["transformers_float32"] == exact
    assert decode_judge.main(["--shape", "small", "--layers", "1", "--prompt-len", "16", "--new", "8"]) == 0
    head, *rows = _records(capsys)  # GPT-2, one block
    assert head["layers"] == 1 and {r["side"]: r for r in rows}["jax3d_float32"]["fp32_top1_frac"] == 1.0
    for argv, says in ((["--new", "0"], "--new 0: give a positive number"),
                       (["--shape", "small", "--layers", "3"], "--layers 3: give 0 (all) or up to small's 2 blocks"),
                       (["--shape", "small"], "--prompt-len 48 plus --new 24 is longer than small's 64 positions")):
        with pytest.raises(SystemExit) as e:
            decode_judge.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err
