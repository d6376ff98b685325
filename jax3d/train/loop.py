"""The training loop: the only place with side effects (data, logging, evaluation, checkpoints)."""
from __future__ import annotations

import math
import os
import sys
import time

import jax
import numpy as np

from jax3d.config import Config, ConfigError
from jax3d.counts import BatchCounts, last_step
from jax3d.parallel.plan import Plan
from jax3d.train.metrics import MetricsWriter, memory_gb, model_flops_per_token, optimizer_state_norms, peak_tflops
from jax3d.train.memory import (STATE_FIXES, check_fits, check_placed, device_capacity, is_out_of_memory,
                                largest_fitting, ran_out, step_peak_bytes)
from jax3d.train.skipped import SkipWatch, skip_limit
from jax3d.train.profile import StepTrace
from jax3d.train.step import Steps, abstract_batch, abstract_state, build_steps


# Steps queued ahead of the device. Two keep it busy, and more gain nothing. An unbounded queue (up
# to a log interval of steps) hung 8 emulated CPU devices within a few hundred steps: in gdb, 7 of
# them waited in a step's all-reduce while the 8th waited on XLA's per-device in-flight semaphore,
# presumably with its slots held by the steps queued behind.
MAX_STEPS_IN_FLIGHT = 2


def _progress(total: int, initial: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, dynamic_ncols=True, file=sys.stderr,
                unit="step", leave=True)


def _averaged(key: str) -> bool:
    """Losses and accuracies: averaged over a log interval, and printed."""
    return key.endswith(("loss", "_acc"))


def _interval_line(rec: dict, end: int) -> str:
    """`step 100/1500 | loss 7.3133 | lm_loss 6.6191 | ... | lr 9.90e-04 | 9,245 tok/s`."""
    keys = ["loss"] + sorted(k for k in rec if k != "loss" and _averaged(k))
    losses = " | ".join(f"{k} {rec[k]:.4f}" for k in keys)
    mfu = f" | MFU {rec['mfu']:.1%}" if rec.get("mfu") else ""
    return (f"step {rec['step']}/{end} | {losses} | lr {rec['lr']:.2e} | "
            f"{rec['tokens_per_s']:,.0f} tok/s{mfu}")


def evaluate(steps: Steps, params, valid, eval_iters: int) -> dict:
    """Validation loss and perplexity over `eval_iters` global batches from the start of `valid`."""
    from jax3d.data import BatchLoader

    tr = steps.cfg.train
    loader = BatchLoader(valid, tr.global_batch_size, steps.accum_steps, steps.mesh, start_sample=0, prefetch=1)
    totals = {}
    try:
        for _ in range(eval_iters):
            for k, v in jax.device_get(steps.eval_step(params, next(loader))).items():
                totals[k] = totals.get(k, 0.0) + float(v) / eval_iters
    finally:
        loader.close()
    out = {f"val_{k}": v for k, v in totals.items()}
    out["val_ppl"] = math.exp(min(out.get("val_lm_loss", out["val_loss"]), 50.0))
    return out


def check_not_past_end(saved: int, tr) -> None:
    """ConfigError when a run would resume checkpoint step `saved` past its --train-iters (a fine-tune, which
    starts at step 0, excepted): that asks for a fine-tune or a longer run, not for nothing."""
    if saved > tr.train_iters and not tr.finetune:
        raise ConfigError(f"--load {tr.load} is at step {saved}, past --train-iters {tr.train_iters}; raise "
                          "--train-iters to train on, or add --finetune to train its weights from step 0")


class _TrainBatches:
    """The global batch of each step, whose size follows Megatron's ramp (`--rampup-batch-size`): one loader per
    size, the next started at the sample where the last one stopped."""

    def __init__(self, dataset, counts: BatchCounts, per_micro: int, mesh, consumed: int):
        self.dataset, self.counts, self.per_micro, self.mesh = dataset, counts, per_micro, mesh
        self.consumed, self.size, self._loader = consumed, 0, None

    def next(self):
        """(the next batch, its global batch size)."""
        from jax3d.data import BatchLoader

        size = self.counts.batch_at(self.consumed)
        if size != self.size:
            self.close()
            self._loader = BatchLoader(self.dataset, size, size // self.per_micro, self.mesh,
                                       start_sample=self.consumed, prefetch=2)
            self.size = size
        batch = next(self._loader)
        self.consumed += size
        return batch, size

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed}

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()


