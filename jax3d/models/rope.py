"""Rotary position embeddings, in Hugging Face Llama's layout (`rotate_half`): the first half of a head's rotated
dims pairs with the second half, not neighbouring dims with each other. Megatron rotates the same way, so a
checkpoint moves between the two with no permutation of the q and k weights.

The inverse frequencies are HF's, including its `linear` and `llama3` rope scaling, computed in float32 as HF
does, so an imported model reproduces its logits.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax3d.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """(rotary_dim / 2,) float32: theta^(-2i / rotary_dim), rescaled as `cfg.rope_scaling` says."""
    dim = cfg.rotary_dim
    inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    inv = inv.astype(np.float32)
    if cfg.rope_scaling == "linear":
        inv = inv / np.float32(cfg.rope_scaling_factor)
    elif cfg.rope_scaling == "llama3":
        inv = _llama3_scaled(inv, cfg)
    return inv.astype(np.float32)


def _llama3_scaled(inv: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Llama 3.1's scaling: wavelengths longer than the original context / low_freq_factor are stretched by
    the factor, those shorter than context / high_freq_factor are kept, and the band between is blended."""
    factor, low, high = (np.float32(v) for v in (cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                                                 cfg.rope_high_freq_factor))
    old = np.float32(cfg.rope_original_max_position_embeddings)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, blended, scaled)


def apply_rope(x_btnh, positions_bt, inv_freq: np.ndarray):
    """x (batch, seq, heads, head_dim) with its first 2 * len(inv_freq) dims rotated by each token's position
    (batch, seq); computed in fp32, returned in x's dtype."""
    half = inv_freq.shape[0]
    angle_btf = positions_bt.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    cos, sin = jnp.cos(angle_btf)[:, :, None, :], jnp.sin(angle_btf)[:, :, None, :]  # (batch, seq, 1, half)
    x32 = x_btnh.astype(jnp.float32)
    x1, x2, rest = x32[..., :half], x32[..., half:2 * half], x32[..., 2 * half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x_btnh.dtype)


def positions_for(x_bt) -> jax.Array:
    """0, 1, 2, ... for every row of a (batch, seq, ...) array: the positions of a sequence read whole."""
    return jnp.broadcast_to(jnp.arange(x_bt.shape[1]), x_bt.shape[:2])
