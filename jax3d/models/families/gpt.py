"""The GPT family: GPT-2's block (learned positions, LayerNorm, GELU MLP, biases, tied embeddings), its presets
and its Hugging Face GPT-2 mapping. A GPT with any variant field GPT-2 lacks belongs to the Llama family."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.families.family import Family, HFMapping, Preset, Tensor, activation, gelu_name, ln, require, size
from jax3d.models.gpt import GPT

# The GPT-3 paper's table as Megatron uses it. name: (layers, hidden, heads, seq, vocab, micro batch, global batch)
_SHAPES = {
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


def shape_presets(model_type: str, shapes: dict) -> dict[str, Preset]:
    """Presets of (layers, hidden, heads, seq, vocab, micro batch, global batch) rows, every other field the
    ModelConfig default (GPT-2's block)."""
    return {name: Preset(ModelConfig(model_type=model_type, num_layers=layers, hidden_size=hidden,
                                     num_attention_heads=heads, seq_length=seq, vocab_size=vocab), micro, global_)
            for name, (layers, hidden, heads, seq, vocab, micro, global_) in shapes.items()}


# The ModelConfig fields of GPT-2's block (the defaults).
GPT2_FIELDS = {"normalization": "layernorm", "swiglu": False, "add_position_embedding": True,
               "use_rotary_position_embeddings": False, "add_bias_linear": True,
               "untie_embeddings_and_output_weights": False}


def variant(cfg: ModelConfig) -> str | None:
    """The first field in which `cfg` is not GPT-2's block (grouped-query attention included), or None."""
    if cfg.kv_heads != cfg.num_attention_heads:
        return "num_key_value_heads"
    return next((k for k, v in GPT2_FIELDS.items() if getattr(cfg, k) != v), None)


def _fields(hf: dict, arch: str) -> dict:
    for key, want, default in [("scale_attn_weights", True, True), ("scale_attn_by_inverse_layer_idx", False, False),
                               ("add_cross_attention", False, False), ("tie_word_embeddings", True, True)]:
        require(hf, key, want, default)
    d, n, v, pos = size(hf, "n_embd"), size(hf, "n_head"), size(hf, "vocab_size"), size(hf, "n_positions")
    ffn = size(hf, "n_inner") if hf.get("n_inner") is not None else 4 * d
    return dict(hidden_size=d, num_attention_heads=n, vocab_size=v,
                model_type="gpt", num_layers=size(hf, "n_layer"), ffn_hidden_size=ffn,
                max_position_embeddings=pos, seq_length=pos,
                layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=activation(hf, "activation_function"),
                hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                init_method_std=hf.get("initializer_range", 0.02))


def _config(cfg: ModelConfig, vocab: int) -> dict:
    act = gelu_name(cfg, "GPT-2")
    for field in ("post_layernorm", "embedding_layernorm"):
        if getattr(cfg, field):
            raise ConfigError(f"HF GPT-2 cannot express a GPT with {field}=True; export it as jax3d safetensors "
                              "with launch/export.py instead")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.num_layers,
            "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
            "n_positions": cfg.max_position_embeddings, "vocab_size": vocab,
            "layer_norm_epsilon": cfg.layernorm_epsilon, "activation_function": act,
            "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
            "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True}


def table(cfg: ModelConfig | None = None) -> list[Tensor]:
    """GPT-2's tensors. jax3d's fused QKV kernel (embed, 3, heads, head_dim) is `c_attn.weight` (embed, 3 * embed)
    reshaped; GPT-2's Conv1D stores (in, out), jax3d's order."""
    h = "transformer.h.{i}."
    return [Tensor("embed.word", "transformer.wte.weight", vocab=True),
            Tensor("embed.position", "transformer.wpe.weight"),
            *ln("final_norm", "transformer.ln_f"),
            *ln("blocks.ln_attn", h + "ln_1"), *ln("blocks.ln_mlp", h + "ln_2"),
            Tensor("blocks.attn.qkv_kernel", h + "attn.c_attn.weight"),
            Tensor("blocks.attn.qkv_bias", h + "attn.c_attn.bias"),
            Tensor("blocks.attn.out_kernel", h + "attn.c_proj.weight", split=2),
            Tensor("blocks.attn.out_bias", h + "attn.c_proj.bias"),
            Tensor("blocks.mlp.up_kernel", h + "mlp.c_fc.weight"), Tensor("blocks.mlp.up_bias", h + "mlp.c_fc.bias"),
            Tensor("blocks.mlp.down_kernel", h + "mlp.c_proj.weight"),
            Tensor("blocks.mlp.down_bias", h + "mlp.c_proj.bias")]


def _hf_name(name: str) -> str:
    """Some GPT-2 files lack the LM-head class's `transformer.` prefix."""
    return name if name.startswith(("transformer.", "lm_head")) else "transformer." + name


FAMILY = Family(
    name="gpt", model_type="gpt", model=GPT, presets=shape_presets("gpt", _SHAPES), default_preset="gpt-tiny",
    hf=HFMapping(architectures=("GPT2LMHeadModel",), by_model_type={"gpt2": "GPT2LMHeadModel"}, fields=_fields,
                 config=_config, table=table, hf_name=_hf_name,
                 # the tied output layer; the attention's causal-mask buffers
                 ignored=("lm_head.weight", ".attn.bias", ".attn.masked_bias")))
