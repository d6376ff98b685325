"""Hugging Face GPT-2 / BERT / Llama <-> jax3d: model configs both ways and the tensor-by-tensor name table.

Pure numpy: nothing here imports torch or transformers. jax3d keeps transformer blocks stacked on a
leading layers dim; HF names each layer (`h.{i}`). jax3d's fused QKV kernel is (embed, 3, heads,
head_dim): GPT-2's `c_attn.weight` (embed, 3 * embed) is the same array reshaped, and BERT's separate
query / key / value `Linear`s (stored out x in) are its three slices, transposed. A Llama's kernel is
(embed, g + 2, kv_heads, head_dim), g query heads per KV head: `k_proj` and `v_proj` are slices g and g + 1,
and `q_proj`'s rows, (kv_heads, g, head_dim) in HF's order, are slices 0 .. g - 1 with their first two axes
swapped. Mistral without a sliding window is the same model under another name.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jax3d.config import ConfigError, ModelConfig

GPT2_ARCHS = ("GPT2LMHeadModel",)
POST_LN_BERT_ARCHS = ("BertForPreTraining", "BertForMaskedLM")
PRE_LN_BERT_ARCHS = ("MegatronBertForPreTraining",)
LLAMA_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")
SUPPORTED = GPT2_ARCHS + POST_LN_BERT_ARCHS + PRE_LN_BERT_ARCHS + LLAMA_ARCHS
# The ModelConfig fields of GPT-2 (the defaults) and what an HF Llama needs of them.
GPT2_FIELDS = {"normalization": "layernorm", "swiglu": False, "add_position_embedding": True,
               "use_rotary_position_embeddings": False, "add_bias_linear": True,
               "untie_embeddings_and_output_weights": False}
LLAMA_FIELDS = {"normalization": "rmsnorm", "swiglu": True, "use_rotary_position_embeddings": True,
                "rotary_percent": 1.0, "post_layernorm": False, "embedding_layernorm": False}

_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def padded(vocab: int, divisible_by: int) -> int:
    return -(-vocab // divisible_by) * divisible_by


def architecture(hf: dict) -> str:
    """The one supported architecture named in config.json; ConfigError otherwise."""
    archs = hf.get("architectures") or []
    if not archs:
        by_type = {"gpt2": "GPT2LMHeadModel", "bert": "BertForPreTraining", "megatron-bert": "MegatronBertForPreTraining",
                   "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
    for a in archs:
        if a in SUPPORTED:
            return a
    raise ConfigError(f"config.json names architecture {archs or hf.get('model_type')!r}, which jax3d cannot import; "
                      f"it reads {', '.join(SUPPORTED)}")


def _activation(hf: dict, key: str) -> str:
    act = hf.get(key, "gelu_new" if key == "activation_function" else "gelu")
    if act in _TANH_GELUS:
        return "gelu_tanh"
    if act == "gelu":
        return "gelu_erf"
    raise ConfigError(f"config.json {key} {act!r} is not supported; jax3d has the tanh GELU (gelu_new) and the "
                      "erf GELU (gelu)")


def _require(hf: dict, key: str, want, default) -> None:
    if hf.get(key, default) != want:
        raise ConfigError(f"config.json {key} {hf.get(key)!r} is not supported by jax3d's model; it needs {want!r}")


def _size(hf: dict, key: str) -> int:
    """config.json's `key` as a size: a whole number of at least 1 (KeyError when it is missing)."""
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json gives {key} {value!r}; it must be a whole number of at least 1")
    return value


