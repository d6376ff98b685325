"""AdamW from optax with Megatron's learning-rate and weight-decay schedules and weight-decay exclusions."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jax3d.config import ConfigError, OptimConfig
from jax3d.counts import BatchCounts


def lr_schedule(optim: OptimConfig, train_iters: int):
    """The learning rate of the update after `count` applied ones, as Megatron's scheduler gives it: linear
    warm-up to `lr`, then cosine / linear decay to `min_lr`, then flat at `min_lr`.

    Counted in steps (`lr_warmup_iters`, `lr_decay_iters`, default `train_iters`) unless the schedule is counted
    in samples or tokens, as Megatron counts it then: its warm-up and decay lengths are samples
    (`lr_*_samples`, or `lr_*_iters` global batches), a token count (`lr_warmup_tokens`, `lr_decay_tokens`)
    overrides either, and the position is the samples (times the sequence length, the tokens) consumed before
    the update, from `optim.counted_batch` (jax3d.counts.settle sets it). `lr_warmup_fraction`, where
    set, makes the warm-up that share of the decay, in its unit.
    """
    if optim.lr_decay_style not in ("cosine", "linear", "constant"):
        raise ConfigError(f"--lr-decay-style {optim.lr_decay_style!r} must be cosine, linear or constant")
    counted = optim.lr_warmup_samples or optim.lr_decay_samples or optim.lr_warmup_tokens or optim.lr_decay_tokens
    if not optim.counted_batch:
        if counted:
            raise ConfigError("a learning-rate schedule counted in samples or tokens needs OptimConfig.counted_batch; "
                              "pass the config through jax3d.counts.settle")
        return _iteration_lr(optim, train_iters)
    samples, batch = _samples_consumed(optim)
    decay = optim.lr_decay_samples or (optim.lr_decay_iters or train_iters) * batch
    warm = optim.lr_warmup_fraction * decay if optim.lr_warmup_fraction else \
        optim.lr_warmup_samples or optim.lr_warmup_iters * batch
    return _megatron_lr(optim, samples, warm, decay, "samples", BatchCounts.from_tuple(optim.counted_batch).seq_length)


def _samples_consumed(optim: OptimConfig):
    """(samples consumed before update `count`, as a traceable function of it; the global batch), from
    `optim.counted_batch`: the ramp's steps one by one, then whole batches."""
    counts = BatchCounts.from_tuple(optim.counted_batch)
    table = jnp.asarray(counts.ramp_table, jnp.float32)
    last, batch = len(table) - 1, counts.global_batch

    def samples(count):
        return jnp.where(count <= last, table[jnp.minimum(count, last)], table[last] + (count - last) * batch)

    return samples, batch


def _iteration_lr(optim: OptimConfig, train_iters: int):
    """Megatron's rate counted in iterations: at `step` applied updates. Kept apart from the sample- and
    token-counted form, which gives the same rates, so that a step-counted run compiles the program it always
    has (the train step's hash in benchmarks.kernel_jaxprs)."""
    decay_iters = optim.lr_decay_iters or train_iters
    # Megatron's fractional warm-up ends between two steps: the rate climbs towards `lr` at its end.
    warmup = optim.lr_warmup_fraction * decay_iters if optim.lr_warmup_fraction else optim.lr_warmup_iters
    if optim.lr_decay_style != "constant" and decay_iters <= warmup:
        what = f"--lr-warmup-fraction {optim.lr_warmup_fraction} of it" if optim.lr_warmup_fraction else \
            f"--lr-warmup-iters {warmup}"
        raise ConfigError(f"--lr-decay-iters {decay_iters} must exceed {what}")

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


def _megatron_lr(optim: OptimConfig, position, warm, decay, unit: str, seq: int):
    """Megatron's rate at `position(count)` of `warm` and `decay` units (iterations or samples); token counts,
    where given, replace them, a sample being `seq` tokens (a step-counted warm-up followed by a token-counted
    decay hands over at the tokens its end was reached at, as Megatron's scheduler does)."""
    warm_tokens = optim.lr_warmup_tokens or (warm * seq if optim.lr_decay_tokens else 0)
    decay_tokens = optim.lr_decay_tokens
    if optim.lr_decay_style != "constant":
        if decay_tokens and decay_tokens <= warm_tokens:
            raise ConfigError(f"--lr-decay-tokens {decay_tokens} must exceed the {warm_tokens} tokens of the "
                              "warm-up (--lr-warmup-tokens, or the warm-up's samples times --seq-length)")
        if not decay_tokens and decay <= warm:
            what = f"--lr-warmup-fraction {optim.lr_warmup_fraction} of it" if optim.lr_warmup_fraction else \
                f"--lr-warmup-{unit} {warm}"
            raise ConfigError(f"--lr-decay-{unit} {decay} must exceed {what}")
    # As floats: token counts pass int32's range.
    warm, decay, warm_tokens, decay_tokens = float(warm), float(decay), float(warm_tokens), float(decay_tokens)

    def schedule(count):
        at = jnp.asarray(position(jnp.asarray(count, jnp.int32)), jnp.float32)
        tokens = at * seq
        if optim.lr_warmup_tokens:
            warming, warm_lr = tokens < warm_tokens, optim.lr * tokens / warm_tokens
        else:
            warming, warm_lr = at < warm, optim.lr * at / max(warm, 1)
        if optim.lr_decay_style == "constant":
            decayed = jnp.asarray(optim.lr, jnp.float32)
        else:
            frac = (tokens - warm_tokens) / (decay_tokens - warm_tokens) if decay_tokens \
                else (at - warm) / (decay - warm)
            frac = jnp.clip(frac, 0.0, 1.0)
            coeff = 0.5 * (jnp.cos(jnp.pi * frac) + 1.0) if optim.lr_decay_style == "cosine" else 1.0 - frac
            decayed = optim.min_lr + coeff * (optim.lr - optim.min_lr)
        return jnp.where(warming, warm_lr, decayed)

    return schedule


