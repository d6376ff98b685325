"""Checkpoints on orbax: asynchronous saves, restore onto any layout, clear errors, clean stops on signals.

One checkpoint is a step directory `DIR/<step>/` with three orbax items:

- `params`: the fp32 master parameters, one array per logical parameter (global shapes);
- `train`: the rest of the train state (step, optimizer state, RNG key data, loss scale, and with FP8 the amax
  histories, per logical layer like the parameters);
- `meta`: JSON with the full run config, the tokenizer, the data-loader position and the jax3d version.

The saved pytree and its global shapes don't depend on the (data, stage, model) layout or the ZeRO stage;
only the shardings do. Restoring onto another layout is therefore an ordinary orbax restore with the new
run's shardings as targets: every process reads just the slices its devices hold. A run whose state keeps
its layer stack in pipeline order (interleaved or uneven stages, train/layer_order.py) saves a logical-order
copy (held on the devices until orbax has copied it to the host) and reorders what it restores, once. Both
conversions come from the caller (`to_logical`, and `restore`'s `steps`): the checkpointer knows the saved
schema, not the train state's layer order.

Orbax writes a step into `<step>.orbax-checkpoint-tmp*` and renames it when complete, so a save killed
half-way never shows up as a step and the previous one stays the latest.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time

import jax
import numpy as np

from jax3d.config import Config, ConfigError, ModelConfig, as_tuple
from jax3d.parallel import with_shardings
from jax3d.parallel.mesh import STAGE
from jax3d.parallel.pipeline_spec import PipelineSpec
from jax3d.pipeline.layout import state_layout
from jax3d.checkpoint.files import check_files, record_checksums, record_files
from jax3d.checkpoint.read import (list_steps, manager, no_checkpoint, orbax_checkpoint, read_meta, resolve_step,
                                   restore_arrays)
from jax3d.checkpoint.tokenizer import kept_in, tokenizer_info

FORMAT_VERSION = 1
# Model fields that don't change the parameters and may differ between the saved run and this one.
FREE_MODEL_FIELDS = frozenset({"hidden_dropout", "attention_dropout", "recompute", "scan_layers",
                               "attention_impl", "init_method_std", "seq_length",
                               # the padded vocab_size it produced is what the checkpoint's shapes hold
                               "make_vocab_size_divisible_by",
                               # which tokens the loss and attention skip, decided by each run and its tokenizer
                               "eod_mask_loss", "reset_position_ids", "reset_attention_mask", "eod_token_id"})


class TrainingInterrupted(Exception):
    """Raised by `Checkpointer.maybe_save` after SIGTERM / SIGINT, once the final checkpoint is written.

    `exit_code` is the shell convention for death by that signal: 143 for SIGTERM, 130 for SIGINT.
    """

    def __init__(self, signum: int, step: int, saved: bool, why: str = "no --save"):
        self.signum, self.step, self.saved = signum, step, saved
        self.exit_code = 128 + signum
        what = f"saved a checkpoint at step {step}" if saved else f"stopped at step {step} without saving ({why})"
        super().__init__(f"{signal.Signals(signum).name} received; {what}")


def _flag(field: str) -> str:
    """The command-line flag that sets a ModelConfig field."""
    return "--model" if field == "model_type" else "--" + field.replace("_", "-")


def check_model_compatible(saved: dict, current: ModelConfig, where: str) -> None:
    """Raises ConfigError naming the first shape-defining model field that differs from the checkpoint."""
    cur = dataclasses.asdict(current)
    for field, value in cur.items():
        if field in FREE_MODEL_FIELDS or field not in saved or as_tuple(saved[field]) == as_tuple(value):
            continue
        hint = ""
        if field == "vocab_size":
            hint = (" (the padded vocabulary depends on --tensor-model-parallel-size and "
                    "--make-vocab-size-divisible-by; pass --vocab-size "
                    f"{saved[field]} to match the checkpoint)")
        raise ConfigError(f"checkpoint {where} was saved with {_flag(field)} {saved[field]} but this run has "
                          f"{_flag(field)} {value}{hint}; use the checkpoint's model shape or another --load")


def _same_dir(a: str, b: str) -> bool:
    return os.path.abspath(a) == os.path.abspath(b)


class Checkpointer:
    """Saves and restores the train state for the training loop.

    `restore(steps)` -> (TrainState on `steps.state_shardings`, consumed_samples), or (None, 0) to start
    fresh. `maybe_save(step, state, loader_state, force)` saves every `--save-interval` steps (and when
    forced), asynchronously: orbax copies the arrays to host memory before returning, so the next
    (donating) train step may run while the files are written. `wait()` blocks until writes finish.
    """

    def __init__(self, cfg: Config, tokenizer=None, *, async_save: bool = True, checked: int | None = None,
                 to_logical=None):
        """`checked`: the step of `--load` whose files the caller has already checked (`check_files`).
        `to_logical`: the train state -> a copy in logical layer order (`Steps.logical_state`), which saves
        need where the state keeps its layers in pipeline order; None: states are saved as given."""
        tr = cfg.train
        self.cfg = cfg
        self.save_dir = tr.save
        self.load_dir = tr.load
        self.tokenizer = tokenizer_info(cfg, tokenizer)
        from jax3d.checkpoint.record import data_record
        self.data = data_record(cfg.data)
        self._writing = None  # (step, start time) of the save being written
        self._summing = None  # the thread writing the checksums of the last save
        self._checked = (tr.load, checked)  # (directory, step) whose files were checked
        self.async_save = async_save
        self._mgr = None
        self._last_saved = -1
        self._resumed_from = None  # the step restored, when this run continues in its --save directory
        self._signal = 0
        self._old_handlers = {}
        self._sync_every = max(1, tr.log_interval)
        self.to_logical = to_logical
        self.last_save_blocked_s = 0.0  # how long the last save call held the training loop

    def check_save_dir(self) -> None:
        """Refuses a `--save` directory that holds another run's checkpoints, which the first save
        would replace; a run continues there by loading that same directory."""
        if not self.save_dir or (self.load_dir and _same_dir(self.load_dir, self.save_dir)):
            return
        found = list_steps(self.save_dir)
        if found:
            raise ConfigError(f"--save {self.save_dir} already holds checkpoints (steps {found}) that saving "
                              f"would replace; pass --load {self.save_dir} to continue that run, or save to "
                              "an empty directory")

    # ---- restore -------------------------------------------------------------------------------------
    def step_to_restore(self) -> int | None:
        """The checkpoint step a run resumes from (reading no arrays), or None when it starts fresh;
        ConfigError where the run cannot start, its `--save` directory included (`check_save_dir`)."""
        self.check_save_dir()
        step = self._load_step()
        if step is not None:  # before the step compiles: a damaged checkpoint is found in seconds
            check_files(self.load_dir, step, contents=self._checked != (self.load_dir, step))
            self._checked = (self.load_dir, step)
        return step

    def _load_step(self) -> int | None:
        tr = self.cfg.train
        if not self.load_dir:
            return None
        found = list_steps(self.load_dir)
        if not found:
            same = self.save_dir and _same_dir(self.save_dir, self.load_dir)
            if same and tr.ckpt_step < 0:
                return None
            fix = "pass a checkpoint directory, or the same directory as --save to start fresh there"
            if not os.path.exists(self.load_dir):
                raise ConfigError(f"--load {self.load_dir} does not exist; {fix}")
            raise ConfigError(no_checkpoint(self.load_dir, fix))
        return resolve_step(self.load_dir, found, tr.ckpt_step)

    def restore(self, steps, step: int | None = -1):
        """The train state and loader position from `--load` (latest or `--ckpt-step`), or (None, 0).

        `step` is what `step_to_restore` already answered (None: start fresh); -1 looks it up here."""
        if step == -1:
            step = self._load_step()
        if step is None:
            if self.load_dir:
                _log(f"jax3d: no checkpoint in {self.load_dir} yet; starting from scratch")
            return None, 0
        tr = self.cfg.train
        fresh = {"step", "opt_state", "rng", "loss_scale", "fp8"} if tr.finetune else \
            {k for k, off in (("opt_state", tr.no_load_optim), ("rng", tr.no_load_rng)) if off}
        state, meta, fresh = restore_state(self.load_dir, step, steps, fresh,
                                           checked=self._checked == (self.load_dir, step))
        if self.save_dir and _same_dir(self.save_dir, self.load_dir):
            self._resumed_from = step
        params_only = not (meta.get("saved") or {}).get("train", True)  # an import: nothing else was saved
        notes = ["fine-tuning from step 0 with a fresh optimizer"] if tr.finetune else [] if params_only else [
            f"{what} started anew ({f'--no-load-{word}' if asked else f'it was saved with --no-save-{word}'})"
            for part, what, word, asked in (("opt_state", "Adam moments", "optim", tr.no_load_optim),
                                            ("rng", "RNG", "rng", tr.no_load_rng)) if part in fresh]
        _log(f"jax3d: {'loaded the weights of' if tr.finetune else 'restored'} step {step} from {self.load_dir} "
             f"(saved on (data, stage, model) = {tuple(meta['mesh'].values())}, "
             f"ZeRO-{meta['config']['parallel']['zero_stage']}, jax3d {meta['jax3d_version']})"
             + "".join(f"; {n}" for n in notes))
        return state, 0 if tr.finetune else int(meta["loader"]["consumed_samples"])

    # ---- save ----------------------------------------------------------------------------------------
    def manager(self):
        if self._mgr is None:
            self._mgr = manager(self.save_dir, read_only=False, keep=self.cfg.train.keep_checkpoints,
                                 async_save=self.async_save)
        return self._mgr

    def _meta(self, step: int, loader_state: dict, mesh, saved: dict) -> dict:
        import jax3d
        self.tokenizer = kept_in(self.save_dir, self.tokenizer)
        return {"format": "jax3d", "format_version": FORMAT_VERSION, "jax3d_version": jax3d.__version__,
                "step": int(step), "loader": {k: int(v) for k, v in loader_state.items()},
                "config": self.cfg.to_dict(), "tokenizer": self.tokenizer, "data": self.data,
                "saved": saved,
                "mesh": dict(zip(mesh.axis_names, (int(s) for s in mesh.devices.shape))) if mesh is not None else {},
                "process_count": jax.process_count(), "time": time.time()}

    def save(self, step: int, state, loader_state: dict, *, wait: bool = False) -> None:
        """Writes checkpoint `step` (asynchronously unless `wait`); the previous write is finished first."""
        mesh = _mesh_of(state.params)
        state = self._logical(state, mesh)
        tr = self.cfg.train
        train_part = {"step": state.step, "loss_scale": state.loss_scale,
                      **({} if tr.no_save_optim else {"opt_state": state.opt_state}),
                      **({} if tr.no_save_rng else {"rng": state.rng}),
                      **({} if state.fp8 is None else {"fp8": state.fp8})}
        self._write(step, state.params, train_part, loader_state, mesh,
                    {"optim": not tr.no_save_optim, "rng": not tr.no_save_rng}, wait)

    def save_params(self, step: int, params) -> None:
        """Writes checkpoint `step` of parameters alone (in logical layer order), and waits: an import's. A run
        that loads it starts its step, optimizer state, RNG and loss scale as a new run does (`restore_state`)."""
        self._write(step, params, None, {"consumed_samples": 0}, _mesh_of(params),
                    {"optim": False, "rng": False, "train": False}, wait=True)

    def _write(self, step: int, params, train_part: dict | None, loader_state: dict, mesh, saved: dict,
               wait: bool) -> None:
        ocp = orbax_checkpoint()
        mgr = self.manager()
        t0 = time.perf_counter()
        mgr.wait_until_finished()
        self._report_written()
        if self.cfg.train.keep_checkpoints == 1:
            self._join_checksums()  # this save deletes the step being summed
        # Steps past the one this run resumed from belong to an abandoned future (a rollback with
        # --ckpt-step), as do any at or past this one. That future is dropped once, at the first save:
        # later saves keep the steps this run wrote.
        after = step if self._resumed_from is None else min(step, self._resumed_from + 1)
        self._resumed_from = None
        stale = [s for s in mgr.all_steps() if s >= after]
        if stale:  # a rolled-back run overwrites the abandoned future, so "latest" stays this run's
            _log(f"jax3d: replacing checkpoints {stale} in {self.save_dir} from an earlier run")
            for s in stale:
                mgr.delete(s)
        items = {"params": ocp.args.StandardSave(params),
                 **({} if train_part is None else {"train": ocp.args.StandardSave(train_part)}),
                 "meta": ocp.args.JsonSave(self._meta(step, loader_state, mesh, saved))}
        args = ocp.args.Composite(**items)
        mgr.save(step, args=args, force=True)
        self._writing = (step, t0)
        if wait:
            mgr.wait_until_finished()
            self._report_written()
        self.last_save_blocked_s = time.perf_counter() - t0
        self._last_saved = step

    def _report_written(self) -> None:
        """Once the save being written is on disk: its file list and checksums (what `check_files` compares a
        later load with) and one line "saved step N to DIR (X GB, Y s)". The checksums read every byte, so
        each process sums its share in a thread, beside the training (a sync save waits for them)."""
        if self._writing is None:
            return
        step, t0 = self._writing
        self._writing = None
        if jax.process_index() == 0:
            total = record_files(self.save_dir, step)
            size = f"{total / 1e9:.2f} GB" if total >= 1e8 else f"{total / 1e6:.1f} MB"
            _log(f"jax3d: saved step {step} to {self.save_dir} ({size}, {time.perf_counter() - t0:.1f} s)")
        self._join_checksums()  # one at a time
        self._summing = threading.Thread(target=_sum_files, args=(self.save_dir, step), daemon=True,
                                         name=f"jax3d-checksums-{step}")
        self._summing.start()
        if not self.async_save:
            self._join_checksums()

    def _join_checksums(self) -> None:
        if self._summing is not None:
            self._summing.join()
            self._summing = None

    def _logical(self, state, mesh):
        """The state in logical layer order, as checkpoints hold it (the state itself when it is)."""
        if self.to_logical is not None:
            return self.to_logical(state)
        stages = int(mesh.shape[STAGE]) if mesh is not None and STAGE in mesh.shape else 1
        if state_layout(PipelineSpec.of(self.cfg, stages, data=1), self.cfg.model.num_layers) is not None:
            raise ValueError("this train state keeps its layers in pipeline order; pass "
                             "Checkpointer(..., to_logical=steps.logical_state) to save it in logical order")
        return state

    def due(self, step: int, force: bool = False) -> bool:
        """Whether `maybe_save` would save `step` (signals aside): a `--save-interval` multiple, or forced."""
        every = self.cfg.train.save_interval
        return bool(self.save_dir) and step != self._last_saved and (force or bool(every and step % every == 0))

    def maybe_save(self, step: int, state, loader_state: dict, force: bool = False, hold: bool = False) -> bool:
        """Saves at `--save-interval` multiples, when forced, and on a caught signal (then raises). With `hold`
        (the state's last updates were all skipped for non-finite gradients) nothing is saved: the save would
        rotate a checkpoint that still trains away (--keep-checkpoints) for one that may not."""
        if self._writing is not None and not self.manager().is_saving_in_progress():
            self._report_written()
        stop = self._stop_requested(step, force)
        if stop:
            saved = bool(self.save_dir) and (not hold or step == self._last_saved)
            if saved and step != self._last_saved:
                self.save(step, state, loader_state, wait=True)
            self.wait()
            raise TrainingInterrupted(stop, step, saved, "its last updates were skipped for non-finite "
                                      "gradients" if self.save_dir else "no --save")
        if hold or not self.due(step, force):
            return False
        self.save(step, state, loader_state)
        return True

    def newest(self) -> int | None:
        """The newest complete step in `--save`, or None."""
        found = list_steps(self.save_dir) if self.save_dir else []
        return found[-1] if found else None

    def wait(self) -> None:
        """Blocks until every pending write, checksums included, is on disk."""
        if self._mgr is not None:
            self._mgr.wait_until_finished()
            self._report_written()
        self._join_checksums()

    def close(self) -> None:
        if self._mgr is not None:
            self.wait()
            self._mgr.close()
            self._mgr = None
        self.uninstall_signal_handlers()

    # ---- signals -------------------------------------------------------------------------------------
    def install_signal_handlers(self, signums=(signal.SIGTERM, signal.SIGINT)) -> None:
        """SIGTERM / SIGINT set a flag; the next `maybe_save` writes a final checkpoint and raises
        TrainingInterrupted. A second signal of the same kind acts as if no handler were installed."""
        for s in signums:
            self._old_handlers[s] = signal.signal(s, self._on_signal)

    def uninstall_signal_handlers(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h)
        self._old_handlers = {}

    def _on_signal(self, signum, frame):
        if self._signal:
            old = self._old_handlers.get(signum, signal.SIG_DFL)
            self.uninstall_signal_handlers()
            if callable(old):
                return old(signum, frame)
            signal.raise_signal(signum)
            return None
        self._signal = signum
        _log(f"jax3d: {signal.Signals(signum).name} received; saving and stopping after this step "
             "(send it again to stop at once)")
        return None

    def _stop_requested(self, step: int, force: bool) -> int:
        if jax.process_count() == 1:
            return self._signal
        # All processes must stop at the same step for the collective save. Agree where the loop already
        # syncs (log steps) and at forced saves, so the check costs no extra device round trip.
        if not (force or step % self._sync_every == 0):
            return 0
        from jax.experimental import multihost_utils
        flags = multihost_utils.process_allgather(np.int32(self._signal))
        hit = [int(f) for f in np.ravel(flags) if f]
        return hit[0] if hit else 0


def restore_state(directory: str, step: int, steps, fresh=frozenset(), checked: bool = False):
    """Restores checkpoint `step` onto `steps` (the run's `Steps`, whose model is checked first and whose
    shardings, optimizer, new-run values and layer order the restore uses); returns (train state, meta, the
    parts started anew). The parts `fresh` names ("step", "opt_state", "rng", "loss_scale", "fp8"), and those
    the checkpoint was saved without (--no-save-optim, --no-save-rng), are not read but started as a new run
    starts them; a fresh optimizer state under a restored step counts from that step, so the learning-rate
    schedule goes on.
    `checked`: `check_files` already read the step's checksums."""
    meta = read_meta(directory, step)
    check_model_compatible(meta["config"]["model"], steps.cfg.model, f"{directory} step {step}")
    saved = meta.get("saved") or {}
    fresh = set(fresh) | {k for k, key in (("opt_state", "optim"), ("rng", "rng")) if not saved.get(key, True)}
    if not saved.get("train", True):  # parameters alone (an import): everything else starts as a new run's
        fresh |= {"step", "opt_state", "rng", "loss_scale", "fp8"}
    targets = with_shardings(steps.abstract_logical_state, steps.logical_shardings)
    parts = ("step", "opt_state", "rng", "loss_scale") + (("fp8",) if targets.fp8 is not None else ())
    if targets.fp8 is not None and not _same_fp8_history(meta["config"].get("precision", {}), steps.precision.fp8):
        fresh.add("fp8")  # saved without FP8, or with another history length: this run's history starts empty
    train_t = {k: getattr(targets, k) for k in parts if k not in fresh}
    items = {"params": targets.params, **({"train": train_t} if train_t else {})}
    saved_fp8 = bool(meta["config"].get("precision", {}).get("fp8"))  # histories this run leaves unread
    r = restore_arrays(directory, step, items, partial={"train"} if fresh or (saved_fp8 and targets.fp8 is None)
                       else (), checked=checked)
    t = dict(r.train) if train_t else {}
    shardings = steps.logical_shardings
    new = steps.new_run_parts() if fresh & {"step", "loss_scale", "rng"} else {}
    for k in ("step", "loss_scale", "rng"):
        if k in fresh:
            t[k] = jax.device_put(new[k], getattr(shardings, k))
    if "fp8" in fresh and targets.fp8 is not None:
        t["fp8"] = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype), a.sharding), targets.fp8)
    if "opt_state" in fresh:
        applied = int(t["step"]) - int(t["loss_scale"].skipped)  # optax counts the updates applied
        t["opt_state"] = jax.jit(lambda p: _counting_from(steps.optimizer.init(p), applied),
                                 out_shardings=shardings.opt_state)(r.params)
    state = targets.replace(step=t["step"], params=r.params, opt_state=t["opt_state"], rng=t["rng"],
                            loss_scale=t["loss_scale"], fp8=t.get("fp8"))
    return steps.state_from_logical(state), meta, fresh


