"""Llama through launch/train.py: Megatron-DeepSpeed's llama2 example script trains as written at a tiny size, and
the --dry-run of the large presets reports per-device bytes that fit 80 GB GPUs."""
import json

import pytest

from jax3d.checkpoint.read import read_meta
from jax3d.cli.train import main
from tests.cli.test_megatron_scripts import script_args

GIB = 2**30


def test_megatron_deepspeed_llama2_example_trains_on_8_devices(tmp_path, capsys):
    """examples_deepspeed/pretrain_llama2_distributed.sh's arguments (TP 2, PP 2, its DeepSpeed JSON, the LLaMA
    flags), sizes and run length shrunk, data the bundled corpus: two steps on (data, stage, model) = (2, 2, 2),
    and the checkpoint records the Llama it asked for."""
    tiny = [("--num-layers", "4"), ("--hidden-size", "64"), ("--ffn-hidden-size", "176"),
            ("--num-attention-heads", "8"), ("--seq-length", "32"), ("--max-position-embeddings", "32"),
            ("--train-iters", "2"), ("--save-interval", "2"), ("--lr-warmup-iters", "1")]
    argv = script_args("pretrain_llama2_distributed", tmp_path, tiny)
    assert main([*argv, "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "on (data, stage, model) = (2, 2, 2)" in err and "1f1b pipeline over 4 micro-batches" in err
    model = read_meta(str(tmp_path / "ck"), 2)["config"]["model"]
    assert {k: model[k] for k in ("normalization", "swiglu", "num_key_value_heads", "use_rotary_position_embeddings",
                                  "add_position_embedding", "untie_embeddings_and_output_weights",
                                  "add_bias_linear")} == {
        "normalization": "rmsnorm", "swiglu": True, "num_key_value_heads": 4, "use_rotary_position_embeddings": True,
        "add_position_embedding": False, "untie_embeddings_and_output_weights": True, "add_bias_linear": False}


DRY_RUNS = {  # name: (preset, flags); bf16, one sample of the preset's sequence per micro-batch, 16 per step
    "llama3-8b-tp8-sp-selective": ("llama3-8b", ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                                                  "1", "--sequence-parallel", "--recompute", "selective"]),
    "llama3-8b-dp2-tp4-zero1-sp-selective": ("llama3-8b", ["--tensor-model-parallel-size", "4",
                                                           "--pipeline-model-parallel-size", "1", "--zero-stage", "1",
                                                           "--sequence-parallel", "--recompute", "selective"]),
    "llama2-13b-tp2-pp4-sp-selective": ("llama2-13b", ["--tensor-model-parallel-size", "2",
                                                       "--pipeline-model-parallel-size", "4", "--sequence-parallel",
                                                       "--recompute", "selective"]),
}


@pytest.mark.parametrize("name", list(DRY_RUNS))
def test_dry_run_of_large_llamas_fits_80gb_gpus(name, tmp_path, capsys):
    from jax3d.models import get_preset
    preset, flags = DRY_RUNS[name]
    vocab = get_preset(preset)[0].vocab_size
    assert main(["--preset", preset, "--vocab-size", str(vocab), "--bf16", "--dry-run", "--micro-batch-size", "1",
                 "--global-batch-size", "16", *flags, "--log-dir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    print(name, {k: round(report[k] / GIB, 2) for k in ("params", "opt_state", "grads", "temp", "peak")})
    assert report["params"] < report["peak"] < 70 * GIB  # room left on an 80 GB card


def test_a_checkpoint_from_before_the_llama_fields_resumes(tmp_path, monkeypatch, capsys):
    """A GPT checkpoint whose recorded model has none of the Llama fields (saved before they existed) resumes with
    GPT-2's block, its 4 heads one KV head each, though the default preset has 8."""
    from jax3d.config import Config

    new = {"normalization", "swiglu", "num_key_value_heads", "add_bias_linear", "add_position_embedding",
           "use_rotary_position_embeddings", "rope_theta", "rotary_percent", "rope_scaling", "rope_scaling_factor",
           "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_position_embeddings",
           "untie_embeddings_and_output_weights"}
    to_dict = Config.to_dict
    monkeypatch.setattr(Config, "to_dict", lambda self: {**to_dict(self), "model": {
        k: v for k, v in to_dict(self)["model"].items() if k not in new}})
    common = ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "1", "--eval-interval", "0",
              "--no-progress", "--log-dir", str(tmp_path / "log")]
    assert main(["--num-attention-heads", "4", "--train-iters", "1", "--save", str(tmp_path / "ck"), *common]) == 0
    assert "normalization" not in read_meta(str(tmp_path / "ck"), 1)["config"]["model"]
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["--load", str(tmp_path / "ck"), "--train-iters", "2", *common]) == 0
    out = capsys.readouterr()
    assert "gpt 2L d128" in out.err and '"step": 2' in out.out, out
