"""Steps skipped for non-finite gradients, told as the loop learns of them: one line when a run of them starts,
one when it ends, and a stop with one sentence once the last `--exit-after-skipped-iters` steps were all skipped.

The step never applies a non-finite update (jax3d.train.step); fp16's dynamic loss scale skips a few at the start
of a run while it comes down, as Megatron's does. The watch reads a step's flags only once the loop knows the step
has finished (it waits for step i-2 anyway, and for all of them at a log step), so it adds no device sync, and
every process reads them at the same steps, so all stop at the same one.
"""
from __future__ import annotations

import collections
import math

import jax

from jax3d.config import ConfigError
from jax3d.parallel.precision import LossScaling

DEFAULT_LIMIT = 50  # past fp16's 33 overflows from 2^32 to a scale of 1 (`overflows_to_floor`), with room to spare
FLAG = "--exit-after-skipped-iters"


class SkippedStepsStop(Exception):
    """Raised by the loop once the last `limit` steps were all skipped; nothing was saved after them."""

    exit_code = 3

    def __init__(self, first: int, last: int, limit: int):
        self.first, self.last, self.limit = first, last, limit
        super().__init__(f"steps {first}-{last} were all skipped for non-finite gradients ({last - first + 1} in a "
                         f"row, {FLAG} {limit}), so the run stops")


def overflows_to_floor(scaling: LossScaling) -> int:
    """Overflows in a row that take fp16's dynamic loss scale from its first value down to --min-loss-scale (0
    without one): the first `hysteresis - 1` only spend the hysteresis, each after that halves the scale (33 from
    Megatron's 2^32 with hysteresis 2; 17 reach 2^16, about where fp16's range starts to hold gradients)."""
    if not scaling.dynamic:
        return 0
    halvings = max(0, math.ceil(math.log2(scaling.initial / scaling.min_scale)))
    return scaling.hysteresis - 1 + halvings


def skip_limit(given: int, scaling: LossScaling) -> int:
    """The run's `--exit-after-skipped-iters` (`given`, negative when not given); by default DEFAULT_LIMIT, or
    more where an fp16 loss scale needs more room to come down."""
    return given if given >= 0 else max(DEFAULT_LIMIT, overflows_to_floor(scaling) + 10)


def check_limit(limit: int, scaling: LossScaling) -> None:
    """ConfigError where a given limit would stop an fp16 run before its loss scale could reach its floor."""
    floor = overflows_to_floor(scaling)
    if 0 < limit <= floor:
        raise ConfigError(f"{FLAG} {limit} would stop an --fp16 run before its loss scale can come down: from "
                          f"{_scale(scaling.initial)} to --min-loss-scale {scaling.min_scale:g} "
                          f"takes {floor} overflows in a row with --hysteresis {scaling.hysteresis}; pass more than "
                          f"{floor}, or 0 to never stop")


def _scale(s: float) -> str:
    e = math.log2(s) if s > 0 else 0.5
    return f"2^{int(e)}" if e == int(e) else f"{s:g}"


class SkipWatch:
    """Follows the train step's `skipped` count (a running total) step by step, lazily."""

    def __init__(self, scaling: LossScaling, limit: int, skipped_before: int, say):
        self.fp16, self.limit, self.total, self.say = scaling.dynamic, limit, skipped_before, say
        self.unread = collections.deque()  # (step, metrics) not read yet
        self.first = 0  # the first step of the run of skipped steps that ends at the last one read
        self.streak = 0  # its length; 0 when the last step read applied its update

    def add(self, step: int, metrics: dict) -> None:
        self.unread.append((step, metrics))

    def read_through(self, step: int) -> None:
        """Reads the flags of the steps up to `step`, which the caller knows have finished: one scalar a step,
        and a skipped step's gradient norm and loss scale for its line."""
        ready = []
        while self.unread and self.unread[0][0] <= step:
            ready.append(self.unread.popleft())
        for (s, m), total in zip(ready, jax.device_get([m["skipped"] for _, m in ready])):
            skipped, self.total = int(total) > self.total, int(total)
            if skipped:
                if not self.streak:
                    self.first = s
                    norm, scale = jax.device_get((m["grad_norm"], m["loss_scale"]))
                    self.say(self._started(s, float(norm), float(scale)))
                self.streak += 1
                if self.limit and self.streak >= self.limit:
                    raise SkippedStepsStop(self.first, s, self.limit)
            elif self.streak:
                if self.streak > 1:
                    scale = f" at loss scale {_scale(float(m['loss_scale']))}" if self.fp16 else ""
                    self.say(f"jax3d: steps {self.first}-{s - 1} were skipped ({self.streak} in a row); step {s} "
                             f"applied its update{scale}")
                self.streak = 0

    def _started(self, step: int, grad_norm: float, scale: float) -> str:
        stop = f"the run stops after {self.limit} in a row, {FLAG}" if self.limit else f"{FLAG} 0: it never stops"
        if self.fp16:
            return (f"jax3d: step {step}: gradients overflowed (grad norm {grad_norm:g}) at loss scale "
                    f"{_scale(scale)}, so its update was skipped and the scale comes down; in fp16 a few such steps at "
                    f"the start of a run, and one now and then after the scale has grown, are normal ({stop})")
        return (f"jax3d: step {step}: gradients are not finite (grad norm {grad_norm:g}), so its update was "
                f"skipped, as every step's is until they are ({stop})")

    def held(self, step: int, last: bool) -> str:
        """The line for a save at `step` put off because its update and those before it back to `first` were
        skipped: saving it could rotate a checkpoint that trains (--keep-checkpoints) away for one that may not."""
        steps = f"step {step} was" if self.first == step else f"steps {self.first}-{step} were"
        if last:
            return (f"jax3d: not saving step {step}, the last: {steps} skipped, so the checkpoints from before "
                    "stay the newest")
        return f"jax3d: not saving step {step} yet: {steps} skipped, so the save waits for a step that applies its update"
