"""Named model shapes. GPT shapes follow the GPT-3 paper table as Megatron uses it."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig

# name: (layers, hidden, heads, seq, vocab, micro batch, global batch)
_GPT = {
    "gpt-tiny": (2, 128, 8, 128, 4096, 4, 32),
    "gpt-125m": (12, 768, 12, 2048, 50304, 4, 256),
    "gpt-350m": (24, 1024, 16, 2048, 50304, 4, 256),
    "gpt-760m": (24, 1536, 16, 2048, 50304, 4, 256),
    "gpt-1.3b": (24, 2048, 16, 2048, 50304, 4, 512),
    "gpt-2.7b": (32, 2560, 32, 2048, 50304, 2, 512),
    "gpt-6.7b": (32, 4096, 32, 2048, 50304, 1, 1024),
    "gpt-13b": (40, 5120, 40, 2048, 50304, 1, 1024),
    "gpt-175b": (96, 12288, 96, 2048, 50304, 1, 1536),
}
_BERT = {
    "bert-tiny": (2, 128, 8, 128, 4096, 4, 32),
    "bert-base": (12, 768, 12, 512, 30592, 4, 256),
    "bert-large": (24, 1024, 16, 512, 30592, 4, 256),
    "bert-336m": (24, 1024, 16, 512, 30592, 4, 256),
    "bert-1.3b": (24, 2048, 32, 512, 30592, 4, 512),
    "bert-3.9b": (48, 2560, 40, 512, 30592, 2, 512),
}
PRESETS = {**_GPT, **_BERT}


def preset_names() -> list[str]:
    return list(PRESETS)


def get_preset(name: str) -> tuple[ModelConfig, dict]:
    """Returns the preset's ModelConfig and its default batch sizes."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset {name!r}; choose one of: {', '.join(PRESETS)}")
    layers, hidden, heads, seq, vocab, micro, global_ = PRESETS[name]
    model = ModelConfig(
        model_type="bert" if name.startswith("bert") else "gpt",
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        seq_length=seq, vocab_size=vocab,
    )
    return model, {"micro_batch_size": micro, "global_batch_size": global_}
