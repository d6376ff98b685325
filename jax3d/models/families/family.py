"""What one model family declares: its presets, its Hugging Face mapping, its command-line flags and its model
class (`Family`), and the parts the Hugging Face mappings share (`Tensor`, the config.json readers).

Pure numpy and the config: the tensor tables and config.json rules are data the families own; `jax3d.hf.mapping`
runs them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from jax3d.config import ConfigError, ModelConfig


class Preset(NamedTuple):
    """A named shape: the model and its default batch sizes."""

    model: ModelConfig
    micro_batch_size: int
    global_batch_size: int


@dataclass(frozen=True)
class Flag:
    """One command-line flag of a family's group: its names and the keywords jax3d.cli's parser declares it with.
    Its dest is a ModelConfig field that the flag overrides when given (`field`); a flag the command line reads by
    a rule of its own (Megatron's default of `--num-key-value-heads`) has `field=False`."""

    names: tuple[str, ...]
    kwargs: Mapping
    field: bool = True

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.names[0].lstrip("-").replace("-", "_")


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


@dataclass(frozen=True)
class HFMapping:
    """A family's Hugging Face side.

    architectures: the config.json `architectures` it imports; by_model_type: config.json `model_type` ->
    architecture, for files without `architectures`; fields: (config.json, architecture) -> ModelConfig fields,
    `vocab_size` unpadded (the importer pads it); config: (cfg, unpadded vocab) -> config.json, ConfigError
    naming the field HF's class cannot express; table: cfg -> its tensors; ignored: suffixes of HF tensors that
    are no parameters (tied copies, buffers); hf_name: a saved tensor's name as the table spells it.
    """

    architectures: tuple[str, ...]
    by_model_type: Mapping[str, str]
    fields: Callable[[dict, str], dict]
    config: Callable[[ModelConfig, int], dict]
    table: Callable[[ModelConfig], list[Tensor]]
    ignored: tuple[str, ...] = ()
    hf_name: Callable[[str], str] = lambda name: name


@dataclass(frozen=True)
class Family:
    """A model family: everything that names it, in its one module.

    name: the registry key. model_type: the ModelConfig.model_type of its models; a family named after its
    model type is a base family (gpt, bert: `--model`'s choices), one that is not (llama) is a variant of one,
    with the same model class, that `claims` the configs it recognises. model: the TransformerLM class that
    `jax3d.models.build_model` makes for that model type. default_preset: `--preset` under `--model <name>`.
    flag_group / flags: its titled group of `launch/train.py` flags.
    """

    name: str
    model_type: str
    model: type
    presets: Mapping[str, Preset]
    hf: HFMapping | None = None
    default_preset: str = ""
    claims: Callable[[ModelConfig], bool] | None = None
    flag_group: str = ""
    flags: tuple[Flag, ...] = field(default=())

    @property
    def is_base(self) -> bool:
        return self.name == self.model_type


# Readers of config.json values that the families share.

def ln(ours: str, hf: str) -> list[Tensor]:
    """A layer norm's scale and bias."""
    return [Tensor(f"{ours}.scale", f"{hf}.weight"), Tensor(f"{ours}.bias", f"{hf}.bias")]


_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def activation(hf: dict, key: str) -> str:
    act = hf.get(key, "gelu_new" if key == "activation_function" else "gelu")
    if act in _TANH_GELUS:
        return "gelu_tanh"
    if act == "gelu":
        return "gelu_erf"
    raise ConfigError(f"config.json {key} {act!r} is not supported; jax3d has the tanh GELU (gelu_new) and the "
                      "erf GELU (gelu)")


def require(hf: dict, key: str, want, default) -> None:
    if hf.get(key, default) != want:
        raise ConfigError(f"config.json {key} {hf.get(key)!r} is not supported by jax3d's model; it needs {want!r}")


def size(hf: dict, key: str) -> int:
    """config.json's `key` as a size: a whole number of at least 1 (KeyError when it is missing)."""
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"config.json gives {key} {value!r}; it must be a whole number of at least 1")
    return value


def gelu_name(cfg: ModelConfig, name: str) -> str:
    """HF's name of `cfg`'s GELU (GPT-2 and BERT), ConfigError where HF `name` cannot express `cfg`'s heads or
    activation."""
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ConfigError(f"HF {name} cannot express --kv-channels {cfg.kv_channels} (its heads are hidden_size / "
                          "num_attention_heads wide); export it as jax3d safetensors with launch/export.py instead")
    if cfg.activation not in ("gelu_tanh", "gelu_erf"):
        raise ConfigError(f"HF {name} cannot express activation {cfg.activation} (--squared-relu) in jax3d's "
                          "export; export it as jax3d safetensors with launch/export.py instead")
    return {"gelu_tanh": "gelu_new", "gelu_erf": "gelu"}[cfg.activation]
