"""The train state: one pytree of step, fp32 master parameters, optimizer state, RNG, loss scale and, with FP8,
the amax histories (jax3d.train.fp8). How the loss scale starts and moves is the precision policy's
(jax3d.parallel.precision.LossScaling)."""
from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from jax3d.parallel.precision import LossScaling


@flax.struct.dataclass
class LossScale:
    """Dynamic loss scaling state (fp16). With bf16/fp32 the scale stays 1."""

    scale: jax.Array
    good_steps: jax.Array
    hysteresis: jax.Array
    skipped: jax.Array  # total skipped steps


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: dict
    opt_state: object
    rng: jax.Array  # raw uint32 key data, so it checkpoints like any array
    loss_scale: LossScale
    fp8: dict | None = None  # FP8 amax histories, shaped like the blocks' scales (jax3d.train.fp8); None: off


def seed_keys(seed: int) -> tuple[jax.Array, jax.Array]:
    """(the parameters' init key, the run's RNG key) of a seed."""
    return tuple(jax.random.split(jax.random.key(seed)))


def initial_loss_scale(scaling: LossScaling) -> LossScale:
    """The loss scale a run starts at (the policy's `loss_scaling.initial`: 1 unless fp16 scales)."""
    return LossScale(scale=jnp.float32(scaling.initial), good_steps=jnp.int32(0),
                     hysteresis=jnp.int32(scaling.hysteresis), skipped=jnp.int32(0))


def update_loss_scale(ls: LossScale, finite, scaling: LossScaling) -> LossScale:
    """Megatron's dynamic rule: halve once `hysteresis` overflows have been seen (and at every overflow after
    that), double after a window of good steps, which also restores the hysteresis budget. A static or no loss
    scale only counts the skipped steps."""
    if not scaling.dynamic:
        return ls.replace(skipped=ls.skipped + (~finite).astype(jnp.int32))
    good = jnp.where(finite, ls.good_steps + 1, 0)
    hyst = jnp.where(finite, ls.hysteresis, ls.hysteresis - 1)
    shrink = (~finite) & (hyst <= 0)
    scale = jnp.where(shrink, jnp.maximum(ls.scale / 2, scaling.min_scale), ls.scale)
    grow = good >= scaling.window
    scale = jnp.where(grow, scale * 2, scale)
    hyst = jnp.where(grow, scaling.hysteresis, jnp.maximum(hyst, 0))
    good = jnp.where(grow, 0, good)
    return LossScale(scale=scale, good_steps=good, hysteresis=hyst,
                     skipped=ls.skipped + (~finite).astype(jnp.int32))
