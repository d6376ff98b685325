"""The family registry (jax3d.models.families): a family module plus its line in `FAMILIES` is all that adding a
model family takes. A toy family, written here as its own module would be, is registered and every consumer
(presets, the train command line, build_model, the Hugging Face mapping) picks it up with no other edit."""
import dataclasses

import jax
import numpy as np
import pytest

from jax3d.config import ConfigError, ModelConfig
from jax3d.models import families
from jax3d.models.families import FAMILIES, Family, Flag, HFMapping, Preset, family_of
from jax3d.models.families import gpt as gpt_family
from jax3d.models.gpt import GPT


# --- the toy family's module -------------------------------------------------------------------------------

class ToyLM(GPT):
    """The toy family's model class: GPT's, under a name of its own."""


TOY_PRESETS = {"toy-tiny": Preset(ModelConfig(model_type="toy", num_layers=2, hidden_size=32, num_attention_heads=4,
                                              seq_length=16, vocab_size=128, hidden_dropout=0.0,
                                              attention_dropout=0.0), 2, 16)}


def _toy_fields(hf: dict, arch: str) -> dict:
    return dict(model_type="toy", num_layers=hf["layers"], hidden_size=hf["width"], num_attention_heads=hf["heads"],
                vocab_size=hf["vocab"], seq_length=hf["context"], hidden_dropout=0.0, attention_dropout=0.0)


def _toy_config(cfg: ModelConfig, vocab: int) -> dict:
    return {"architectures": ["ToyForCausalLM"], "model_type": "toy", "layers": cfg.num_layers,
            "width": cfg.hidden_size, "heads": cfg.num_attention_heads, "vocab": vocab, "context": cfg.seq_length}


def _toy_table(cfg: ModelConfig):
    """GPT-2's tensors under the toy's prefix."""
    return [dataclasses.replace(t, hf=t.hf.replace("transformer.", "toy.")) for t in gpt_family.table(cfg)]


TOY = Family(name="toy", model_type="toy", model=ToyLM, presets=TOY_PRESETS, default_preset="toy-tiny",
             hf=HFMapping(architectures=("ToyForCausalLM",), by_model_type={"toy": "ToyForCausalLM"},
                          fields=_toy_fields, config=_toy_config, table=_toy_table),
             flag_group="toy variants",
             flags=(Flag(("--toy-squared-relu",), dict(action="store_const", const="squared_relu", default=None,
                                                       dest="activation",
                                                       help="relu(x)^2 MLP (default: the preset's, GELU)")),))


@pytest.fixture
def toy(monkeypatch):
    """The toy family's registry line."""
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    return TOY


# --- what picks it up ---------------------------------------------------------------------------------------

def test_presets_list_and_build_the_toy(toy):
    from jax3d.models import get_preset, preset_names
    assert preset_names()[-1] == "toy-tiny" and "gpt-tiny" in preset_names()
    model, batch = get_preset("toy-tiny")
    assert model == TOY_PRESETS["toy-tiny"].model
    assert batch == {"micro_batch_size": 2, "global_batch_size": 16}


def test_the_command_line_takes_its_model_type_presets_and_flags(toy):
    from jax3d.cli.train_flags import build_parser, config_from_args
    from tests.cli.test_help import help_problems

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(list(argv)))

    by_model = cfg("--model", "toy")
    # the family's default preset, its vocabulary left to the tokenizer (0) as every preset's is
    assert by_model.model == dataclasses.replace(TOY_PRESETS["toy-tiny"].model, vocab_size=0)
    assert (by_model.train.micro_batch_size, by_model.train.global_batch_size) == (2, 16)
    assert cfg("--preset", "toy-tiny").model == by_model.model
    assert cfg("--preset", "toy-tiny", "--toy-squared-relu").model.activation == "squared_relu"
    assert cfg("--preset", "toy-tiny", "--num-layers", "3").model.num_layers == 3  # the shared flags apply
    with pytest.raises(ConfigError, match="--model toy does not match --preset gpt-tiny; pick a toy-\\* preset"):
        cfg("--model", "toy", "--preset", "gpt-tiny")
    parser = build_parser()
    text = parser.format_help()
    assert "toy variants" in text and "--toy-squared-relu" in text and "toy-tiny with --model toy" in text
    assert help_problems(parser) == []


def test_build_model_makes_its_class_which_computes_what_its_reference_does(toy):
    """ToyLM is GPT's code: on the same parameters its logits are the GPT's."""
    from jax3d.models import build_model
    cfg = TOY_PRESETS["toy-tiny"].model
    model = build_model(cfg)
    assert type(model) is ToyLM
    params = model.init(jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, cfg.vocab_size)
    reference = GPT(dataclasses.replace(cfg, model_type="gpt")).logits(params, tokens)
    np.testing.assert_array_equal(model.logits(params, tokens), reference)


def test_the_hf_mapping_imports_and_exports_it(toy):
    """config.json both ways, and the tensors out and back in give the parameters again."""
    from jax3d.hf.mapping import from_hf, hf_config_from_model, model_config_from_hf, to_hf
    from jax3d.models import build_model
    cfg = TOY_PRESETS["toy-tiny"].model
    hf = hf_config_from_model(cfg, {"bos_token_id": 1})
    assert hf == {**_toy_config(cfg, 128), "bos_token_id": 1}
    assert model_config_from_hf(hf) == dataclasses.replace(cfg, unpadded_vocab_size=128)
    assert model_config_from_hf({k: v for k, v in hf.items() if k != "architectures"}).model_type == "toy"

    params = jax.tree.map(np.asarray, build_model(cfg).init(jax.random.PRNGKey(0)))
    tensors = to_hf(params, cfg)
    assert tensors and all(name.startswith("toy.") for name in tensors)
    np.testing.assert_array_equal(tensors["toy.h.1.mlp.c_fc.weight"], params["blocks"]["mlp"]["up_kernel"][1])
    back = from_hf(tensors, cfg, jax.tree.map(np.zeros_like, params))
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_unregistered_it_is_gone():
    """The fixture's line is the toy's only trace: without it nothing knows the toy."""
    from jax3d.cli.train_flags import build_parser
    from jax3d.hf.mapping import architecture
    from jax3d.models import build_model, preset_names
    assert "toy-tiny" not in preset_names() and "--toy-squared-relu" not in build_parser().format_help()
    with pytest.raises(ConfigError, match="--model 'toy' must be gpt or bert"):
        build_model(TOY_PRESETS["toy-tiny"].model)
    with pytest.raises(ConfigError, match="cannot import"):
        architecture({"architectures": ["ToyForCausalLM"]})


# --- the shipped registry -----------------------------------------------------------------------------------

def test_each_preset_belongs_to_the_family_that_lists_it():
    for family in FAMILIES.values():
        for name, preset in family.presets.items():
            assert family_of(preset.model) is family, name
            assert families.model_class(preset.model.model_type) is family.model


def test_model_types_are_the_base_families_and_each_hf_architecture_has_one_family():
    assert families.model_types() == ["gpt", "bert"]
    archs = [a for f in FAMILIES.values() for a in f.hf.architectures]
    assert len(archs) == len(set(archs))
    assert FAMILIES["llama"].model is FAMILIES["gpt"].model  # a variant shares its base's class