class _Deadline:
    """`--exit-duration-in-mins`: whether the time since `train` started, with the steps still queued on the device,
    one more step and a save, would pass the limit. A save's time is what the last one held the loop; before the
    first, which also starts orbax's machinery, a twentieth of the limit is kept for it. All processes agree, as the
    save is collective."""

    def __init__(self, minutes: float, start: float):
        self.limit_s, self.start = minutes * 60, start
        self.last, self.step_s = time.time(), 0.0

    def minutes(self) -> float:
        return (time.time() - self.start) / 60

    def near(self, checkpointer) -> bool:
        now = time.time()
        self.step_s, self.last = now - self.last, now
        if not self.limit_s:
            return False
        saved_s = getattr(checkpointer, "last_save_blocked_s", 0.0)
        save_s = saved_s if saved_s else self.limit_s / 20
        near = now - self.start + (MAX_STEPS_IN_FLIGHT + 1) * self.step_s + save_s >= self.limit_s
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            near = bool(np.max(multihost_utils.process_allgather(np.int32(near))))
        return near


def _kill_switch(path: str) -> bool:
    """`--kill-switch-file`: whether `path` exists, for every process if one sees it (they stop together)."""
    seen = bool(path) and os.path.exists(path)
    if path and jax.process_count() > 1:
        from jax.experimental import multihost_utils
        seen = bool(np.max(multihost_utils.process_allgather(np.int32(seen))))
    return seen


def train(plan: Plan, mesh, inputs, *, progress: bool = True, checkpointer=None, memory_check: bool = True) -> dict:
    """Runs the plan's `cfg.train.train_iters` steps (or until `--train-tokens`, `--exit-interval` or
    `--exit-duration-in-mins`) on `mesh` (None: the plan's); returns the last logged record.

    With `memory_check`, a step whose compiled peak exceeds the local devices' memory raises DeviceOutOfMemory (a
    ConfigError) before the state is allocated, naming a micro-batch that fits. A step that runs out of device
    memory all the same raises it too, once the run's buffers are freed, with the same advice.
    """
    mesh = mesh if mesh is not None else plan.mesh.build(jax.devices()[: plan.mesh.size])
    compiled = {}
    try:
        return _train(plan, mesh, inputs, progress, checkpointer, memory_check, compiled)
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e) or "step" not in compiled:
            raise
    # Out of the handler, so that the failed run's frames, and the device buffers they held, are gone.
    # The advice is for the next run, which has the whole pool (this process may still hold some of it).
    peak = step_peak_bytes(compiled["step"])
    have = min(device_capacity() or peak, peak - 1)  # what ran out: a step that fits needs less than its peak
    raise ran_out("the run", peak, _smaller_micro_batch(plan, mesh, have))


def _micro_batches_below(cfg: Config, data: int) -> list[int]:
    """The micro-batch sizes below the run's that keep its global batch: they divide it over the data-parallel
    devices."""
    per_replica = cfg.train.global_batch_size // data
    return [b for b in range(1, cfg.train.micro_batch_size) if per_replica % b == 0]


def _smaller_micro_batch(plan: Plan, mesh, have: int):
    """`largest_fitting`'s (micro-batch, peak) for this run's step at a smaller micro-batch, compiled from abstract
    shapes; None when none fits or the batch ramps up (the ramp's sizes would need their own)."""
    cfg = plan.cfg
    if cfg.train.rampup_batch_size:
        return None

    def peak_at(micro: int) -> int:
        steps = build_steps(plan.replace(cfg=cfg.replace(train={"micro_batch_size": micro})), mesh)
        return step_peak_bytes(steps.train_step.lower(
            abstract_state(steps), abstract_batch(steps, steps.model.sample_shapes())).compile())
    return largest_fitting(_micro_batches_below(cfg, plan.mesh.data), peak_at, have)


