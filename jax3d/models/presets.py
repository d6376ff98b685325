"""Named model shapes. GPT shapes follow the GPT-3 paper table as Megatron uses it; Llama shapes are the
published configs of Meta's Hugging Face releases."""
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

# What every Llama shares: RMSNorm, SwiGLU, rotary positions, no biases, no dropout.
_LLAMA_BLOCK = dict(normalization="rmsnorm", swiglu=True, add_bias_linear=False, use_rotary_position_embeddings=True,
                    hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5)
_LLAMA3_2_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192,
                      max_position_embeddings=131072, vocab_size=128256)
_UNTIED = dict(untie_embeddings_and_output_weights=True)
# name: (layers, hidden, heads, KV heads, FFN, training sequence, micro batch, global batch, other fields)
_LLAMA = {
    "llama-tiny": (4, 128, 8, 4, 0, 128, 4, 32, dict(vocab_size=4096, **_UNTIED)),  # FFN: Megatron's SwiGLU default
    "llama3.2-1b": (16, 2048, 32, 8, 8192, 8192, 1, 512, _LLAMA3_2_ROPE),
    "llama3.2-3b": (28, 3072, 24, 8, 8192, 8192, 1, 512, _LLAMA3_2_ROPE),
    "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 1, 512, dict(rope_theta=500000.0, vocab_size=128256, **_UNTIED)),
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 1, 1024, dict(vocab_size=32000, **_UNTIED)),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 1, 1024, dict(vocab_size=32000, **_UNTIED)),
}


def preset_names() -> list[str]:
    return [*PRESETS, *_LLAMA]


def get_preset(name: str) -> tuple[ModelConfig, dict]:
    """Returns the preset's ModelConfig and its default batch sizes."""
    if name in _LLAMA:
        layers, hidden, heads, kv, ffn, seq, micro, global_, other = _LLAMA[name]
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                            ffn_hidden_size=ffn, seq_length=seq, **{"max_position_embeddings": seq, **_LLAMA_BLOCK,
                                                                    **other})
        return model, {"micro_batch_size": micro, "global_batch_size": global_}
    if name not in PRESETS:
        raise ConfigError(f"unknown --preset {name!r}; choose one of: {', '.join(preset_names())}")
    layers, hidden, heads, seq, vocab, micro, global_ = PRESETS[name]
    model = ModelConfig(
        model_type="bert" if name.startswith("bert") else "gpt",
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        seq_length=seq, vocab_size=vocab,
    )
    return model, {"micro_batch_size": micro, "global_batch_size": global_}
