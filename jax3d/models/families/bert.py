"""The BERT family: bidirectional blocks with Megatron's heads, its presets and its Hugging Face mapping
(BertForPreTraining / BertForMaskedLM, post-LN; MegatronBertForPreTraining, pre-LN)."""
from __future__ import annotations

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.bert import BERT
from jax3d.models.families.family import Family, HFMapping, Tensor, activation, gelu_name, ln, require, size
from jax3d.models.families.gpt import shape_presets, variant

# name: (layers, hidden, heads, seq, vocab, micro batch, global batch)
_SHAPES = {
    "bert-tiny": (2, 128, 8, 128, 4096, 4, 32),
    "bert-base": (12, 768, 12, 512, 30592, 4, 256),
    "bert-large": (24, 1024, 16, 512, 30592, 4, 256),
    "bert-336m": (24, 1024, 16, 512, 30592, 4, 256),
    "bert-1.3b": (24, 2048, 32, 512, 30592, 4, 512),
    "bert-3.9b": (48, 2560, 40, 512, 30592, 2, 512),
}

POST_LN_ARCHS = ("BertForPreTraining", "BertForMaskedLM")
PRE_LN_ARCHS = ("MegatronBertForPreTraining",)


def _fields(hf: dict, arch: str) -> dict:
    require(hf, "position_embedding_type", "absolute", "absolute")
    require(hf, "is_decoder", False, False)
    d, n, v = size(hf, "hidden_size"), size(hf, "num_attention_heads"), size(hf, "vocab_size")
    pos, post = size(hf, "max_position_embeddings"), arch in POST_LN_ARCHS
    return dict(hidden_size=d, num_attention_heads=n, vocab_size=v,
                model_type="bert", num_layers=size(hf, "num_hidden_layers"),
                ffn_hidden_size=size(hf, "intermediate_size"), max_position_embeddings=pos, seq_length=min(pos, 512),
                layernorm_epsilon=hf.get("layer_norm_eps", 1e-12), activation=activation(hf, "hidden_act"),
                num_tokentypes=hf.get("type_vocab_size", 2), post_layernorm=post, embedding_layernorm=post,
                hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
                attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
                init_method_std=hf.get("initializer_range", 0.02))


def _config(cfg: ModelConfig, vocab: int) -> dict:
    act = gelu_name(cfg, "BERT")
    if variant(cfg):
        raise ConfigError(f"HF BERT cannot express a BERT with {variant(cfg)}={getattr(cfg, variant(cfg))!r}; "
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
            "position_embedding_type": "absolute", "tie_word_embeddings": True, "pad_token_id": 0}


def table(cfg: ModelConfig) -> list[Tensor]:
    """BERT's tensors: its separate query / key / value `Linear`s (stored out x in) are the three slices of
    jax3d's fused QKV kernel (embed, 3, heads, head_dim), transposed."""
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
          *ln("head.mlm_norm", "cls.predictions.transform.LayerNorm"),
          Tensor("head.mlm_bias", "cls.predictions.bias", vocab=True),
          Tensor("head.pooler", "bert.pooler.dense.weight", linear=True, optional=True),
          Tensor("head.pooler_bias", "bert.pooler.dense.bias", optional=True),
          Tensor("head.binary", "cls.seq_relationship.weight", linear=True, optional=True),
          Tensor("head.binary_bias", "cls.seq_relationship.bias", optional=True)]
    if cfg.post_layernorm:
        t += [*ln("embed.norm", "bert.embeddings.LayerNorm"),
              *ln("blocks.ln_attn", h + "attention.output.LayerNorm"), *ln("blocks.ln_mlp", h + "output.LayerNorm")]
    else:
        t += [*ln("blocks.ln_attn", h + "attention.ln"), *ln("blocks.ln_mlp", h + "ln"),
              *ln("final_norm", "bert.encoder.ln")]
    return t


FAMILY = Family(
    name="bert", model_type="bert", model=BERT, presets=shape_presets("bert", _SHAPES), default_preset="bert-tiny",
    hf=HFMapping(architectures=POST_LN_ARCHS + PRE_LN_ARCHS,
                 by_model_type={"bert": "BertForPreTraining", "megatron-bert": "MegatronBertForPreTraining"},
                 fields=_fields, config=_config, table=table,
                 # the tied MLM decoder; the position-id buffer
                 ignored=("cls.predictions.decoder.weight", "cls.predictions.decoder.bias", "embeddings.position_ids")))
