"""One training run, from a parsed config to its last record: what `launch/train.py` calls once it has parsed
its flags and set up the devices.

    adopt (with --load)  the checkpoint's model, and when resuming its data, tokenizer and run (jax3d.train.resume)
    tokenizer            fixes the vocabulary, so it comes before the plan
    plan                 jax3d.parallel.plan.resolve, once: layout, ZeRO, pipeline, counts, kernels
    header               the run's first line, and the caller's notes on its flags
    dry run or train     jax3d.train.dry_run, or the data, the checkpointer and jax3d.train.loop.train
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from jax3d.config import Config, ConfigError


@dataclass(frozen=True)
class RunOptions:
    """How to run a config, beyond what the config says: where --load reads (and which flags the command line
    gave, which a resumed run keeps over its checkpoint's), a dry run, the progress bar and the memory check."""

    given: frozenset[str] = field(default_factory=frozenset)  # argparse dests the command line set
    exit_on_missing_checkpoint: bool = False
    dry_run: bool = False
    progress: bool = True
    memory_check: bool = True


def header(plan, num_params: int) -> str:
    """The run's first line: model, size, layout (and how it was chosen), ZeRO, dtype, batch."""
    cfg, mesh = plan.cfg, plan.mesh
    m, tr = cfg.model, cfg.train
    par = cfg.parallel
    pipeline = ""
    if mesh.stage > 1:
        layers = f", layers {','.join(map(str, par.pipeline_layout))}" if par.pipeline_layout else ""
        pipeline = f"; {par.pipeline_schedule} pipeline over {plan.pipeline.microbatches} micro-batches{layers}"
    size = f"{num_params / 1e9:.1f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"
    return (f"jax3d: {m.model_type} {m.num_layers}L d{m.hidden_size} ({size} params) on "
            f"(data, stage, model) = ({mesh.data}, {mesh.stage}, {mesh.model}), {plan.layout_note}{pipeline}; "
            f"ZeRO-{par.zero_stage}, {plan.precision.describe()}, "
            f"global batch {tr.global_batch_size} x {m.seq_length} tokens")


def _adopt(cfg: Config, options: RunOptions):
    """(`cfg` with what `--load` takes from its checkpoint, the model fields it took, the step whose files were
    checked or None), the notes said on the way."""
    import jax

    from jax3d.checkpoint.read import check_files, list_steps, read_meta, resolve_step
    from jax3d.train.resume import adopt_saved_model, adopt_saved_run, adopt_saved_tokenizer

    load, tr = cfg.train.load, cfg.train
    found = list_steps(load)
    if not found and options.exit_on_missing_checkpoint:
        raise ConfigError(f"--load {load} holds no checkpoint and --exit-on-missing-checkpoint stops rather "
                          "than start from random weights; check the path, or drop the flag to start afresh")
    step = resolve_step(load, found, tr.ckpt_step) if found else None
    checked = None
    if found:
        check_files(load, step)  # a damaged checkpoint is named before anything else is said
        checked = step  # its checksums read every byte: once is enough
    # what the checkpoint set, including values that equal a flag's default
    cfg, from_checkpoint = adopt_saved_model(cfg, load, tr.ckpt_step, set(options.given))
    if found:  # resuming: the checkpoint's data, tokenizer, optimizer and seed, unless flags say otherwise
        meta = read_meta(load, step)
        adopted = adopt_saved_run(cfg, load, meta, set(options.given))
        # other data (a fine-tune, --override-data) is read with the checkpoint's tokenizer unless flags name one
        cfg, tok_note = adopt_saved_tokenizer(adopted.cfg, load, meta, set(options.given))
        if jax.process_index() == 0:
            for note in [*adopted.notes, *([tok_note] if tok_note else [])]:
                print(f"jax3d: --load {load}: {note}", file=sys.stderr)
    return cfg, from_checkpoint, checked


def run(cfg: Config, options: RunOptions = RunOptions(), *, on_plan: Callable | None = None) -> int:
    """Trains `cfg` (or with `options.dry_run` prints the compiled step's memory) on JAX's devices; returns the
    exit code. `on_plan(plan)` checks the plan against the caller's own rules (raising ConfigError) and returns the
    lines the run header adds (the command line's notes on its flags). Raises ConfigError for bad input."""
    import jax

    from jax3d.models import build_model
    from jax3d.parallel.plan import resolve
    from jax3d.train.inputs import tokenizer_and_paths, with_default_tokenizer, with_eod_token

    load = cfg.train.load
    from_checkpoint, checked = (), None
    if load:  # fine-tuning: the checkpoint's model unless a flag says otherwise
        cfg, from_checkpoint, checked = _adopt(cfg, options)
    # The tokenizer fixes the vocabulary, so it comes before the plan; the datasets come after it. The type
    # Megatron's scripts leave to their trainer's default is set here, so the checkpoint records it.
    cfg = with_default_tokenizer(cfg)
    tok, paths = tokenizer_and_paths(cfg)
    cfg = with_eod_token(cfg, tok)
    if load:
        from jax3d.checkpoint.tokenizer import check_same_tokenizer
        check_same_tokenizer(load, cfg.train.ckpt_step, tok)
    plan = resolve(cfg, jax.device_count(), tok.vocab_size, checkpoint=load, from_checkpoint=from_checkpoint)
    cfg = plan.cfg  # settled: counts in samples and tokens, on the final batch and sequence
    if checked is not None:
        from jax3d.train.loop import check_not_past_end
        check_not_past_end(checked, cfg.train)
    notes = on_plan(plan) if on_plan is not None else []
    if jax.process_index() == 0:
        print(header(plan, build_model(cfg.model).num_params()), file=sys.stderr)
        for note in notes:
            print(note, file=sys.stderr)
        if note := plan.precision.autotuning_note:
            print(note, file=sys.stderr)
        if cfg.parallel.sequence_parallel and plan.mesh.model == 1:
            print("jax3d: --sequence-parallel shards activations over tensor parallelism, which is 1 here, so it "
                  "changes nothing", file=sys.stderr)
    if options.dry_run:
        from jax3d.train.dry_run import dry_run
        print(json.dumps(dry_run(plan)))
        return 0
    return _train(plan, tok, paths, checked, options)


def _train(plan, tok, paths, checked, options: RunOptions) -> int:
    import jax

    from jax3d.checkpoint.checkpointer import TrainingInterrupted
    from jax3d.train.inputs import build_inputs
    from jax3d.train.loop import train
    from jax3d.train.skipped import SkippedStepsStop

    cfg = plan.cfg
    tr = cfg.train
    n_train = tr.train_iters * tr.global_batch_size
    # Every evaluation reads the same first eval_iters batches of the validation split, so the curve
    # compares like with like.
    n_valid = tr.eval_iters * tr.global_batch_size if tr.eval_interval else 0
    inputs = build_inputs(cfg, n_train, n_valid, tok, paths)
    mesh = plan.mesh.build()
    checkpointer = None
    if tr.save or tr.load:
        from jax3d.checkpoint.checkpointer import Checkpointer
        checkpointer = Checkpointer(cfg, tokenizer=inputs.tokenizer, checked=checked)
        checkpointer.install_signal_handlers()
    try:
        last = train(plan, mesh, inputs, progress=options.progress, checkpointer=checkpointer,
                     memory_check=options.memory_check)
    except TrainingInterrupted as e:
        print(f"jax3d: {e}", file=sys.stderr)
        return e.exit_code  # 143 for SIGTERM, 130 for SIGINT
    except SkippedStepsStop as e:
        if jax.process_index() == 0:
            kept = checkpointer.newest() if checkpointer is not None and tr.save else None
            print(f"jax3d: {e}" + (f", keeping the checkpoints in {tr.save} (the newest is step {kept})" if kept
                                   is not None else " (no checkpoint was saved)" if tr.save else "")
                  + "; lower --lr, or set --clip-grad, and resume from a checkpoint of before the trouble",
                  file=sys.stderr)
        return e.exit_code
    finally:
        if checkpointer is not None:
            checkpointer.uninstall_signal_handlers()
    if jax.process_index() == 0 and last:
        print(json.dumps({k: last[k] for k in ("step", "loss", "val_loss", "tokens_per_s", "mfu") if k in last}))
        if not tr.save:  # generate, evaluate and export all start from a checkpoint
            print("jax3d: no --save was given, so the trained model was not kept; add --save DIR to keep it",
                  file=sys.stderr)
    return 0
