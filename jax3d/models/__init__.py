"""GPT and BERT on shared, logically-annotated Flax layers."""
from jax3d.config import ModelConfig
from jax3d.kernels.policy import KernelPolicy
from jax3d.models.families import model_class
from jax3d.models.gpt import GPT
from jax3d.models.layers import MLP, Attention, Block, Embedding, LayerNorm
from jax3d.models.presets import get_preset, preset_names
from jax3d.models.transformer import TransformerLM


def build_model(cfg: ModelConfig, rules=None, *, kernels: KernelPolicy | None = None,
                fp8: str = "") -> TransformerLM:
    """The model class of `cfg.model_type`'s family (jax3d.models.families): GPT (Llama included) or BERT.
    `rules` (a ShardingRules) places its activations on the mesh in context; None: no constraints, plain
    single-device code. `kernels` (the run's KernelPolicy) and `fp8` (an FP8 recipe's format: the train step's
    copy of the model, whose GEMMs take scales) choose its blocks' parts (jax3d.models.spec)."""
    return model_class(cfg.model_type)(cfg, rules, kernels=kernels, fp8=fp8)


__all__ = ["GPT", "Block", "Attention", "MLP", "Embedding", "LayerNorm", "TransformerLM", "build_model",
           "get_preset", "preset_names"]