def model_config_from_hf(hf: dict, divisible_by: int = 128) -> ModelConfig:
    """The jax3d ModelConfig that reproduces the HF model of config.json `hf` exactly.

    The vocabulary is padded to a multiple of `divisible_by` (tensor parallelism shards it); the
    padding rows are zero and `unpadded_vocab_size` keeps the real size.
    """
    arch = architecture(hf)
    if arch in LLAMA_ARCHS:
        kw = _llama_fields(hf)
        d, n, v = _size(hf, "hidden_size"), _size(hf, "num_attention_heads"), _size(hf, "vocab_size")
    elif arch in GPT2_ARCHS:
        for key, want, default in [("scale_attn_weights", True, True), ("scale_attn_by_inverse_layer_idx", False, False),
                                   ("add_cross_attention", False, False), ("tie_word_embeddings", True, True)]:
            _require(hf, key, want, default)
        d, n, v, pos = _size(hf, "n_embd"), _size(hf, "n_head"), _size(hf, "vocab_size"), _size(hf, "n_positions")
        ffn = _size(hf, "n_inner") if hf.get("n_inner") is not None else 4 * d
        kw = dict(model_type="gpt", num_layers=_size(hf, "n_layer"), ffn_hidden_size=ffn,
                  max_position_embeddings=pos, seq_length=pos,
                  layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5), activation=_activation(hf, "activation_function"),
                  hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
                  init_method_std=hf.get("initializer_range", 0.02))
    else:
        _require(hf, "position_embedding_type", "absolute", "absolute")
        _require(hf, "is_decoder", False, False)
        d, n, v = _size(hf, "hidden_size"), _size(hf, "num_attention_heads"), _size(hf, "vocab_size")
        pos, post = _size(hf, "max_position_embeddings"), arch in POST_LN_BERT_ARCHS
        kw = dict(model_type="bert", num_layers=_size(hf, "num_hidden_layers"),
                  ffn_hidden_size=_size(hf, "intermediate_size"), max_position_embeddings=pos, seq_length=min(pos, 512),
                  layernorm_epsilon=hf.get("layer_norm_eps", 1e-12), activation=_activation(hf, "hidden_act"),
                  num_tokentypes=hf.get("type_vocab_size", 2), post_layernorm=post, embedding_layernorm=post,
                  hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                  attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                  init_method_std=hf.get("initializer_range", 0.02))
    if d % n:
        raise ConfigError(f"config.json hidden size {d} is not divisible by its {n} attention heads")
    return ModelConfig(hidden_size=d, num_attention_heads=n, vocab_size=padded(v, divisible_by),
                       unpadded_vocab_size=v, **kw)


def _llama_fields(hf: dict) -> dict:
    """ModelConfig fields of a Llama / Mistral config.json (v4's rope_theta and rope_scaling, or v5's
    rope_parameters); ConfigError naming the first field jax3d's model cannot reproduce."""
    d, n = _size(hf, "hidden_size"), _size(hf, "num_attention_heads")
    kv = _size(hf, "num_key_value_heads") if hf.get("num_key_value_heads") is not None else n
    # A head_dim other than hidden / heads is Megatron's --kv-channels (jax3d's export writes it so).
    head_dim = {"kv_channels": _size(hf, "head_dim")} if hf.get("head_dim") not in (None, d // n) else {}
    if hf.get("sliding_window") is not None:
        raise ConfigError(f"config.json sliding_window {hf['sliding_window']} limits attention to a window, which "
                          "jax3d does not build; only models with sliding_window null import")
    biases = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if biases[0] != biases[1]:
        raise ConfigError(f"config.json attention_bias {str(biases[0]).lower()} with mlp_bias {str(biases[1]).lower()} "
                          "is not supported; jax3d has biases on all its linear layers or on none")
    _require(hf, "hidden_act", "silu", "silu")
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
    pos = _size(hf, "max_position_embeddings")
    return dict(model_type="gpt", num_layers=_size(hf, "num_hidden_layers"), ffn_hidden_size=_size(hf, "intermediate_size"),
                num_key_value_heads=0 if kv == n else kv, max_position_embeddings=pos, seq_length=min(pos, 4096),
                layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), hidden_dropout=0.0,
                attention_dropout=hf.get("attention_dropout", 0.0), init_method_std=hf.get("initializer_range", 0.02),
                rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                add_bias_linear=bool(hf.get("attention_bias", False)), add_position_embedding=False,
                **{k: v for k, v in LLAMA_FIELDS.items() if k != "rotary_percent"}, **scaling, **head_dim)


def _variant(cfg: ModelConfig) -> str | None:
    """The first field in which `cfg` is not GPT-2's block (grouped-query attention included), or None."""
    if cfg.kv_heads != cfg.num_attention_heads:
        return "num_key_value_heads"
    return next((k for k, v in GPT2_FIELDS.items() if getattr(cfg, k) != v), None)


def is_llama(cfg: ModelConfig) -> bool:
    """Whether a jax3d GPT uses a variant GPT-2 lacks, so that HF's Llama (not GPT-2) is its class."""
    return cfg.model_type == "gpt" and _variant(cfg) is not None


