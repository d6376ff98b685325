"""The model families, one module each (presets, Hugging Face mapping, command-line flags, model class), and the
registry every consumer reads: `jax3d.models.presets`, `jax3d.models.build_model`, `jax3d.hf.mapping` and
`jax3d.cli.train_flags`. Adding a family is a module and its line in `FAMILIES` (docs/architecture.md, "Adding a model family")."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.families import bert, gpt, llama
from jax3d.models.families.family import Family, Flag, HFMapping, Preset, Tensor

# Registry order is the order of `--preset`'s list and of the architectures an HF import tries.
FAMILIES: dict[str, Family] = {"gpt": gpt.FAMILY, "bert": bert.FAMILY, "llama": llama.FAMILY}


def model_types() -> list[str]:
    """The model types (`--model`'s choices): the names of the base families."""
    return [f.name for f in FAMILIES.values() if f.is_base]


def model_class(model_type: str) -> type:
    """The TransformerLM class of `model_type`; ConfigError naming the choices for another."""
    if model_type in FAMILIES and FAMILIES[model_type].is_base:
        return FAMILIES[model_type].model
    raise ConfigError(f"--model {model_type!r} must be {' or '.join(model_types())}")


def family_of(cfg: ModelConfig) -> Family:
    """The family of `cfg`: a variant of its model type that claims it, else the base family."""
    for f in FAMILIES.values():
        if f.model_type == cfg.model_type and not f.is_base and f.claims(cfg):
            return f
    model_class(cfg.model_type)  # an unknown model type gets the one sentence
    return FAMILIES[cfg.model_type]


def presets() -> dict[str, Preset]:
    """Every family's presets, in registry order."""
    return {name: p for f in FAMILIES.values() for name, p in f.presets.items()}


def flags() -> list[Flag]:
    """The flags of every family's group."""
    return [flag for f in FAMILIES.values() for flag in f.flags]


__all__ = ["FAMILIES", "Family", "Flag", "HFMapping", "Preset", "Tensor", "family_of", "flags", "model_class",
           "model_types", "presets"]
