"""Hugging Face <-> jax3d: model configs both ways and the tensor-by-tensor conversion, run on each family's
mapping (jax3d.models.families: GPT-2, BERT, Llama / Mistral; the name tables and config.json rules live there).

Pure numpy: nothing here imports torch or transformers. jax3d keeps transformer blocks stacked on a
leading layers dim; HF names each layer (`h.{i}`).
"""
from __future__ import annotations

import numpy as np

from jax3d.config import ConfigError, ModelConfig
from jax3d.models.families import FAMILIES, Family, HFMapping, Tensor, family_of

__all__ = ["Tensor", "architecture", "from_hf", "hf_config_from_model", "model_config_from_hf", "padded", "table",
           "to_hf"]


def padded(vocab: int, divisible_by: int) -> int:
    return -(-vocab // divisible_by) * divisible_by


def _supported() -> tuple[str, ...]:
    return tuple(a for f in FAMILIES.values() if f.hf for a in f.hf.architectures)


def _family_of_architecture(arch: str) -> Family:
    return next(f for f in FAMILIES.values() if f.hf and arch in f.hf.architectures)


def _mapping(family: Family) -> HFMapping:
    if family.hf is None:
        raise ConfigError(f"the {family.name} family has no Hugging Face class; export it as jax3d safetensors with "
                          "launch/export.py instead")
    return family.hf


def architecture(hf: dict) -> str:
    """The one supported architecture named in config.json; ConfigError otherwise."""
    archs = hf.get("architectures") or []
    if not archs:
        by_type = {t: a for f in FAMILIES.values() if f.hf for t, a in f.hf.by_model_type.items()}
        if hf.get("model_type") in by_type:
            return by_type[hf["model_type"]]
    supported = _supported()
    for a in archs:
        if a in supported:
            return a
    raise ConfigError(f"config.json names architecture {archs or hf.get('model_type')!r}, which jax3d cannot import; "
                      f"it reads {', '.join(supported)}")


def model_config_from_hf(hf: dict, divisible_by: int = 128) -> ModelConfig:
    """The jax3d ModelConfig that reproduces the HF model of config.json `hf` exactly.

    The vocabulary is padded to a multiple of `divisible_by` (tensor parallelism shards it); the
    padding rows are zero and `unpadded_vocab_size` keeps the real size.
    """
    arch = architecture(hf)
    kw = _family_of_architecture(arch).hf.fields(hf, arch)
    d, n, v = kw["hidden_size"], kw["num_attention_heads"], kw.pop("vocab_size")
    if d % n:
        raise ConfigError(f"config.json hidden size {d} is not divisible by its {n} attention heads")
    return ModelConfig(vocab_size=padded(v, divisible_by), unpadded_vocab_size=v, **kw)


def hf_config_from_model(cfg: ModelConfig, token_ids: dict[str, int] | None = None) -> dict:
    """config.json for the HF class that computes what jax3d model `cfg` computes, with the tokenizer's
    `token_ids` (`bos_token_id`, ...; without them transformers assumes GPT-2's 50256, which a smaller
    vocabulary lacks, and generate never stops); ConfigError naming the field when no HF class of its family
    can express it."""
    vocab = cfg.unpadded_vocab_size or cfg.vocab_size
    return {**_mapping(family_of(cfg)).config(cfg, vocab), **(token_ids or {})}


def table(cfg: ModelConfig) -> list[Tensor]:
    """The tensors of `cfg`'s HF class, each with its place in jax3d's tree."""
    return _mapping(family_of(cfg)).table(cfg)


# jax3d's layer-norm scales that --apply-layernorm-1p stores as offsets from 1 (layers.norm_for): HF gets 1 + w.
ONE_PLUS_SCALES = ("blocks.ln_attn.scale", "blocks.ln_mlp.scale", "final_norm.scale")


def ignored_suffixes() -> tuple[str, ...]:
    """HF tensors that duplicate a tied one or are buffers, never parameters of their own (every family's, so
    that a file holding another class's buffers still imports)."""
    return tuple(s for f in FAMILIES.values() if f.hf for s in f.hf.ignored)


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


def from_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, into: dict) -> dict:
    """Fills the numpy tree `into` (jax3d's shapes, e.g. a fresh init) from HF tensors; ConfigError on a
    missing, unexpected or misshapen tensor. Vocabulary padding rows are zero."""
    hf_name = _mapping(family_of(cfg)).hf_name
    tensors = {hf_name(k): v for k, v in tensors.items()}
    used, ignored = set(), ignored_suffixes()
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
    extra = sorted(k for k in tensors if k not in used and not k.endswith(ignored))
    if extra:
        raise ConfigError(f"the model files hold tensor {extra[0]}, which config.json's architecture has no place "
                          f"for ({len(extra)} such); is config.json from another model?")
    return into
