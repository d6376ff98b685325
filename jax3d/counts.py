"""A run counted as Megatron counts it: in samples and tokens as well as steps.

Megatron-DeepSpeed's run length and learning-rate schedule can be given in samples (`--train-samples`,
`--lr-warmup-samples`, `--lr-decay-samples`) or tokens (`--train-tokens`, `--lr-warmup-tokens`,
`--lr-decay-tokens`), and its global batch can grow over the first samples (`--rampup-batch-size START
INCREMENT SAMPLES`). Every such count turns into steps through the samples consumed before each step, which
this module computes once for the loop, the schedule and the command line.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from jax3d.config import Config, ConfigError


@dataclass(frozen=True)
class BatchCounts:
    """How many samples each step takes: `global_batch`, or under a ramp (start, increment, ramp samples)
    the batch Megatron's ramp gives after the samples consumed so far. A sample is `seq_length` tokens."""

    global_batch: int
    seq_length: int
    ramp: tuple[int, ...] = ()

    @classmethod
    def of(cls, cfg: Config) -> "BatchCounts":
        return cls(cfg.train.global_batch_size, cfg.model.seq_length, tuple(cfg.train.rampup_batch_size))

    @classmethod
    def from_tuple(cls, t) -> "BatchCounts":
        return cls(int(t[0]), int(t[1]), tuple(int(x) for x in t[2:]))

    def as_tuple(self) -> tuple[int, ...]:
        return (self.global_batch, self.seq_length, *self.ramp)

    def batch_at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples: the ramp's start plus one
        increment per ramp-samples / increments consumed, and `global_batch` once the ramp's samples are past."""
        if not self.ramp:
            return self.global_batch
        start, incr, ramp_samples = self.ramp
        increments = (self.global_batch - start) // incr
        if consumed > ramp_samples or increments == 0:
            return self.global_batch
        return start + int(consumed / (ramp_samples / increments)) * incr

    @functools.cached_property
    def ramp_table(self) -> np.ndarray:
        """Samples consumed before each step of the ramp: entry k for step k, up to the first step whose batch
        is `global_batch` for good (just `[0]` without a ramp)."""
        table = [0]
        while self.ramp and table[-1] <= self.ramp[2] and self.batch_at(table[-1]) < self.global_batch:
            table.append(table[-1] + self.batch_at(table[-1]))
        return np.asarray(table, np.int64)

    def samples_before(self, step: int) -> int:
        table = self.ramp_table
        n = len(table) - 1
        return int(table[step]) if step <= n else int(table[n]) + (step - n) * self.global_batch

    def steps_for_samples(self, samples: int) -> int:
        """Megatron's train iterations for `--train-samples`: whole global batches, the ramp's steps counted
        one by one (a last, partial batch is dropped)."""
        table = self.ramp_table
        n = len(table) - 1
        return n + max(0, samples - int(table[n])) // self.global_batch

    def steps_for_tokens(self, tokens: int) -> int:
        """The steps a run with `--train-tokens` takes: Megatron stops before the first step that would
        start with at least that many tokens consumed."""
        need = math.ceil(tokens / self.seq_length)  # samples
        table = self.ramp_table
        n = len(table) - 1
        if need <= table[n]:
            return int(np.searchsorted(table, need))
        return n + math.ceil((need - int(table[n])) / self.global_batch)

    def validate(self) -> None:
        """ConfigError unless the ramp starts between 1 and the global batch and reaches it in whole increments."""
        start, incr, samples = self.ramp
        if not (1 <= start <= self.global_batch and incr >= 1 and samples >= 0 and
                (self.global_batch - start) % incr == 0):
            raise ConfigError(f"--rampup-batch-size {start} {incr} {samples} must start between 1 and the global batch "
                              f"{self.global_batch} and reach it in whole increments of at least 1, over 0 or more "
                              "samples")

    def check(self, micro_batch: int, data_parallel: int) -> None:
        """ConfigError unless every batch of the ramp splits into micro-batches on every data-parallel rank."""
        unit = micro_batch * data_parallel
        for b in sorted({self.batch_at(int(c)) for c in self.ramp_table}):
            if b % unit:
                raise ConfigError(f"--rampup-batch-size {' '.join(map(str, self.ramp))} passes through a global batch "
                                  f"of {b}, which --micro-batch-size {micro_batch} x {data_parallel} data-parallel "
                                  "ranks does not divide; pick a start and increment that it divides")


def uses_counts(cfg: Config) -> bool:
    """Whether the run's schedule or batch is counted in samples or tokens, not in steps alone."""
    o = cfg.optim
    return bool(cfg.train.rampup_batch_size or cfg.train.train_samples or o.lr_warmup_samples or
                o.lr_decay_samples or o.lr_warmup_tokens or o.lr_decay_tokens)


def settle(cfg: Config, data_parallel: int = 0) -> Config:
    """`cfg` with what its counts decide, from its own batch and sequence sizes (call it again after they
    change, e.g. when a resumed run takes its checkpoint's): `train_iters` from `train_samples`, and the batch
    counts a sample- or token-counted schedule reads (`optim.counted_batch`). With `data_parallel`, a ramp's
    batches are checked against the micro-batch."""
    counts = BatchCounts.of(cfg)
    if counts.ramp:
        counts.validate()
    train, optim = {}, {}
    if cfg.train.train_samples:
        train["train_iters"] = counts.steps_for_samples(cfg.train.train_samples)
        if train["train_iters"] < 1:
            raise ConfigError(f"--train-samples {cfg.train.train_samples} is less than one global batch of "
                              f"{counts.global_batch}; train on more samples")
    if uses_counts(cfg):
        optim["counted_batch"] = counts.as_tuple()
    if data_parallel and counts.ramp:
        counts.check(cfg.train.micro_batch_size, data_parallel)
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train),
                               optim=dataclasses.replace(cfg.optim, **optim))


def last_step(cfg: Config) -> int:
    """The step a run ends at: `train_iters`, or earlier where `--train-tokens` are reached first."""
    end = cfg.train.train_iters
    if cfg.train.train_tokens:
        end = min(end, BatchCounts.of(cfg).steps_for_tokens(cfg.train.train_tokens))
    return end