def decay_mask(params):
    """Megatron leaves biases and layer-norm parameters out of weight decay."""
    def keep(path, _):
        name = str(getattr(path[-1], "key", path[-1]))
        return not (name == "bias" or name.endswith("_bias") or name == "scale")
    return jax.tree_util.tree_map_with_path(keep, params)


WEIGHT_DECAY_INCR_STYLES = ("constant", "linear", "cosine")


def weight_decay_schedule(optim: OptimConfig, train_iters: int):
    """The weight decay of the update after `count` applied ones, as Megatron's scheduler gives it, or None
    when it is constant (`weight_decay`): from `start_weight_decay` to `end_weight_decay` over the run,
    linearly or along half a cosine, then flat at the end value. The run is its steps (`weight_decay_incr_iters`,
    default `train_iters`), or where the schedule is counted in samples (`optim.counted_batch`) the samples
    consumed before the update out of `weight_decay_incr_samples` (default those steps' batches)."""
    style = optim.weight_decay_incr_style
    if style not in WEIGHT_DECAY_INCR_STYLES:
        raise ConfigError(f"--weight-decay-incr-style {style!r} must be constant, linear or cosine")
    if style == "constant":
        return None
    start, end = optim.start_weight_decay, optim.end_weight_decay
    if not 0 <= start <= end:
        raise ConfigError(f"--start-weight-decay {start} and --end-weight-decay {end} must rise from 0 or more "
                          "(Megatron's weight decay only increases); pass a start at or below the end")
    iters = optim.weight_decay_incr_iters or train_iters
    if optim.counted_batch:
        position, batch = _samples_consumed(optim)
        length = float(optim.weight_decay_incr_samples or iters * batch)
    else:
        position, length = (lambda count: count), float(iters)

    def schedule(count):
        ratio = jnp.clip(jnp.asarray(position(jnp.asarray(count, jnp.int32)), jnp.float32) / length, 0.0, 1.0)
        coeff = ratio if style == "linear" else 0.5 * (jnp.cos(jnp.pi * (1.0 - ratio)) + 1.0)
        return start + coeff * (end - start)

    return schedule


def adamw_scheduled_decay(learning_rate, weight_decay, *, b1: float, b2: float, eps: float,
                          mask) -> optax.GradientTransformation:
    """optax.adamw whose weight decay is a schedule `weight_decay(count)` of the applied updates, as its
    learning rate may be. Its state is optax.adamw's, so the two restore each other's checkpoints; the
    count is the learning-rate scaling's, which a skipped step (whose state the step discards) leaves."""
    base = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=0.0, mask=mask)
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    rate = optax.scale_by_learning_rate(learning_rate)

    def update(updates, state, params):
        adam_state, decay_state, rate_state = state
        updates, adam_state = adam.update(updates, adam_state, params)
        wd = weight_decay(rate_state.count)
        updates = jax.tree.map(lambda u, p, keep: u + wd * p if keep else u, updates, params, mask(params))
        updates, rate_state = rate.update(updates, rate_state, params)
        return updates, (adam_state, decay_state, rate_state)

    return optax.GradientTransformation(base.init, update)


def make_optimizer(optim: OptimConfig, train_iters: int) -> optax.GradientTransformation:
    parts = []
    if optim.clip_grad > 0:
        parts.append(optax.clip_by_global_norm(optim.clip_grad))
    lr, wd = lr_schedule(optim, train_iters), weight_decay_schedule(optim, train_iters)
    if wd is None:  # the program a constant decay always compiled
        parts.append(optax.adamw(lr, b1=optim.adam_beta1, b2=optim.adam_beta2, eps=optim.adam_eps,
                                 weight_decay=optim.weight_decay, mask=decay_mask))
    else:
        parts.append(adamw_scheduled_decay(lr, wd, b1=optim.adam_beta1, b2=optim.adam_beta2, eps=optim.adam_eps,
                                           mask=decay_mask))
    return optax.chain(*parts)