def _llama_config(cfg: ModelConfig, vocab: int) -> dict:
    """config.json of the LlamaForCausalLM that computes what `cfg` computes (v4's keys, which v5 reads too)."""
    for field, want in LLAMA_FIELDS.items():
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


def hf_config_from_model(cfg: ModelConfig, token_ids: dict[str, int] | None = None) -> dict:
    """config.json for the HF class that computes what jax3d model `cfg` computes, with the tokenizer's
    `token_ids` (`bos_token_id`, ...; without them transformers assumes GPT-2's 50256, which a smaller
    vocabulary lacks, and generate never stops); ConfigError naming the field when no HF GPT-2 / BERT class
    can express it."""
    token_ids = token_ids or {}
    vocab = cfg.unpadded_vocab_size or cfg.vocab_size
    if is_llama(cfg):
        return {**_llama_config(cfg, vocab), **token_ids}
    name = "GPT-2" if cfg.model_type == "gpt" else "BERT"
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ConfigError(f"HF {name} cannot express --kv-channels {cfg.kv_channels} (its heads are hidden_size / "
                          "num_attention_heads wide); export it as jax3d safetensors with launch/export.py instead")
    if cfg.activation not in ("gelu_tanh", "gelu_erf"):
        raise ConfigError(f"HF {name} cannot express activation {cfg.activation} (--squared-relu) in jax3d's "
                          "export; export it as jax3d safetensors with launch/export.py instead")
    act = {"gelu_tanh": "gelu_new", "gelu_erf": "gelu"}[cfg.activation]
    if cfg.model_type == "gpt":
        for field in ("post_layernorm", "embedding_layernorm"):
            if getattr(cfg, field):
                raise ConfigError(f"HF GPT-2 cannot express a GPT with {field}=True; export it as jax3d safetensors "
                                  "with launch/export.py instead")
        out = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": cfg.num_layers,
               "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_hidden_size,
               "n_positions": cfg.max_position_embeddings, "vocab_size": vocab,
               "layer_norm_epsilon": cfg.layernorm_epsilon, "activation_function": act,
               "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout,
               "attn_pdrop": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
               "scale_attn_weights": True, "tie_word_embeddings": True, "use_cache": True}
        return {**out, **token_ids}
    if _variant(cfg):
        raise ConfigError(f"HF BERT cannot express a BERT with {_variant(cfg)}={getattr(cfg, _variant(cfg))!r}; "
                          "export it as jax3d safetensors with launch/export.py instead")
    if cfg.post_layernorm != cfg.embedding_layernorm:
        raise ConfigError(f"HF BERT cannot express post_layernorm={cfg.post_layernorm} with embedding_layernorm="
                          f"{cfg.embedding_layernorm}; BertForPreTraining has both, MegatronBertForPreTraining neither")
    post = cfg.post_layernorm
    return {"architectures": ["BertForPreTraining" if post else "MegatronBertForPreTraining"],
            "model_type": "bert" if post else "megatron-bert", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.ffn_hidden_size, "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": vocab, "type_vocab_size": cfg.num_tokentypes, "layer_norm_eps": cfg.layernorm_epsilon,
            "hidden_act": act, "hidden_dropout_prob": cfg.hidden_dropout,
            "attention_probs_dropout_prob": cfg.attention_dropout, "initializer_range": cfg.init_method_std,
            "position_embedding_type": "absolute", "tie_word_embeddings": True, "pad_token_id": 0, **token_ids}


@dataclass(frozen=True)
class Tensor:
    """One HF tensor and where it lives in jax3d's tree.

    ours: dotted path (under `blocks` a per-layer slice of the stack); hf: name, `{i}` the layer;
    split: how many leading dims of ours make HF's input dim; linear: HF stores it (out, in);
    part: (axis, index) of the q/k/v dim of a fused jax3d tensor, or (axis, slice) of a Llama's query heads;
    query_groups: that slice's axis and the next (g, kv_heads) are HF's (kv_heads, g); vocab: rows are the
    vocabulary.
    """

    ours: str
    hf: str
    split: int = 1
    linear: bool = False
    part: tuple[int, int | slice] | None = None
    vocab: bool = False
    optional: bool = False  # absent from some HF classes (BertForMaskedLM has no pooler / NSP head)
    query_groups: bool = False


def _ln(ours: str, hf: str) -> list[Tensor]:
    return [Tensor(f"{ours}.scale", f"{hf}.weight"), Tensor(f"{ours}.bias", f"{hf}.bias")]


