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
from jax3d.models.presets import get_preset, preset_names
from jax3d.parallel.plan import resolve
from jax3d.cli.train import main
from jax3d.train.run import header
from jax3d.train.dry_run import per_device_bytes
from jax3d.train.step import abstract_batch, abstract_state, build_steps

# (8, 1, 1) with ZeRO-0: every device holds the whole fp32 parameter tree.
LAYOUT = ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1", "--zero-stage", "0"]




@pytest.mark.parametrize("name", preset_names())
def test_preset_traces_and_header_counts_the_real_tree(name):
    """At the preset's own shape and vocabulary; one sample a step keeps the trace small."""
    argv = ["--preset", name, "--vocab-size", str(get_preset(name)[0].vocab_size), "--micro-batch-size", "1",
            "--global-batch-size", "8", *LAYOUT]
    plan = resolve(config_from_args(build_parser().parse_args(argv)), 8)
    steps = build_steps(plan)
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


# Parameter counts of Meta's Hugging Face releases (model.num_parameters()): the presets are those models.
PUBLISHED = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "llama3-8b": 8_030_261_248,
             "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_llama_presets_have_the_published_parameter_counts(name):
    from jax3d.models import build_model, get_preset
    assert build_model(get_preset(name)[0]).num_params() == PUBLISHED[name]


def test_llama_flags_follow_megatron_defaults():
    """--swiglu without --ffn-hidden-size takes Megatron's size; --num-attention-heads alone sets as many KV heads;
    --use-rotary-position-embeddings drops the learned positions; a preset's own widths stay when no shape flag is
    given."""
    def model(*argv):
        return config_from_args(build_parser().parse_args(list(argv))).model

    m = model("--hidden-size", "4096", "--swiglu")
    assert m.ffn_hidden_size == int((4 * 4096 * 2 / 3) / 64) * 64 == 10880
    assert model("--hidden-size", "256").ffn_hidden_size == 1024
    m = model("--preset", "llama3-8b")
    assert (m.ffn_hidden_size, m.kv_heads, m.max_position_embeddings) == (14336, 8, 8192)
    assert model("--preset", "llama3-8b", "--num-attention-heads", "16").kv_heads == 16
    assert model("--preset", "llama3-8b", "--num-key-value-heads", "4").num_key_value_heads == 4
    m = model("--use-rotary-position-embeddings", "--rotary-position-embeddings-theta", "500000")
    assert m.use_rotary_position_embeddings and not m.add_position_embedding and m.rope_theta == 500000
    m = model("--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights")
    assert (m.normalization, m.add_bias_linear, m.untie_embeddings_and_output_weights) == ("rmsnorm", False, True)
    assert model().hidden_dropout == 0.1 and model("--preset", "llama-tiny").hidden_dropout == 0.0
