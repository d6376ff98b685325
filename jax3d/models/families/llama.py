"""The Llama family: a GPT with RMSNorm, SwiGLU, rotary positions, grouped-query attention, no biases and an
output layer of its own. Its presets (Meta's Hugging Face releases), its Hugging Face mapping (LlamaForCausalLM,
and MistralForCausalLM without a sliding window, the same model under another name) and Megatron-DeepSpeed's
flags that turn a GPT into one."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.families.family import Family, Flag, HFMapping, Preset, Tensor, require, size
from jax3d.models.families.gpt import variant
from jax3d.models.gpt import GPT

# What every Llama shares: RMSNorm, SwiGLU, rotary positions, no biases, no dropout.
_BLOCK = dict(normalization="rmsnorm", swiglu=True, add_bias_linear=False, use_rotary_position_embeddings=True,
              hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5)
_LLAMA3_2_ROPE = dict(rope_theta=500000.0, rope_scaling="llama3", rope_scaling_factor=32.0, rope_low_freq_factor=1.0,
                      rope_high_freq_factor=4.0, rope_original_max_position_embeddings=8192,
                      max_position_embeddings=131072, vocab_size=128256)
_UNTIED = dict(untie_embeddings_and_output_weights=True)
# name: (layers, hidden, heads, KV heads, FFN, training sequence, micro batch, global batch, other fields)
_SHAPES = {
    "llama-tiny": (4, 128, 8, 4, 0, 128, 4, 32, dict(vocab_size=4096, **_UNTIED)),  # FFN: Megatron's SwiGLU default
    "llama3.2-1b": (16, 2048, 32, 8, 8192, 8192, 1, 512, _LLAMA3_2_ROPE),
    "llama3.2-3b": (28, 3072, 24, 8, 8192, 8192, 1, 512, _LLAMA3_2_ROPE),
    "llama3-8b": (32, 4096, 32, 8, 14336, 8192, 1, 512, dict(rope_theta=500000.0, vocab_size=128256, **_UNTIED)),
    "llama2-7b": (32, 4096, 32, 32, 11008, 4096, 1, 1024, dict(vocab_size=32000, **_UNTIED)),
    "llama2-13b": (40, 5120, 40, 40, 13824, 4096, 1, 1024, dict(vocab_size=32000, **_UNTIED)),
}
PRESETS = {name: Preset(ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                    num_key_value_heads=kv, ffn_hidden_size=ffn, seq_length=seq,
                                    **{"max_position_embeddings": seq, **_BLOCK, **other}), micro, global_)
           for name, (layers, hidden, heads, kv, ffn, seq, micro, global_, other) in _SHAPES.items()}


def claims(cfg: ModelConfig) -> bool:
    """Whether a jax3d GPT uses a variant GPT-2 lacks, so that HF's Llama (not GPT-2) is its class."""
    return cfg.model_type == "gpt" and variant(cfg) is not None


# --- Hugging Face ---

# What an HF Llama needs of the ModelConfig fields.
HF_FIELDS = {"normalization": "rmsnorm", "swiglu": True, "use_rotary_position_embeddings": True,
             "rotary_percent": 1.0, "post_layernorm": False, "embedding_layernorm": False}


