"""AdamW from optax with Megatron's learning-rate schedule and weight-decay exclusions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jax3d.config import ConfigError, OptimConfig


def lr_schedule(optim: OptimConfig, train_iters: int):
    """Linear warmup to `lr`, then cosine / linear decay to `min_lr` at `lr_decay_iters`, then flat."""
    if optim.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"--lr-decay-style {optim.lr_decay_style!r} must be cosine, linear or constant")
    warmup = optim.lr_warmup_iters
    decay_iters = optim.lr_decay_iters or train_iters
    if optim.lr_decay_style != "constant" and decay_iters <= warmup:
        raise ConfigError(f"--lr-decay-iters {decay_iters} must exceed --lr-warmup-iters {warmup}")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = optim.lr * step / max(warmup, 1)
        if optim.lr_decay_style == "constant":
            decayed = jnp.asarray(optim.lr, jnp.float32)
        else:
            frac = jnp.clip((step - warmup) / (decay_iters - warmup), 0.0, 1.0)
            coeff = 0.5 * (jnp.cos(jnp.pi * frac) + 1.0) if optim.lr_decay_style == "cosine" else 1.0 - frac
            decayed = optim.min_lr + coeff * (optim.lr - optim.min_lr)
        return jnp.where(step < warmup, warm, decayed)

    return schedule


def decay_mask(params):
    """Megatron leaves biases and layer-norm parameters out of weight decay."""
    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name == "bias" or name.endswith("_bias") or name == "scale")
    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(optim: OptimConfig, train_iters: int) -> optax.GradientTransformation:
    parts = []
    if optim.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_grad))
    parts.append(optax.adamw(lr_schedule(optim, train_iters), b1=optim.adam_beta1, b2=optim.adam_beta2,
                             eps=optim.adam_eps, weight_decay=optim.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
