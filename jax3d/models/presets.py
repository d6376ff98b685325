"""Named model shapes, read from the families (jax3d.models.families): GPT shapes follow the GPT-3 paper table as
Megatron uses it, Llama shapes are the published configs of Meta's Hugging Face releases."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.families import presets


def preset_names() -> list[str]:
    return list(presets())


def get_preset(name: str) -> tuple[ModelConfig, dict]:
    """Returns the preset's ModelConfig and its default batch sizes."""
    found = presets().get(name)
    if found is None:
        raise ConfigError(f"unknown --preset {name!r}; choose one of: {', '.join(preset_names())}")
    return found.model, {"micro_batch_size": found.micro_batch_size, "global_batch_size": found.global_batch_size}