def gpt2_table() -> list[Tensor]:
    h = "transformer.h.{i}."
    return [Tensor("embed.word", "transformer.wte.weight", vocab=True),
            Tensor("embed.position", "transformer.wpe.weight"),
            *_ln("final_norm", "transformer.ln_f"),
            *_ln("blocks.ln_attn", h + "ln_1"), *_ln("blocks.ln_mlp", h + "ln_2"),
            Tensor("blocks.attn.qkv_kernel", h + "attn.c_attn.weight"),
            Tensor("blocks.attn.qkv_bias", h + "attn.c_attn.bias"),
            Tensor("blocks.attn.out_kernel", h + "attn.c_proj.weight", split=2),
            Tensor("blocks.attn.out_bias", h + "attn.c_proj.bias"),
            Tensor("blocks.mlp.up_kernel", h + "mlp.c_fc.weight"), Tensor("blocks.mlp.up_bias", h + "mlp.c_fc.bias"),
            Tensor("blocks.mlp.down_kernel", h + "mlp.c_proj.weight"),
            Tensor("blocks.mlp.down_bias", h + "mlp.c_proj.bias")]


def bert_table(post_layernorm: bool) -> list[Tensor]:
    h = "bert.encoder.layer.{i}."
    t = [Tensor("embed.word", "bert.embeddings.word_embeddings.weight", vocab=True),
         Tensor("embed.position", "bert.embeddings.position_embeddings.weight"),
         Tensor("embed.tokentype", "bert.embeddings.token_type_embeddings.weight")]
    for c, name in enumerate(("query", "key", "value")):
        t += [Tensor("blocks.attn.qkv_kernel", h + f"attention.self.{name}.weight", linear=True, part=(1, c)),
              Tensor("blocks.attn.qkv_bias", h + f"attention.self.{name}.bias", part=(0, c))]
    t += [Tensor("blocks.attn.out_kernel", h + "attention.output.dense.weight", split=2, linear=True),
          Tensor("blocks.attn.out_bias", h + "attention.output.dense.bias"),
          Tensor("blocks.mlp.up_kernel", h + "intermediate.dense.weight", linear=True),
          Tensor("blocks.mlp.up_bias", h + "intermediate.dense.bias"),
          Tensor("blocks.mlp.down_kernel", h + "output.dense.weight", linear=True),
          Tensor("blocks.mlp.down_bias", h + "output.dense.bias"),
          Tensor("head.mlm_dense", "cls.predictions.transform.dense.weight", linear=True),
          Tensor("head.mlm_dense_bias", "cls.predictions.transform.dense.bias"),
          *_ln("head.mlm_norm", "cls.predictions.transform.LayerNorm"),
          Tensor("head.mlm_bias", "cls.predictions.bias", vocab=True),
          Tensor("head.pooler", "bert.pooler.dense.weight", linear=True, optional=True),
          Tensor("head.pooler_bias", "bert.pooler.dense.bias", optional=True),
          Tensor("head.binary", "cls.seq_relationship.weight", linear=True, optional=True),
          Tensor("head.binary_bias", "cls.seq_relationship.bias", optional=True)]
    if post_layernorm:
        t += [*_ln("embed.norm", "bert.embeddings.LayerNorm"),
              *_ln("blocks.ln_attn", h + "attention.output.LayerNorm"), *_ln("blocks.ln_mlp", h + "output.LayerNorm")]
    else:
        t += [*_ln("blocks.ln_attn", h + "attention.ln"), *_ln("blocks.ln_mlp", h + "ln"),
              *_ln("final_norm", "bert.encoder.ln")]
    return t


def llama_table(cfg: ModelConfig) -> list[Tensor]:
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


def table(cfg: ModelConfig) -> list[Tensor]:
    if is_llama(cfg):
        return llama_table(cfg)
    return gpt2_table() if cfg.model_type == "gpt" else bert_table(cfg.post_layernorm)


# jax3d's layer-norm scales that --apply-layernorm-1p stores as offsets from 1 (layers.norm_for): HF gets 1 + w.
ONE_PLUS_SCALES = ("blocks.ln_attn.scale", "blocks.ln_mlp.scale", "final_norm.scale")


# HF tensors that duplicate a tied one or are buffers, never parameters of their own.
IGNORED_SUFFIXES = ("lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias",
                    "rotary_emb.inv_freq",
                    ".attn.bias", ".attn.masked_bias", "embeddings.position_ids")