def _train(plan: Plan, mesh, inputs, progress: bool, checkpointer, memory_check: bool, compiled: dict) -> dict:
    started = time.time()
    cfg = plan.cfg
    tr = cfg.train
    chief = jax.process_index() == 0
    final = last_step(cfg)
    saved = checkpointer.step_to_restore() if checkpointer is not None else None
    if saved is not None:  # said before compiling
        check_not_past_end(saved, tr)
    if saved is not None and not tr.finetune and saved >= final:
        print(f"jax3d: nothing to do: the checkpoint is already at step {saved} of {final}", file=sys.stderr)
        return {}
    steps = build_steps(plan, mesh)
    # Compiled from abstract shapes before any state is allocated or restored, so a step that cannot fit
    # stops here, before a checkpoint is read into memory the step then has no room beside.
    t0 = time.perf_counter()
    if chief and progress and steps.precision.fp8 and jax.default_backend() == "gpu":
        # Measured on an H100: 200 s at the 1.3B shape against bf16's 20 s (docs/performance.md, FP8).
        print("jax3d: compiling the train step; with FP8 GEMMs that can take minutes (--compilation-cache-dir keeps "
              "it for later runs)", file=sys.stderr)
    train_step = steps.train_step.lower(abstract_state(steps), abstract_batch(steps, steps.model.sample_shapes())).compile()
    if chief and progress:
        print(f"jax3d: compiled the train step in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    compiled["step"] = train_step
    if memory_check:
        check_fits(train_step, smaller=lambda have: _smaller_micro_batch(plan, mesh, have))
        if checkpointer is not None and not steps.order.logical:
            # A save or restore holds the state and its logical-order copy at once (layer_order.py); with
            # small activations that is more than the step itself needs.
            check_fits(steps.compiled_logical_copy(), "saving or restoring a checkpoint, which holds the "
                       "state and its logical-order copy at once,", STATE_FIXES)
    state, consumed = None, 0
    if checkpointer is not None:
        checkpointer.to_logical = steps.logical_state  # saves hold logical layer order (layer_order.py)
        state, consumed = checkpointer.restore(steps, saved)
    start = int(state.step) if state is not None else 0
    end = final  # past start: a finished run returned above
    if tr.exit_interval:
        end = min(end, (start // tr.exit_interval + 1) * tr.exit_interval)
    if state is None:
        state = steps.init_state(tr.seed)
    flops_tok = model_flops_per_token(cfg.model)
    peak = peak_tflops(tr.peak_tflops)
    n_dev = jax.device_count()
    loader = _TrainBatches(inputs.train, BatchCounts.of(cfg), tr.global_batch_size // steps.accum_steps, mesh, consumed)
    logs = set(tr.tensorboard_log)
    opt_norms = jax.jit(optimizer_state_norms) if "optimizer_states" in logs else None
    writer = bar = trace = None
    try:
        # A fresh run starts a fresh log; a resumed one appends to it.
        writer = MetricsWriter(tr.log_dir, enabled=chief, fresh=start == 0, tensorboard_dir=tr.tensorboard_dir,
                               tensorboard_log=tr.tensorboard_log)
        first_batch = loader.next()
        if memory_check:  # the state and the first batch are in place: the step's temporaries must fit beside them
            check_placed(train_step)
        bar = _progress(end, start, progress and chief)
        deadline = _Deadline(tr.exit_duration_in_mins, started)
        trace = StepTrace(tr.profile_steps, tr.profile_ranks, tr.tensorboard_dir or tr.log_dir)
        last, pending = {}, []
        t_last, steps_since, consumed_last = time.perf_counter(), 0, consumed
        say = (lambda line: bar.write(line, file=sys.stderr)) if chief else (lambda line: None)
        scaling = steps.precision.loss_scaling
        skips = SkipWatch(scaling, skip_limit(tr.exit_after_skipped_iters, scaling), int(state.loss_scale.skipped), say)
        owed = False  # a save put off because the steps before it were all skipped
        for it in range(start, end):
            if _kill_switch(tr.kill_switch_file):  # as Megatron: checked before each step, and no save
                if chief:
                    bar.write(f"jax3d: --kill-switch-file {tr.kill_switch_file} exists: stopping before step "
                              f"{it + 1} without saving", file=sys.stderr)
                break
            batch, size = first_batch if it == start else loader.next()
            trace.before_step()
            # The compiled step takes the full global batch; a ramp's smaller batches compile their own.
            state, metrics = (train_step if size == tr.global_batch_size else steps.train_step)(state, batch)
            trace.after_step((state, metrics))
            pending.append(metrics)
            skips.add(it + 1, metrics)
            if len(pending) > MAX_STEPS_IN_FLIGHT:
                jax.block_until_ready(pending[-1 - MAX_STEPS_IN_FLIGHT])
                skips.read_through(it + 1 - MAX_STEPS_IN_FLIGHT)  # finished: its flags cost no sync
            steps_since += 1
            step = it + 1
            if step % tr.log_interval == 0 or step == end:
                host = jax.device_get(pending)  # waits for the device: the interval's time is real
                skips.read_through(step)
                dt = (time.perf_counter() - t_last) / steps_since
                tps = (loader.consumed - consumed_last) * cfg.model.seq_length / (dt * steps_since)
                tflops = tps * flops_tok / n_dev / 1e12
                rec = {"step": step, **{k: float(v) for k, v in host[-1].items()},
                       # losses and accuracies are averaged over the interval, as Megatron logs them
                       **{k: float(np.mean([h[k] for h in host])) for k in host[-1] if _averaged(k)},
                       "tokens_per_s": tps, "tflops_per_device": tflops,
                       "mfu": (tflops / peak) if peak else None, "mem_gb": memory_gb(), "step_time_s": dt,
                       "consumed_samples": loader.consumed}
                rec["skipped"] = int(rec["skipped"])
                if "batch_size" in logs:
                    rec["batch_size"] = size
                if opt_norms is not None:
                    rec.update({k: float(v) for k, v in jax.device_get(opt_norms(state.params, state.opt_state)).items()})
                writer.write(rec)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", tok_s=f"{tps:,.0f}")
                if chief and not progress:  # no bar to show it: one line per interval, as Megatron logs
                    bar.write(_interval_line(rec, end))
                last, pending = rec, []
                t_last, steps_since, consumed_last = time.perf_counter(), 0, loader.consumed
            paused = time.perf_counter()  # evaluation and checkpoint saves stay out of the step time
            if inputs.valid is not None and tr.eval_interval and step % tr.eval_interval == 0:
                jax.block_until_ready(state)
                paused = time.perf_counter()
                ev = evaluate(steps, state.params, inputs.valid, tr.eval_iters)
                writer.write({"step": step, **ev}, prefix="valid")
                parts = "".join(f", {k[4:]} {v:.4f}" for k, v in sorted(ev.items())
                                if k != "val_loss" and _averaged(k))
                bar.write(f"step {step}: validation loss {ev['val_loss']:.4f}{parts}, "
                          f"perplexity {ev['val_ppl']:.2f}")
                last.update(ev)
            if checkpointer is not None:
                # A state reached only by skipped steps is not saved over one that trains: the save waits.
                due = owed or checkpointer.due(step, force=step == end)
                if due:
                    skips.read_through(step)  # the save waits for this step anyway
                hold = skips.streak > 0
                if due and hold and (not owed or step == end):
                    say(skips.held(step, last=step == end))
                owed = due and hold
                checkpointer.maybe_save(step, state, loader.state_dict(), force=due, hold=hold)
            t_last += time.perf_counter() - paused
            bar.update(1)
            if step < end and deadline.near(checkpointer):
                saving = checkpointer is not None and checkpointer.save_dir
                if saving:
                    skips.read_through(step)  # the save waits for this step anyway
                saved_now = saving and not skips.streak
                if saved_now:
                    checkpointer.maybe_save(step, state, loader.state_dict(), force=True)
                if chief:
                    bar.write(f"jax3d: --exit-duration-in-mins {tr.exit_duration_in_mins:g}: stopping at step {step} "
                              f"of {end} after {deadline.minutes():.1f} min of training, "
                              + ("with a checkpoint; --load it to go on" if saved_now else
                                 "without a checkpoint (no --save)" if not saving else
                                 f"without saving (steps {skips.first}-{step} were skipped)"), file=sys.stderr)
                break
    finally:
        if trace is not None:
            trace.stop()
        if bar is not None:
            bar.close()
        loader.close()
        if writer is not None:
            writer.close()
        if checkpointer is not None:
            checkpointer.wait()
    return last
