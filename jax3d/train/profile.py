"""`--profile`: a jax.profiler trace of some of a run's steps, as Megatron's profiler takes them."""
from __future__ import annotations

import jax


class StepTrace:
    """Traces steps `first`..`last` of this process (the first step it runs is 1, resumed or not, as Megatron
    counts them) into `log_dir`, where TensorBoard's profile plugin finds them (plugins/profile/RUN/). Only on
    the processes of `ranks` (empty: all); with `steps` empty it does nothing."""

    def __init__(self, steps: tuple[int, ...], ranks: tuple[int, ...], log_dir: str):
        on = bool(steps) and (not ranks or jax.process_index() in ranks)
        self.first, self.last = steps if on else (0, -1)
        self.log_dir, self.tracing, self.n = log_dir, False, 0

    def before_step(self) -> None:
        self.n += 1
        if self.n == self.first:
            jax.profiler.start_trace(self.log_dir)
            self.tracing = True

    def after_step(self, outputs) -> None:
        if self.tracing and self.n == self.last:
            jax.block_until_ready(outputs)  # the trace holds the steps' device work, not only their dispatch
            self.stop()

    def stop(self) -> None:
        if self.tracing:
            jax.profiler.stop_trace()
            self.tracing = False