def _same_fp8_history(saved_precision: dict, recipe) -> bool:
    """Whether a checkpoint's run (its recorded PrecisionConfig) kept the FP8 amax history this run's `recipe`
    keeps (FP8 on, the same length)."""
    return bool(saved_precision.get("fp8")) and saved_precision.get("fp8_amax_history_len") == recipe.history


def _counting_from(opt_state, count: int):
    """An optax state with every update counter (`count`) set to `count`."""
    def set_count(path, leaf):
        name = getattr(path[-1], "name", getattr(path[-1], "key", None)) if path else None
        return jax.numpy.full_like(leaf, count) if name == "count" else leaf
    return jax.tree_util.tree_map_with_path(set_count, opt_state)


def _sum_files(directory: str, step: int) -> None:
    """This process's share of a saved step's checksums; a failure costs only the check they would allow."""
    try:
        record_checksums(directory, step, jax.process_index(), jax.process_count())
    except OSError as e:  # the step deleted meanwhile, a disk that filled up
        print(f"jax3d: no checksums for step {step} in {directory} ({e}); it still restores, unchecked",
              file=sys.stderr, flush=True)


def _mesh_of(params):
    for leaf in jax.tree.leaves(params):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return mesh
    return None


def _log(msg: str) -> None:
    if jax.process_index() == 0:
        print(msg, file=sys.stderr, flush=True)