def _fields(hf: dict, arch: str) -> dict:
    """ModelConfig fields of a Llama / Mistral config.json (v4's rope_theta and rope_scaling, or v5's
    rope_parameters); ConfigError naming the first field jax3d's model cannot reproduce."""
    d, n = size(hf, "hidden_size"), size(hf, "num_attention_heads")
    kv = size(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else n
    # A head_dim other than hidden / heads is Megatron's --kv-channels (jax3d's export writes it so).
    head_dim = {"kv_channels": size(hf, "head_dim")} if hf.get("head_dim") not in (None, d // n) else {}
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"config.json sliding_window {hf['sliding_window']} limits attention to a window, which "
                          "jax3d does not build; only models with sliding_window null import")
    biases = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if biases[0] != biases[1]:
        raise ConfigError(f"config.json attention_bias {str(biases[0]).lower()} with mlp_bias {str(biases[1]).lower()} "
                          "is not supported; jax3d has biases on all its linear layers or on none")
    require(hf, "hidden_act", "silu", "silu")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"config.json partial_rotary_factor {hf['partial_rotary_factor']} is not supported by "
                          "HF's Llama; jax3d imports 1.0")
    scaling_v4 = hf.get("rope_scaling") or {}
    rope = {**(hf.get("rope_parameters") or {}), **scaling_v4}
    kind = next((r[k] for r in (scaling_v4, rope) for k in ("rope_type", "type") if r.get(k)), "default")
    scaling = {}
    if kind == "linear":
        scaling = dict(rope_scaling="linear", rope_scaling_factor=float(rope["factor"]))
    elif kind == "llama3":
        scaling = dict(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                       rope_low_freq_factor=float(rope["low_freq_factor"]),
                       rope_high_freq_factor=float(rope["high_freq_factor"]),
                       rope_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif kind != "default":
        raise ConfigError(f"config.json rope_scaling type {kind!r} is not built in jax3d, which reproduces "
                          "llama3 and linear rope scaling (or none)")
    pos = size(hf, "max_position_embeddings")
    fields = dict(model_type="gpt", num_layers=size(hf, "num_hidden_layers"),
                  ffn_hidden_size=size(hf, "intermediate_size"),
                  num_key_value_heads=0 if kv == n else kv, max_position_embeddings=pos, seq_length=min(pos, 4096),
                  layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), hidden_dropout=0.0,
                  attention_dropout=hf.get("attention_dropout", 0.0), init_method_std=hf.get("initializer_range", 0.02),
                  rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                  untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                  add_bias_linear=bool(hf.get("attention_bias", False)), add_position_embedding=False,
                  **{k: v for k, v in HF_FIELDS.items() if k != "rotary_percent"}, **scaling, **head_dim)
    return dict(hidden_size=d, num_attention_heads=n, vocab_size=size(hf, "vocab_size"), **fields)


def _config(cfg: ModelConfig, vocab: int) -> dict:
    """config.json of the LlamaForCausalLM that computes what `cfg` computes (v4's keys, which v5 reads too)."""
    for field, want in HF_FIELDS.items():
        if getattr(cfg, field) != want:
            raise ConfigError(f"HF Llama cannot express a GPT with {field}={getattr(cfg, field)!r} (it needs {want!r}); "
                              "export it as jax3d safetensors with launch/export.py instead")
    scaling = None
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    elif cfg.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                   "high_freq_factor": cfg.rope_high_freq_factor,
                   "original_max_position_embeddings": cfg.rope_original_max_position_embeddings}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
            "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.layernorm_epsilon, "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
            "vocab_size": vocab, "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
            "attention_bias": cfg.add_bias_linear, "mlp_bias": cfg.add_bias_linear,
            "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "pretraining_tp": 1, "use_cache": True}