def _get(tree: dict, path: str):
    for k in path.split("."):
        tree = tree[k]
    return tree


def _hf_of(ours: np.ndarray, t: Tensor, vocab: int) -> np.ndarray:
    """HF's array of one jax3d slice (no layers dim)."""
    if t.part is not None:
        ours = ours[_index(t, ours.ndim)]
    if t.query_groups:
        ours = np.swapaxes(ours, t.part[0], t.part[0] + 1)
    if t.vocab:
        ours = ours[:vocab]
    if t.hf.endswith(".bias") or t.ours.endswith(".scale"):  # biases and layer-norm scales are flat
        return np.ascontiguousarray(ours.reshape(-1))
    out = ours.reshape(int(np.prod(ours.shape[:t.split])), -1)
    return np.ascontiguousarray(out.T if t.linear else out)


def to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """{HF name: fp32 array} of a jax3d parameter tree (numpy), padding rows of the vocabulary dropped."""
    vocab = cfg.unpadded_vocab_size or cfg.vocab_size
    out = {}
    for t in table(cfg):
        arr = np.asarray(_get(params, t.ours), np.float32)
        if t.ours in ONE_PLUS_SCALES and cfg.one_plus_norms:  # --apply-layernorm-1p stores scale - 1
            arr = arr + np.float32(1.0)
        if t.ours.startswith("blocks."):
            for i in range(cfg.num_layers):
                out[t.hf.format(i=i)] = _hf_of(arr[i], t, vocab)
        else:
            out[t.hf] = _hf_of(arr, t, vocab)
    return out


def _index(t: Tensor, ndim: int) -> tuple:
    """The index of `t.part` into an array of `ndim` dims."""
    idx = [slice(None)] * ndim
    idx[t.part[0]] = t.part[1]
    return tuple(idx)


def _strip_prefix(name: str, cfg: ModelConfig) -> str:
    """HF names as the LM-head classes save them (some GPT-2 files lack the `transformer.` prefix)."""
    if cfg.model_type == "gpt" and not is_llama(cfg) and not name.startswith(("transformer.", "lm_head")):
        return "transformer." + name
    return name


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, into: dict) -> dict:
    """Fills the numpy tree `into` (jax3d's shapes, e.g. a fresh init) from HF tensors; ConfigError on a
    missing, unexpected or misshapen tensor. Vocabulary padding rows are zero."""
    tensors = {_strip_prefix(k, cfg): v for k, v in tensors.items()}
    used = set()
    for t in table(cfg):
        dest = _get(into, t.ours)
        layers = range(cfg.num_layers) if t.ours.startswith("blocks.") else [None]
        for i in layers:
            name = t.hf.format(i=i)
            if name not in tensors:
                if t.optional:
                    continue
                raise ConfigError(f"the model files lack tensor {name}; the folder does not hold a complete "
                                  "model of its config.json architecture")
            used.add(name)
            slot = dest if i is None else dest[i]
            want = list(slot[_index(t, slot.ndim)].shape if t.part is not None else slot.shape)
            if t.query_groups:  # HF's order of the two axes
                a = t.part[0]
                want[a], want[a + 1] = want[a + 1], want[a]
            x = np.asarray(tensors[name], np.float32)
            x = x.T if t.linear else x
            if t.vocab:
                want_rows = cfg.unpadded_vocab_size or cfg.vocab_size
                if x.shape[0] != want_rows:
                    raise ConfigError(f"tensor {name} has {x.shape[0]} rows but config.json vocab_size is {want_rows}")
                x = np.concatenate([x, np.zeros((want[0] - x.shape[0], *x.shape[1:]), np.float32)])
            if x.size != int(np.prod(want)):
                raise ConfigError(f"tensor {name} has shape {tuple(tensors[name].shape)}, which does not fit "
                                  f"config.json (jax3d expects {tuple(want)} elements)")
            x = x.reshape(want)
            if t.query_groups:
                x = np.swapaxes(x, t.part[0], t.part[0] + 1)
            if t.part is None:
                slot[...] = x
            else:
                slot[_index(t, slot.ndim)] = x
    extra = sorted(k for k in tensors if k not in used and not k.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ConfigError(f"the model files hold tensor {extra[0]}, which config.json's architecture has no place "
                          f"for ({len(extra)} such); is config.json from another model?")
    return into