def table(cfg: ModelConfig) -> list[Tensor]:
    """A Llama's tensors. jax3d's QKV kernel is (embed, g + 2, kv_heads, head_dim), g query heads per KV head:
    `k_proj` and `v_proj` are slices g and g + 1, and `q_proj`'s rows, (kv_heads, g, head_dim) in HF's order, are
    slices 0 .. g - 1 with their first two axes swapped. The SwiGLU up kernel holds gate and up as slices 0 and 1."""
    h, g = "model.layers.{i}.", cfg.num_attention_heads // cfg.kv_heads
    t = [Tensor("embed.word", "model.embed_tokens.weight", vocab=True), Tensor("final_norm.scale", "model.norm.weight"),
         Tensor("blocks.ln_attn.scale", h + "input_layernorm.weight"),
         Tensor("blocks.ln_mlp.scale", h + "post_attention_layernorm.weight")]
    if cfg.untie_embeddings_and_output_weights:
        t.append(Tensor("head.output", "lm_head.weight", vocab=True))
    kinds = [("weight", "kernel", True)] + ([("bias", "bias", False)] if cfg.add_bias_linear else [])
    for hf_kind, kind, linear in kinds:
        axis = 1 if linear else 0  # of the q/k/v (and gate/up) dim
        t += [Tensor(f"blocks.attn.qkv_{kind}", h + f"self_attn.q_proj.{hf_kind}", linear=linear,
                     part=(axis, slice(0, g)), query_groups=True),
              Tensor(f"blocks.attn.qkv_{kind}", h + f"self_attn.k_proj.{hf_kind}", linear=linear, part=(axis, g)),
              Tensor(f"blocks.attn.qkv_{kind}", h + f"self_attn.v_proj.{hf_kind}", linear=linear, part=(axis, g + 1)),
              Tensor(f"blocks.attn.out_{kind}", h + f"self_attn.o_proj.{hf_kind}", split=2, linear=linear),
              Tensor(f"blocks.mlp.up_{kind}", h + f"mlp.gate_proj.{hf_kind}", linear=linear, part=(axis, 0)),
              Tensor(f"blocks.mlp.up_{kind}", h + f"mlp.up_proj.{hf_kind}", linear=linear, part=(axis, 1)),
              Tensor(f"blocks.mlp.down_{kind}", h + f"mlp.down_proj.{hf_kind}", linear=linear)]
    return t


# --- command line ---

# Megatron-DeepSpeed's flags that make a GPT a Llama; their dests are ModelConfig's field names, and each
# defaults to the preset's value (None: not given).
FLAGS = (
    Flag(("--normalization",), dict(type=str.lower, choices=["layernorm", "rmsnorm"], default=None,
                                    help="layernorm, or rmsnorm (a scale, no centring or bias) (default: the preset's)")),
    Flag(("--swiglu",), dict(action="store_const", const=True, default=None,
                             help="gated SiLU MLP instead of GELU (default: the preset's, off for GPT)")),
    # Megatron's default (as many as --num-attention-heads when that is given) is the command line's rule.
    Flag(("--num-key-value-heads",), dict(type=int, default=None,
                                          help="key/value heads of grouped-query attention, dividing "
                                               "--num-attention-heads; 1 is multi-query (default: "
                                               "--num-attention-heads when that is given, else the preset's)"),
         field=False),
    Flag(("--use-rotary-position-embeddings",), dict(action="store_const", const=True, default=None,
                                                     help="rotary position embeddings, which replace learned ones "
                                                          "(default: the preset's, off for GPT)")),
    Flag(("--rotary-position-embeddings-theta",), dict(type=float, default=None, dest="rope_theta",
                                                       help="rotary base theta (default: the preset's, 10000 for GPT)")),
    Flag(("--rotary-percent",), dict(type=float, default=None,
                                     help="share of each head's dims that rotate (default: the preset's, 1.0)")),
    Flag(("--no-position-embedding",), dict(action="store_const", const=False, default=None,
                                            dest="add_position_embedding",
                                            help="no learned position embeddings (default: the preset's, learned "
                                                 "ones for GPT and BERT)")),
    Flag(("--untie-embeddings-and-output-weights",), dict(action="store_const", const=True, default=None,
                                                          help="an output layer of its own instead of the word "
                                                               "embedding (default: the preset's, tied for GPT)")),
    Flag(("--disable-bias-linear",), dict(action="store_const", const=False, default=None, dest="add_bias_linear",
                                          help="no biases in the attention and MLP linears (default: the preset's, "
                                               "biases for GPT and BERT)")),
)


FAMILY = Family(
    name="llama", model_type="gpt", model=GPT, presets=PRESETS, default_preset="llama-tiny", claims=claims,
    hf=HFMapping(architectures=("LlamaForCausalLM", "MistralForCausalLM"),
                 by_model_type={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
                 fields=_fields, config=_config, table=table,
                 ignored=("rotary_emb.inv_freq",)),  # a buffer of the rotary embedding
    flag_group="architecture variants (Megatron-DeepSpeed's LLaMA flags; each defaults to the preset's, GPT-2's "
               "for gpt-* and bert-*)",
    flags=FLAGS)
